"""Replay manager_overhead.py's request trace through vLLM's own KVCacheManager.

vLLM is an optional dependency: nothing here imports it at module level, and
`import_vllm()` raises a clear error when it is missing. Only vLLM's public
(and a few engine-internal) functions are called; no vLLM code is copied.

The manager is built the way vLLM's engine core builds it for the model:

* per-layer KV cache specs as the model's layers would report them
  (`FullAttentionSpec` / `SlidingWindowSpec` / `MambaSpec`, bfloat16 KV; the
  Mamba state shapes and dtypes from the model class's own
  `get_mamba_state_shape_from_config` / `get_mamba_state_dtype_from_config`),
  with block_size 16 and prefix caching on;
* for hybrid attention/Mamba models, vLLM's config hooks
  (`HybridAttentionMambaModelConfig.verify_and_update_config`: Mamba cache
  mode "align", the default with prefix caching) and the platform's
  `_align_hybrid_block_size` for the GPU FlashAttention backend (it raises the
  attention block size until an attention page holds a Mamba state, and pads
  the Mamba page to the attention page);
* grouping, page-size unification and the pool size from
  `kv_cache_utils.get_kv_cache_configs` for the KV budget, then
  `generate_scheduler_kv_cache_config` and `resolve_kv_cache_block_sizes`
  (hash block size, default sha256 block hasher), in the order
  `EngineCore._initialize_kv_caches` calls them;
* `KVCacheManager(...)` with the arguments the Scheduler passes (stats and
  KV events off, no connector, watermark 0), and the engine's
  `freeze_gc_heap()` after start-up (`run(freeze_gc=False)` to skip it).

`replay` mirrors `manager_overhead.replay`: FCFS admission (a Request carrying
the block hasher, `get_computed_blocks`, one `allocate_slots` for the whole
prompt with the hit, then `num_computed_tokens` advanced as the scheduler
does), one decode token per running request per step (append the token,
`allocate_slots(req, 1)`, advance), frees of finished requests, and recompute
preemption of the newest running request when a decode step finds no block.
Timed like the hybridkv replay: an admission includes building the vLLM
Request, which is where vLLM hashes the prompt's blocks (hybridkv hashes inside
its admission too; `us_per_request_build` reports that part), and a decode
request-step includes appending the token (which hashes a block it completes).
Per step the manager calls the Scheduler makes (`new_step_starts`, draining
boundary-state offloads, block copies and new block ids) count as decode time.
The prompt is allocated in one call, as in the hybridkv loop; vLLM's scheduler
would also end prefill chunks at Mamba checkpoint positions ("align" mode),
which this loop does not do, so Mamba states are only cached at prompt ends.
"""

from __future__ import annotations

import gc
import logging
import os
import sys
import time
import types

from benchmarks import harness
from benchmarks.replay_trace import CONFIGS, MODELS_DIR, make_trace
from hybridkv.core.hf_config import load_config, specs_from_config, text_config
from hybridkv.core.layout import parse_memory
from hybridkv.core.specs import FullAttentionSpec as HKFull
from hybridkv.core.specs import MambaSpec as HKMamba
from hybridkv.core.specs import SlidingWindowSpec as HKSliding

BLOCK_SIZE = 16


class VLLMUnavailable(RuntimeError):
    pass


def import_vllm():
    """Import vLLM (quietly), or raise VLLMUnavailable with a hint."""
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    try:
        import vllm  # noqa: F401
        from vllm.v1.core.kv_cache_manager import KVCacheManager  # noqa: F401
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise VLLMUnavailable(
            f"--against vllm needs vLLM installed in this Python ({sys.executable}): {e}. "
            "Install it (pip install vllm) or run with the interpreter of an environment that has it."
        ) from None
    return vllm


class _ModelConfigStub:
    """The few ModelConfig fields the KV cache set-up reads, from config.json
    (a full ModelConfig would inspect the model class in a subprocess and need
    every multimodal dependency; none of that affects the KV cache)."""

    model_impl = "auto"
    convert_type = "none"
    runner_type = "generate"
    use_mla = False

    def __init__(self, config: dict, attn: tuple[int, int] | None):
        import torch

        cfg = text_config(config)
        self.hf_config = types.SimpleNamespace(**cfg)
        self.hf_text_config = self.hf_config
        self.architecture = (config.get("architectures") or ["?"])[0]
        raw = str(cfg.get("torch_dtype") or config.get("torch_dtype") or "bfloat16").replace("torch.", "")
        self.dtype = getattr(torch, raw)
        self.max_model_len = int(cfg.get("max_position_embeddings") or 8192)
        self.original_max_model_len = self.max_model_len
        self._attn = attn

    def get_num_kv_heads(self, parallel_config) -> int:
        return self._attn[0] // parallel_config.tensor_parallel_size

    def get_head_size(self) -> int:
        return self._attn[1]


def build_manager(config_path: str, memory, block_size: int = BLOCK_SIZE):
    """vLLM's KVCacheManager for the model in `config_path` with `memory` bytes
    of KV cache, plus the request block hasher and a description."""
    import_vllm()
    import torch
    from vllm.config import CacheConfig, VllmConfig
    from vllm.model_executor.layers.attention.attention import _largest_kernel_block_within
    from vllm.model_executor.models import ModelRegistry
    from vllm.model_executor.models.config import HybridAttentionMambaModelConfig
    from vllm.platforms.interface import Platform
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend
    from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum
    from vllm.v1.attention.backends.utils import get_supported_kv_cache_layouts, resolve_kv_cache_layout
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.core.kv_cache_utils import (generate_scheduler_kv_cache_config, get_kv_cache_configs,
                                             get_request_block_hasher, init_none_hash,
                                             resolve_cache_hit_alignment_tokens, resolve_kv_cache_block_sizes)
    from vllm.v1.core.single_type_kv_cache_manager import register_all_kvcache_specs
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec, SlidingWindowSpec, get_kv_quant_mode

    vllm_logger = logging.getLogger("vllm")
    level = vllm_logger.level
    vllm_logger.setLevel(logging.ERROR)  # set-up chatter (padding layers, block sizes); nothing logs in the hot path
    try:
        config = load_config(config_path)
        hk_specs = specs_from_config(config)  # only for which layer is which kind (same config.json parsing)
        attn = next(((s.num_kv_heads, s.head_size) for s in hk_specs.values()
                     if isinstance(s, (HKFull, HKSliding))), None)
        has_mamba = any(isinstance(s, HKMamba) for s in hk_specs.values())
        model_config = _ModelConfigStub(config, attn)

        cache_config = CacheConfig(block_size=block_size, enable_prefix_caching=True)
        vllm_config = VllmConfig(cache_config=cache_config)
        vllm_config.model_config = model_config  # after __post_init__: the stub only feeds the KV cache set-up
        backend = FlashAttentionBackend  # what a GPU engine runs these attention layers with
        attention_block_size = cache_config.block_size
        model_cls = None
        if has_mamba:
            HybridAttentionMambaModelConfig.verify_and_update_config(vllm_config)  # mamba_cache_mode, mamba_block_size
            Platform._align_hybrid_block_size(vllm_config, backend)  # attention block >= Mamba page, Mamba padding
            attention_block_size = cache_config.block_size
            model_cls, _ = ModelRegistry.resolve_model_cls(model_config.architecture, model_config=model_config)
        register_all_kvcache_specs(vllm_config)

        kv_dtype = (model_config.dtype if cache_config.cache_dtype == "auto"
                    else getattr(torch, cache_config.cache_dtype))
        quant = get_kv_quant_mode(cache_config.cache_dtype)
        kv_cache_spec = {}
        for name, spec in hk_specs.items():
            i = int(name.rsplit(".", 1)[1])
            if isinstance(spec, HKMamba):
                # MambaBase.get_kv_cache_spec
                kv_cache_spec[f"model.layers.{i}.mamba"] = MambaSpec(
                    shapes=tuple(model_cls.get_mamba_state_shape_from_config(vllm_config)),
                    dtypes=model_cls.get_mamba_state_dtype_from_config(vllm_config),
                    block_size=cache_config.mamba_block_size,
                    page_size_padded=cache_config.mamba_page_size_padded,
                    mamba_type=MambaAttentionBackendEnum.MAMBA1 if config.get("model_type") == "jamba"
                    else MambaAttentionBackendEnum.MAMBA2,
                    mamba_cache_mode=cache_config.mamba_cache_mode,
                    num_speculative_blocks=0)
            elif isinstance(spec, HKSliding):
                # Attention.get_kv_cache_spec, sliding-window branch
                probe = backend.customize_spec(SlidingWindowSpec(
                    block_size=1, num_kv_heads=spec.num_kv_heads, head_size=spec.head_size,
                    dtype=kv_dtype, kv_quant_mode=quant, sliding_window=spec.sliding_window))
                per_token = probe.real_page_size_bytes
                sw_block = _largest_kernel_block_within(backend, per_token, per_token * cache_config.block_size,
                                                        cache_config.block_size, probe)
                kv_cache_spec[f"model.layers.{i}.self_attn.attn"] = SlidingWindowSpec(
                    block_size=sw_block, num_kv_heads=spec.num_kv_heads, head_size=spec.head_size,
                    dtype=kv_dtype, kv_quant_mode=quant, sliding_window=spec.sliding_window)
            elif isinstance(spec, HKFull):
                kv_cache_spec[f"model.layers.{i}.self_attn.attn"] = FullAttentionSpec(
                    block_size=cache_config.block_size, num_kv_heads=spec.num_kv_heads,
                    head_size=spec.head_size, dtype=kv_dtype, kv_quant_mode=quant)
            else:
                raise ValueError(f"{name}: {type(spec).__name__} layers are not wired into the vLLM replay")

        # EngineCore._initialize_kv_caches
        backends = [backend]
        if has_mamba:
            backends.append(MambaAttentionBackendEnum.MAMBA1.get_class()
                            if config.get("model_type") == "jamba" else MambaAttentionBackendEnum.MAMBA2.get_class())
        layouts = get_supported_kv_cache_layouts(backends)
        layout = resolve_kv_cache_layout(vllm_config, [[m.name for m in layouts]], list(kv_cache_spec.values()))
        memory_bytes = parse_memory(memory)
        kv_cache_configs = get_kv_cache_configs(vllm_config, [kv_cache_spec], [memory_bytes])
        for c in kv_cache_configs:
            c.kv_cache_layout = cache_config.kv_cache_layout
        kv_cache_config = generate_scheduler_kv_cache_config(kv_cache_configs)
        groups = kv_cache_config.kv_cache_groups
        participating = [g.kv_cache_spec.block_size for g in groups if g.kv_cache_spec.prefix_cacheable]
        cache_config.block_size = min(participating or [g.kv_cache_spec.block_size for g in groups])
        scheduler_block_size, hash_block_size = resolve_kv_cache_block_sizes(kv_cache_config, vllm_config)
        alignment = resolve_cache_hit_alignment_tokens(kv_cache_config, vllm_config, scheduler_block_size,
                                                       hash_block_size)
        kv_cache_config.hash_block_size = hash_block_size
        kv_cache_config.cache_hit_alignment_tokens = alignment

        # Scheduler.__init__
        kv = KVCacheManager(
            kv_cache_config=kv_cache_config,
            max_model_len=model_config.max_model_len,
            max_in_flight_tokens=vllm_config.max_in_flight_tokens,
            enable_caching=cache_config.enable_prefix_caching,
            use_eagle=False,
            num_prefill_lookahead=vllm_config.num_prefill_lookahead_tokens,
            log_stats=False,
            enable_kv_cache_events=False,
            dcp_world_size=1,
            pcp_world_size=1,
            scheduler_block_size=scheduler_block_size,
            hash_block_size=hash_block_size,
            metrics_collector=None,
            watermark=vllm_config.scheduler_config.watermark,
            enable_mamba_shared_prefix_checkpoint=cache_config.enable_mamba_shared_prefix_checkpoint,
        )
        # EngineCore.__init__: the request block hasher
        hash_fn = get_hash_fn_by_name(cache_config.prefix_caching_hash_algo)
        init_none_hash(hash_fn)
        hasher = get_request_block_hasher(hash_block_size, hash_fn)
    finally:
        vllm_logger.setLevel(level)

    sizes = [len(g.layer_names) for g in groups]
    info = {
        "groups": len(groups),
        "group_kinds": [f"{type(g.kv_cache_spec).__name__}(block_size={g.kv_cache_spec.block_size}, "
                        f"layers={len(g.layer_names)})" for g in groups],
        "padding_layers": len(groups) * max(sizes) - sum(sizes),
        "num_blocks": kv_cache_config.num_blocks,
        "block_bytes": kv_cache_config.kv_cache_tensors[0].size // kv_cache_config.num_blocks,
        "layer_page_bytes": sorted({spec.page_size_bytes for spec in kv_cache_spec.values()}),
        "attention_block_size": attention_block_size,
        "scheduler_block_size": scheduler_block_size,
        "hash_block_size": hash_block_size,
        "hash_algo": cache_config.prefix_caching_hash_algo,
        "mamba_cache_mode": cache_config.mamba_cache_mode if has_mamba else None,
        "mamba_state_dtypes": ([str(d).replace("torch.", "") for d in
                                next(s for s in kv_cache_spec.values() if isinstance(s, MambaSpec)).dtypes]
                               if has_mamba else None),
        "max_model_len": model_config.max_model_len,
        "kv_cache_layout": layout.name,
    }
    return kv, hasher, info


def replay(kv, hasher, trace, max_running: int = 256) -> dict:
    """manager_overhead.replay's loop, against vLLM's KVCacheManager."""
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request, RequestStatus

    params = SamplingParams(max_tokens=1 << 30)  # lengths are the trace's; one shared object, built once
    RUNNING = RequestStatus.RUNNING
    waiting = [(f"r{i}", list(tokens), outputs, samples) for i, (tokens, outputs, samples) in enumerate(trace)]
    waiting.reverse()  # pop() from the end = FCFS
    pending: dict[str, Request] = {}  # requests built but not yet admitted (a failed admission keeps its Request)
    running: dict[str, list] = {}  # id -> [outputs left, samples, tokens so far, Request]
    admit_time = failed_time = decode_time = build_time = 0.0
    admissions = failed = decode_steps = preemptions = 0
    queried = hit_tokens = 0
    peak_used = 0
    pool = kv.block_pool
    usable = pool.num_gpu_blocks - 1  # the null block is never handed out
    perf = time.perf_counter
    while waiting or running:
        t0 = perf()
        kv.new_step_starts()  # Scheduler.schedule() opens every step with it
        decode_time += perf() - t0
        while waiting and len(running) < max_running:
            rid, tokens, outputs, samples = waiting[-1]
            t0 = perf()
            req = pending.get(rid)
            if req is None:  # EngineCore.add_request: the Request hashes its full blocks
                req = pending[rid] = Request(rid, tokens, params, None, block_hasher=hasher)
                build_time += perf() - t0
            blocks, hit, req.shared_prefix_boundary = kv.get_computed_blocks(req)
            new_blocks = kv.allocate_slots(req, req.num_tokens - hit, num_new_computed_tokens=hit,
                                           new_computed_blocks=blocks, full_sequence_must_fit=True,
                                           has_scheduled_reqs=bool(running))
            if new_blocks is None:
                failed_time += perf() - t0
                failed += 1
                if not running:
                    raise RuntimeError("a single request does not fit the pool")
                break
            req.num_computed_tokens = hit  # Scheduler.schedule(): the hit is computed ...
            req.num_computed_tokens += req.num_tokens - hit  # ... and _update_after_schedule adds the chunk
            req.status = RUNNING
            admit_time += perf() - t0
            admissions += 1
            queried += req.num_tokens
            hit_tokens += hit
            waiting.pop()
            del pending[rid]
            running[rid] = [outputs, samples, tokens, req]
        peak_used = max(peak_used, usable - pool.get_num_free_blocks())
        t0 = perf()
        finished = []
        preempted = []
        for rid, state in running.items():
            if rid in preempted:
                continue
            token = state[1][state[0] & 7]
            req = state[3]
            req.append_output_token_ids(token)  # hashes the block it completes
            while kv.allocate_slots(req, 1) is None:
                victim = next(r for r in reversed(running) if r not in preempted)
                preempted.append(victim)
                if victim == rid:
                    break
                kv.free(running[victim][3])
            if rid in preempted:
                kv.free(req)
                continue
            req.num_computed_tokens += 1
            state[2].append(token)
            state[0] -= 1
            decode_steps += 1
            if state[0] <= 0:
                finished.append(rid)
        for rid in finished:
            kv.free(running[rid][3])
            del running[rid]
        for rid in reversed(preempted):
            outputs, samples, tokens, _ = running.pop(rid)
            waiting.append((rid, tokens, outputs, samples))  # a fresh Request with the tokens so far
            preemptions += 1
        # What Scheduler.schedule() drains from the manager every step.
        kv.take_boundary_state_offloads()
        _, retained = kv.take_kv_cache_block_copies()
        if retained:
            pool.free_blocks(retained)
        kv.take_new_block_ids()
        decode_time += perf() - t0
    return {
        "admissions": admissions,
        "us_per_admission": 1e6 * admit_time / max(1, admissions),
        "failed_admissions": failed,
        "us_per_failed_admission": 1e6 * failed_time / max(1, failed),
        "preemptions": preemptions,
        "decode_request_steps": decode_steps,
        "us_per_decode_step": 1e6 * decode_time / max(1, decode_steps),
        "peak_pages": peak_used,
        "total_pages": usable,
        "hit_rate": hit_tokens / queried if queried else 0.0,
        "us_per_request_build": 1e6 * build_time / max(1, admissions),
    }


def run(config_path: str, trace, memory="40GiB", max_running: int = 256, freeze_gc: bool = True) -> dict:
    """Build vLLM's manager for the model and replay `trace` through it."""
    kv, hasher, info = build_manager(config_path, memory)
    if freeze_gc:
        # EngineCore.__init__ ends with freeze_gc_heap(): the startup heap (the
        # pool's KVCacheBlock objects among it) is left out of GC passes.
        gc.collect()
        gc.freeze()
    try:
        row = replay(kv, hasher, trace, max_running=max_running)
    finally:
        if freeze_gc:
            gc.unfreeze()
    row["groups"] = info.pop("groups")
    row["peak_bytes"] = row["peak_pages"] * info["block_bytes"]
    row["notes"] = info
    del kv
    gc.collect()
    return row


def describe(row: dict) -> str:
    """One line on how vLLM laid the model out."""
    n = row["notes"]
    kinds: dict[str, list[str]] = {}
    for kind in n["group_kinds"]:  # "MambaSpec(block_size=80, layers=4)"
        name, rest = kind.split("(", 1)
        block, layers = (part.split("=")[1] for part in rest.rstrip(")").split(", "))
        kinds.setdefault(f"{name} block {block}", []).append(layers)
    groups = " + ".join(f"{len(v)}x {k} ({'/'.join(v)} layers)" for k, v in kinds.items())
    text = (f"{row['groups']} groups = {groups}, {n['padding_layers']} padding layers; "
            f"{n['num_blocks']:,} blocks of {n['block_bytes'] / 2**20:.2f} MiB (peak "
            f"{row['peak_bytes'] / 2**30:.1f} GiB); hash block {n['hash_block_size']} tokens")
    if n["mamba_cache_mode"]:
        text += (f"; Mamba cache mode {n['mamba_cache_mode']!r}, state dtypes {'/'.join(n['mamba_state_dtypes'])}, "
                 f"attention block raised to {n['attention_block_size']} and the Mamba page padded to match")
    return text


def arguments(parser) -> None:
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--memory", default="40GiB")
    parser.add_argument("--no-gc-freeze", action="store_true", help="leave the start-up heap to the GC")


def main_run(args) -> dict:
    """vLLM's manager alone on the trace (manager_overhead.py --against vllm
    runs it beside hybridkv's)."""
    import_vllm()
    trace = make_trace(20 if args.quick else args.requests)
    rows = []
    for label, file in CONFIGS.items():
        row = run(os.path.join(MODELS_DIR, file), trace, args.memory, freeze_gc=not args.no_gc_freeze)
        print(label, {k: v for k, v in row.items() if k != "notes"})
        print("   ", describe(row))
        rows.append({"model": label, **row})
    return {"models": rows}


if __name__ == "__main__":
    harness.main(main_run, arguments)
