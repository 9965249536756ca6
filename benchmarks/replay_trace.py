"""The trace the manager benchmarks replay (manager_overhead.py,
vllm_replay.py, kv_event_wire.py), and the model configs they replay it on:
one module both sides import, so neither imports the other."""

from __future__ import annotations

import os
import random

MODELS_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "models")
CONFIGS = {"full-only (Llama-3.1-8B)": "llama-3.1-8b.json", "Gemma-3-27B": "gemma-3-27b.json",
           "Jamba-1.5-Mini": "jamba-1.5-mini.json"}


def make_trace(num_requests: int, seed: int = 0, prompt=(200, 2000), output=(50, 500), shared=500, share=0.7):
    rng = random.Random(seed)
    system = [rng.randrange(1, 32000) for _ in range(shared)]
    trace = []
    for _ in range(num_requests):
        length = rng.randint(*prompt)
        if rng.random() < share and length > shared:
            tokens = system + [rng.randrange(1, 32000) for _ in range(length - shared)]
        else:
            tokens = [rng.randrange(1, 32000) for _ in range(length)]
        trace.append((tokens, rng.randint(*output), [rng.randrange(1, 32000) for _ in range(8)]))
    return trace
