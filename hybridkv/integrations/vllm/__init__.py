"""hybridkv inside vLLM: a KV connector that gives vLLM's KV pool a host-memory
tier and a disk tier per KV cache group, with hybridkv's hit rule, the disk
tier surviving restarts. Tested with vLLM 0.32.0 (`pip install
'hybridkv[vllm]'`; docs/integrations.md has the whole story):

    vllm serve MODEL --enable-prefix-caching --kv-transfer-config \\
      '{"kv_connector": "HybridkvConnector",
        "kv_connector_module_path": "hybridkv.integrations.vllm",
        "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"host_memory": "4GiB", "disk_dir": "/var/cache/hybridkv"}}'

    connector.py  the class vLLM loads; each call to its side
    scheduler.py  hits (hybridkv's rule over the tiers), stores, KV events
    worker.py     bytes between vLLM's layer tensors and the tier storage
    plan.py       what the two sides tell each other each step
    groups.py     vLLM's groups as a hybridkv layout; keys; the identity on disk
    options.py    kv_connector_extra_config
    proxy.py      prefill and decode on two vLLM servers behind one address

The connector is imported when vLLM asks for it (the proxy runs without
importing vLLM).
"""

__all__ = ["HybridkvConnector"]


def __getattr__(name: str):
    if name == "HybridkvConnector":
        from .connector import HybridkvConnector

        return HybridkvConnector
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
