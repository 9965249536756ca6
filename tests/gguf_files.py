"""Tiny GGUF files for tests, written with the gguf package's writer from a
random transformers model: the conventions llama.cpp's converter follows
(Gemma norms stored as 1 + w, llama q/k rows permuted for its rotary
layout), names from transformers' own GGUF name map, a small SentencePiece-
style vocabulary. transformers reads them back through its GGUF path, which
is what the engine's GGUF loader and the oracle both use."""

from __future__ import annotations

import numpy as np
import torch

WORDS = ["the", "library", "book", "floor", "opens", "at", "nine", "and", "closes", "on", "sunday", "where",
         "is", "room", "study", "quiet", "a", "of", "to", "in"]


def vocabulary():
    """(tokens, scores, types): specials, 256 byte tokens, some words."""
    specials = ["<pad>", "<eos>", "<bos>", "<unk>"]
    tokens = specials + [f"<0x{b:02X}>" for b in range(256)] + [f"\u2581{w}" for w in WORDS] + WORDS
    types = [3, 3, 3, 2] + [6] * 256 + [1] * (2 * len(WORDS))
    scores = [0.0] * 4 + [0.0] * 256 + [-float(i) for i in range(2 * len(WORDS))]
    return tokens, scores, types


def build_model(family: str, seed: int = 0):
    from transformers import (Gemma2Config, Gemma2ForCausalLM, Gemma3ForCausalLM, Gemma3TextConfig, LlamaConfig,
                              LlamaForCausalLM)

    tokens, _, _ = vocabulary()
    torch.manual_seed(seed)
    common = dict(vocab_size=len(tokens), hidden_size=64, intermediate_size=128, num_hidden_layers=6,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=1024,
                  rms_norm_eps=1e-6, pad_token_id=0, eos_token_id=1, bos_token_id=2)
    if family == "gemma3":
        config = Gemma3TextConfig(**common, sliding_window=16, query_pre_attn_scalar=256,
                                  rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                                                   "sliding_attention": {"rope_type": "default",
                                                                         "rope_theta": 1e4}})
        model = Gemma3ForCausalLM(config)
    elif family == "gemma2":  # soft-capping at transformers' defaults: GGUF has no keys for them
        model = Gemma2ForCausalLM(Gemma2Config(**common, sliding_window=16, query_pre_attn_scalar=256))
    else:
        model = LlamaForCausalLM(LlamaConfig(**common, rope_theta=10000.0, tie_word_embeddings=False))
    with torch.no_grad():  # norms away from their init so that the +1 convention matters
        for name, param in model.named_parameters():
            if "norm" in name:
                param.normal_(0.0, 0.2)
    return model.eval()


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's rotary layout for q/k rows (transformers undoes it on load)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(model, path: str, family: str, tensor_type: str = "F32", truncate_to: int | None = None,
               add_bos: bool = True) -> str:
    """Write `model` as a GGUF file of `family` ("gemma3", "gemma2" or "llama");
    matrices stored as `tensor_type` (F32, F16, Q8_0, or a type the
    dequantizer lacks, to test the error), norms as F32."""
    import gguf
    from transformers.modeling_gguf_pytorch_utils import TensorProcessor, get_gguf_hf_weights_map

    config = model.config
    to_hf = get_gguf_hf_weights_map(model, TensorProcessor())
    from_hf = {hf: name for name, hf in to_hf.items()}
    writer = gguf.GGUFWriter(path, family)
    writer.add_name(f"tiny-{family}")
    arch = family
    writer.add_uint32(f"{arch}.context_length", config.max_position_embeddings)
    writer.add_uint32(f"{arch}.embedding_length", config.hidden_size)
    writer.add_uint32(f"{arch}.block_count", config.num_hidden_layers)
    writer.add_uint32(f"{arch}.feed_forward_length", config.intermediate_size)
    writer.add_uint32(f"{arch}.attention.head_count", config.num_attention_heads)
    writer.add_uint32(f"{arch}.attention.head_count_kv", config.num_key_value_heads)
    writer.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", config.rms_norm_eps)
    if family.startswith("gemma"):
        writer.add_uint32(f"{arch}.attention.key_length", config.head_dim)
        writer.add_uint32(f"{arch}.attention.value_length", config.head_dim)
        writer.add_uint32(f"{arch}.attention.sliding_window", config.sliding_window)
        writer.add_float32(f"{arch}.rope.freq_base", 1e6)
    else:
        writer.add_uint32(f"{arch}.rope.dimension_count", config.head_dim)
        writer.add_float32(f"{arch}.rope.freq_base", 10000.0)
    tokens, scores, types = vocabulary()
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_bos_token_id(2)
    writer.add_eos_token_id(1)
    writer.add_unk_token_id(3)
    writer.add_pad_token_id(0)
    writer.add_add_bos_token(add_bos)
    qtype = gguf.GGMLQuantizationType[tensor_type]
    for hf_name, tensor in model.state_dict().items():
        if hf_name == "lm_head.weight" and getattr(config, "tie_word_embeddings", False):
            continue
        w = tensor.float().numpy()
        if family.startswith("gemma") and "norm" in hf_name:
            w = w + 1.0
        if family == "llama" and ".q_proj." in hf_name:
            w = _permute(w, config.num_attention_heads)
        if family == "llama" and ".k_proj." in hf_name:
            w = _permute(w, config.num_key_value_heads)
        name = from_hf[hf_name]
        if w.ndim == 1 or tensor_type == "F32":
            writer.add_tensor(name, w.astype(np.float32))
        elif tensor_type == "F16":
            writer.add_tensor(name, w.astype(np.float16))
        elif tensor_type == "Q8_0":
            writer.add_tensor(name, gguf.quantize(w, qtype), raw_dtype=qtype)
        else:  # bytes of the right size for a type; the values do not matter
            block, size = gguf.GGML_QUANT_SIZES[qtype]
            raw = np.zeros((w.shape[0], w.shape[1] // block * size), dtype=np.uint8)
            writer.add_tensor(name, raw, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    if truncate_to is not None:
        with open(path, "r+b") as f:
            f.truncate(truncate_to)
    return path
