"""Other engines using hybridkv: its cache rules and its tiers below their
pools, through each engine's public extension point.

    vllm/   a KV connector for vLLM 0.32: host-memory and disk prefix tiers
            per KV cache group, with hybridkv's hit rule (docs/integrations.md)
"""
