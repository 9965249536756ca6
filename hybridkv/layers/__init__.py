"""Layers and cache ops (torch): norms, rotary embeddings, paged attention,
Mamba state ops. The torch versions here are the reference the Triton
kernels are checked against."""
