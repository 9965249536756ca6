"""The worked example of docs/observability.md: why a Jamba prompt missed.

Run from the repository root: python docs/examples/jamba_explain.py
"""

from hybridkv.core import KVCacheManager, plan_layout
from hybridkv.core.hf_config import load_config, specs_from_config

specs = specs_from_config(load_config("models/jamba-1.5-mini.json"))
kv = KVCacheManager(plan_layout(specs, memory_bytes=8 << 30, block_size=16))
system = list(range(1000, 1700))  # a 700-token system prompt


def run(request_id, tokens, chunk=512):
    """Compute a prompt as a scheduler would: chunks ending at checkpoints."""
    kv.add_request(request_id, tokens)
    while kv.num_computed_tokens(request_id) < len(tokens):
        size = kv.next_chunk(request_id, chunk)
        assert kv.allocate_slots(request_id, size)
        kv.mark_computed(request_id, size)


run("first", system + list(range(50, 90)))
kv.free("first")
kv.add_request("second", system + list(range(200, 230)))
print(kv.explain_hit("second"))
run("third", system + list(range(300, 330)))
kv.free("third")
kv.add_request("fourth", system + list(range(400, 420)))
print(kv.explain_hit("fourth"))
print("capped tokens per group:", dict(zip(kv.stats.group_kinds, kv.stats.capped_tokens)))
