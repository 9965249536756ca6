"""Replay manager_overhead.py's request trace through vLLM's own KVCacheManager;
and how many requests vLLM's pool holds for a model (`max_requests`, which
benchmarks/kv_dtypes.py sets beside hybridkv's for narrow pages).

vLLM is an optional dependency: nothing here imports it at module level, and
`import_vllm()` raises a clear error when it is missing. Only vLLM's public
(and a few engine-internal) functions are called; no vLLM code is copied.

The manager is built the way vLLM's engine core builds it for the model:

* per-layer KV cache specs as the model's layers would report them
  (`FullAttentionSpec` / `SlidingWindowSpec` / `ChunkedLocalAttentionSpec` /
  `MambaSpec`, KV in the model's dtype or `kv_cache_dtype`'s; the
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
the block hasher, `get_computed_blocks`, `allocate_slots` for the first chunk
with the hit and for each later chunk, `num_computed_tokens` advanced as the
scheduler does), one decode token per running request per step (append the token,
`allocate_slots(req, 1)`, advance), frees of finished requests, and recompute
preemption of the newest running request when a decode step finds no block.
Timed like the hybridkv replay: an admission includes building the vLLM
Request, which is where vLLM hashes the prompt's blocks (hybridkv hashes inside
its admission too; `us_per_request_build` reports that part), and a decode
request-step includes appending the token (which hashes a block it completes).
Per step the manager calls the Scheduler makes (`new_step_starts`, draining
boundary-state offloads, block copies and new block ids) count as decode time.
Prefill chunks end where the Scheduler's own `_mamba_block_aligned_split`
ends them in "align" mode (where a Mamba state must be cached, unless the
layer can save it inside the chunk, as vLLM's Mamba-2 layers report), as
the hybridkv loop ends them at its checkpoints (`next_chunk`).
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import logging
import os
import re
import sys
import time
import types

from benchmarks import harness
from benchmarks.replay_trace import CONFIGS, MODELS_DIR, TRACES, Waiting
from hybridkv.core.hf_config import load_config, specs_from_config, text_config
from hybridkv.core.layout import parse_memory
from hybridkv.core.specs import ChunkedLocalSpec as HKChunked
from hybridkv.core.specs import FullAttentionSpec as HKFull
from hybridkv.core.specs import RecurrentSpec as HKRecurrent
from hybridkv.core.specs import SlidingWindowSpec as HKSliding

BLOCK_SIZE = 16
# hybridkv's recurrent kinds -> vLLM's Mamba backend for that mixer (MambaAttentionBackendEnum)
RECURRENT_BACKENDS = {"mamba": "MAMBA1", "mamba2": "MAMBA2", "gated_delta": "GDN_ATTN", "short_conv": "SHORT_CONV"}


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
    # what the Scheduler's constructor reads: a text-only decoder
    uses_mrope = False
    is_encoder_decoder = False
    supports_multimodal_inputs = False
    is_diffusion = False
    return_sampling_mask = False
    multimodal_config = None

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


@contextlib.contextmanager
def _quiet_vllm():
    """vLLM's set-up chatter (padding layers, block sizes) silenced; nothing
    logs in the hot path."""
    vllm_logger = logging.getLogger("vllm")
    level = vllm_logger.level
    vllm_logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        vllm_logger.setLevel(level)


def kv_cache_setup(config_path: str, memory, block_size: int = BLOCK_SIZE,
                   cache_dtype: str = "auto") -> types.SimpleNamespace:
    """vLLM's KV cache configuration for the model in `config_path` with
    `memory` bytes of KV cache and pages of `cache_dtype` (vLLM's
    kv_cache_dtype: "auto" is the model's dtype, "fp8" one byte an element
    scaled per tensor): the per-layer specs, the hybrid block-size rule, and
    the scheduler's groups and pool as get_kv_cache_configs and
    generate_scheduler_kv_cache_config make them (the module docstring)."""
    import_vllm()
    from vllm.config import CacheConfig, VllmConfig
    from vllm.model_executor.layers.attention.attention import _largest_kernel_block_within
    from vllm.model_executor.models.config import HybridAttentionMambaModelConfig
    from vllm.platforms.interface import Platform
    from vllm.utils.torch_utils import kv_cache_dtype_str_to_dtype
    from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend
    from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum
    from vllm.v1.attention.backends.utils import get_supported_kv_cache_layouts, resolve_kv_cache_layout
    from vllm.v1.core.kv_cache_utils import generate_scheduler_kv_cache_config, get_kv_cache_configs
    from vllm.v1.core.single_type_kv_cache_manager import register_all_kvcache_specs
    from vllm.v1.kv_cache_interface import (ChunkedLocalAttentionSpec, FullAttentionSpec, MambaSpec,
                                            SlidingWindowSpec, get_kv_quant_mode)

    config = load_config(config_path)
    hk_specs = specs_from_config(config)  # only for which layer is which kind (same config.json parsing)
    attn = next(((s.num_kv_heads, s.head_size) for s in hk_specs.values()
                 if isinstance(s, (HKFull, HKSliding, HKChunked))), None)
    kinds = {s.kind for s in hk_specs.values() if isinstance(s, HKRecurrent)}
    if len(kinds) > 1:
        raise ValueError(f"{config_path}: more than one recurrent kind ({sorted(kinds)})")
    has_mamba = bool(kinds)
    mamba_type = MambaAttentionBackendEnum[RECURRENT_BACKENDS[kinds.pop()]] if has_mamba else None
    model_config = _ModelConfigStub(config, attn)

    cache_config = CacheConfig(block_size=block_size, enable_prefix_caching=True, cache_dtype=cache_dtype)
    vllm_config = VllmConfig(cache_config=cache_config)
    vllm_config.model_config = model_config  # after __post_init__: the stub only feeds the KV cache set-up
    backend = FlashAttentionBackend  # what a GPU engine runs these attention layers with
    model_cls = _model_class(model_config) if has_mamba else None
    if has_mamba:
        HybridAttentionMambaModelConfig.verify_and_update_config(vllm_config)  # mamba_cache_mode, mamba_block_size
        Platform._align_hybrid_block_size(vllm_config, backend)  # attention block >= Mamba page, Mamba padding
    register_all_kvcache_specs(vllm_config)

    kv_dtype = kv_cache_dtype_str_to_dtype(cache_config.cache_dtype, model_config)  # Attention.__init__
    quant = get_kv_quant_mode(cache_config.cache_dtype)
    kv_cache_spec, layer_specs = {}, {}
    for name, spec in hk_specs.items():
        i = int(re.search(r"layers\.(\d+)", name)[1])  # Falcon-H1: "model.layers.3" and "model.layers.3.mamba"
        layer = f"model.layers.{i}.mixer" if isinstance(spec, HKRecurrent) else f"model.layers.{i}.self_attn.attn"
        layer_specs[layer] = spec
        if isinstance(spec, HKRecurrent):
            # MambaBase.get_kv_cache_spec
            kv_cache_spec[layer] = MambaSpec(
                shapes=tuple(model_cls.get_mamba_state_shape_from_config(vllm_config)),
                dtypes=model_cls.get_mamba_state_dtype_from_config(vllm_config),
                block_size=cache_config.mamba_block_size,
                page_size_padded=cache_config.mamba_page_size_padded,
                mamba_type=mamba_type,
                mamba_cache_mode=cache_config.mamba_cache_mode,
                num_speculative_blocks=0,
                # MambaMixer2.get_kv_cache_spec: a Mamba-2 layer saves the
                # block-boundary state from inside a prefill chunk, so the
                # Scheduler does not split the prefill there
                **({"num_prefill_checkpoint_blocks": 1, "prefill_checkpoint_alignment": 1}
                   if mamba_type.name == "MAMBA2" else {}))
        elif isinstance(spec, HKSliding):
            # Attention.get_kv_cache_spec, sliding-window branch
            probe = backend.customize_spec(SlidingWindowSpec(
                block_size=1, num_kv_heads=spec.num_kv_heads, head_size=spec.head_size,
                dtype=kv_dtype, kv_quant_mode=quant, sliding_window=spec.sliding_window))
            per_token = probe.real_page_size_bytes
            sw_block = _largest_kernel_block_within(backend, per_token, per_token * cache_config.block_size,
                                                    cache_config.block_size, probe)
            kv_cache_spec[layer] = SlidingWindowSpec(
                block_size=sw_block, num_kv_heads=spec.num_kv_heads, head_size=spec.head_size,
                dtype=kv_dtype, kv_quant_mode=quant, sliding_window=spec.sliding_window)
        elif isinstance(spec, HKChunked):
            # ChunkedLocalAttention.get_kv_cache_spec
            kv_cache_spec[layer] = ChunkedLocalAttentionSpec(
                block_size=cache_config.block_size, num_kv_heads=spec.num_kv_heads, head_size=spec.head_size,
                dtype=kv_dtype, kv_quant_mode=quant, attention_chunk_size=spec.chunk_size)
        elif isinstance(spec, HKFull):
            kv_cache_spec[layer] = FullAttentionSpec(
                block_size=cache_config.block_size, num_kv_heads=spec.num_kv_heads,
                head_size=spec.head_size, dtype=kv_dtype, kv_quant_mode=quant)
        else:
            raise ValueError(f"{name}: {type(spec).__name__} layers are not wired into the vLLM replay")

    # EngineCore._initialize_kv_caches
    backends = [backend]
    if has_mamba:
        backends.append(mamba_type.get_class())
    layouts = get_supported_kv_cache_layouts(backends)
    layout = resolve_kv_cache_layout(vllm_config, [[m.name for m in layouts]], list(kv_cache_spec.values()))
    kv_cache_configs = get_kv_cache_configs(vllm_config, [kv_cache_spec], [parse_memory(memory)])
    for c in kv_cache_configs:
        c.kv_cache_layout = cache_config.kv_cache_layout
    return types.SimpleNamespace(
        vllm_config=vllm_config, cache_config=cache_config, model_config=model_config, has_mamba=has_mamba,
        kv_cache_spec=kv_cache_spec, layer_specs=layer_specs, attention_block_size=cache_config.block_size,
        kv_cache_config=generate_scheduler_kv_cache_config(kv_cache_configs), layout=layout)


def _model_class(model_config):
    """vLLM's class for the model's architecture (its Mamba state shapes);
    where its module does not import here, a ValueError that says why (the
    registry's own error only points at its log)."""
    from vllm.model_executor.models import ModelRegistry

    try:
        return ModelRegistry.resolve_model_cls(model_config.architecture, model_config=model_config)[0]
    except ValueError:
        entry = ModelRegistry.models.get(model_config.architecture)
        try:
            if entry is not None:
                importlib.import_module(entry.module_name)
        except ImportError as e:
            raise ValueError(f"vLLM's {model_config.architecture} does not import here ({entry.module_name}: "
                             f"{e})") from None
        raise


def blocks_held(spec, tokens: int) -> int:
    """Blocks of a group with vLLM's `spec` that one request holds at
    `tokens` tokens, decoding one token a step, counted as
    layout.max_requests counts hybridkv's: full attention every block; a
    sliding window or attention chunk vLLM's own admission bound for one
    token in flight (the most it holds at any position), at most every
    block; a Mamba group its running state (in "align" mode a second block
    for the one step that crosses a block boundary) and its speculative
    blocks."""
    from vllm.utils.math_utils import cdiv
    from vllm.v1.kv_cache_interface import ChunkedLocalAttentionSpec, MambaSpec, SlidingWindowSpec

    if isinstance(spec, MambaSpec):
        return 1 + spec.num_speculative_blocks
    every = cdiv(tokens, spec.block_size)
    if isinstance(spec, (SlidingWindowSpec, ChunkedLocalAttentionSpec)):
        return min(every, spec.max_admission_blocks_per_request(max_in_flight_tokens=1, max_model_len=tokens))
    return every


def max_requests(config_path: str, memory, contexts, cache_dtype: str = "auto") -> dict:
    """How many requests of each length in `contexts` vLLM's pool holds at
    once for the model, with pages of `cache_dtype`: the scheduler's pool
    (its null block left out) over the blocks one request holds in every
    group (`blocks_held`); beside it the exact bytes of one such request in
    vLLM's per-layer specs (the keys the next query reads, at the layer's
    real bytes per token; a Mamba layer's state unpadded), nothing rounded."""
    from vllm.v1.kv_cache_interface import MambaSpec

    with _quiet_vllm():
        setup = kv_cache_setup(config_path, memory, cache_dtype=cache_dtype)
    config = setup.kv_cache_config
    usable = config.num_blocks - 1  # the null block is never handed out
    groups = [g.kv_cache_spec for g in config.kv_cache_groups]

    def exact(tokens: int) -> int:
        return sum(spec.real_page_size_bytes if isinstance(spec, MambaSpec) else
                   (tokens - setup.layer_specs[name].first_visible(tokens)) * spec.real_page_size_bytes
                   // spec.block_size for name, spec in setup.kv_cache_spec.items())

    return {"num_blocks": config.num_blocks, "attention_block_size": setup.attention_block_size,
            "page_bytes": sorted({s.page_size_bytes for s in groups}),
            "max_model_len": setup.model_config.max_model_len,
            "contexts": {c: {"requests": usable // sum(blocks_held(s, c) for s in groups), "exact_bytes": exact(c)}
                         for c in contexts}}


def build_manager(config_path: str, memory, block_size: int = BLOCK_SIZE):
    """vLLM's KVCacheManager for the model in `config_path` with `memory` bytes
    of KV cache, plus the request block hasher and a description."""
    import_vllm()
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import (get_request_block_hasher, init_none_hash,
                                             resolve_cache_hit_alignment_tokens, resolve_kv_cache_block_sizes)
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import MambaSpec

    with _quiet_vllm():
        setup = kv_cache_setup(config_path, memory, block_size)
        vllm_config, cache_config, kv_cache_config = setup.vllm_config, setup.cache_config, setup.kv_cache_config
        groups = kv_cache_config.kv_cache_groups
        participating = [g.kv_cache_spec.block_size for g in groups if g.kv_cache_spec.prefix_cacheable]
        cache_config.block_size = min(participating or [g.kv_cache_spec.block_size for g in groups])
        scheduler_block_size, hash_block_size = resolve_kv_cache_block_sizes(kv_cache_config, vllm_config)
        alignment = resolve_cache_hit_alignment_tokens(kv_cache_config, vllm_config, scheduler_block_size,
                                                       hash_block_size)
        kv_cache_config.hash_block_size = hash_block_size
        kv_cache_config.cache_hit_alignment_tokens = alignment

        # EngineCore: the Scheduler builds the manager (its split of prefill
        # chunks at Mamba cache positions is what the replay asks it for)
        cache_config.num_gpu_blocks = kv_cache_config.num_blocks  # EngineCore sets it before the Scheduler
        scheduler = Scheduler(vllm_config, kv_cache_config, structured_output_manager=None,
                              block_size=scheduler_block_size, hash_block_size=hash_block_size)
        kv = scheduler.kv_cache_manager
        split = scheduler._mamba_block_aligned_split if scheduler.need_mamba_block_aligned_split else None
        # EngineCore.__init__: the request block hasher
        hash_fn = get_hash_fn_by_name(cache_config.prefix_caching_hash_algo)
        init_none_hash(hash_fn)
        hasher = get_request_block_hasher(hash_block_size, hash_fn)

    kv_cache_spec, has_mamba = setup.kv_cache_spec, setup.has_mamba
    sizes = [len(g.layer_names) for g in groups]
    info = {
        "groups": len(groups),
        "group_kinds": [f"{type(g.kv_cache_spec).__name__}(block_size={g.kv_cache_spec.block_size}, "
                        f"layers={len(g.layer_names)})" for g in groups],
        "padding_layers": len(groups) * max(sizes) - sum(sizes),
        "num_blocks": kv_cache_config.num_blocks,
        "block_bytes": kv_cache_config.kv_cache_tensors[0].size // kv_cache_config.num_blocks,
        "layer_page_bytes": sorted({spec.page_size_bytes for spec in kv_cache_spec.values()}),
        "attention_block_size": setup.attention_block_size,
        "scheduler_block_size": scheduler_block_size,
        "hash_block_size": hash_block_size,
        "hash_algo": cache_config.prefix_caching_hash_algo,
        "mamba_cache_mode": cache_config.mamba_cache_mode if has_mamba else None,
        "mamba_state_dtypes": ([str(d).replace("torch.", "") for d in
                                next(s for s in kv_cache_spec.values() if isinstance(s, MambaSpec)).dtypes]
                               if has_mamba else None),
        "max_model_len": setup.model_config.max_model_len,
        "kv_cache_layout": setup.layout.name,
    }
    return kv, hasher, split, info


def replay(kv, hasher, trace, max_running: int = 256, split=None) -> dict:
    """manager_overhead.replay's loop, against vLLM's KVCacheManager.
    `split`: the Scheduler's clip of a prefill chunk to the next position
    where a Mamba state must be cached ("align" mode), or None."""
    return harness.run_through(replay_steps(kv, hasher, trace, max_running, split))


def replay_steps(kv, hasher, trace, max_running: int = 256, split=None):
    """`replay`, yielding after every admission and decode step, as
    manager_overhead.replay_steps does."""
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request, RequestStatus

    params = SamplingParams(max_tokens=1 << 30)  # lengths are the trace's; one shared object, built once
    RUNNING = RequestStatus.RUNNING
    waiting = Waiting(trace)
    pending: dict[str, list] = {}  # [Request, hit] built, not yet admitted (a failed admission keeps its progress)
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
            rid, tokens, outputs, samples = waiting.head()
            t0 = perf()
            entry = pending.get(rid)
            if entry is None:  # EngineCore.add_request: the Request hashes its full blocks
                entry = pending[rid] = [Request(rid, tokens, params, None, block_hasher=hasher), 0]
                build_time += perf() - t0
            req = entry[0]
            if not _prefill(kv, entry, split, has_scheduled_reqs=bool(running)):
                failed_time += perf() - t0
                failed += 1
                if not running:
                    raise RuntimeError("a single request does not fit the pool")
                break
            req.status = RUNNING
            admit_time += perf() - t0
            admissions += 1
            queried += req.num_tokens
            hit_tokens += entry[1]
            waiting.admitted()
            del pending[rid]
            running[rid] = [outputs, samples, tokens, req]
            yield
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
            waiting.requeue((rid, tokens, outputs, samples))  # a fresh Request with the tokens so far
            preemptions += 1
        # What Scheduler.schedule() drains from the manager every step.
        kv.take_boundary_state_offloads()
        _, retained = kv.take_kv_cache_block_copies()
        if retained:
            pool.free_blocks(retained)
        kv.take_new_block_ids()
        decode_time += perf() - t0
        for rid in finished:  # the next turns of these chats arrive (untimed: the trace, not the manager)
            waiting.finished(rid)
        yield
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
        "prompt_tokens": queried,
        "hit_tokens": hit_tokens,
        "us_per_request_build": 1e6 * build_time / max(1, admissions),
    }


def _prefill(kv, entry: list, split, has_scheduled_reqs: bool) -> bool:
    """The manager calls of the Scheduler's prefill of `entry` ([Request,
    hit], the hit set here): the lookup and
    the first chunk with the hit (room for the whole prompt checked, as
    `scheduler_reserve_full_isl` does by default), then chunk after chunk,
    each clipped by `split` where "align" mode must cache a Mamba state.
    False if the pool is full (the Request keeps its progress)."""
    req = entry[0]
    if req.num_computed_tokens == 0:
        blocks, hit, req.shared_prefix_boundary = kv.get_computed_blocks(req)
        size = req.num_tokens - hit
        if split is not None:
            size = split(req, size, hit)
        if kv.allocate_slots(req, size, num_new_computed_tokens=hit, new_computed_blocks=blocks,
                             full_sequence_must_fit=True, has_scheduled_reqs=has_scheduled_reqs) is None:
            return False
        entry[1] = hit  # Scheduler.schedule(): the hit is computed ...
        req.num_computed_tokens = hit + size  # ... and _update_after_schedule adds the chunk
    while req.num_computed_tokens < req.num_tokens:  # later chunks, as the running loop schedules them
        size = req.num_tokens - req.num_computed_tokens
        if split is not None:
            size = split(req, size)
        if kv.allocate_slots(req, size, has_scheduled_reqs=True) is None:
            return False
        req.num_computed_tokens += size
    return True


def run(config_path: str, trace, memory="40GiB", max_running: int = 256, freeze_gc: bool = True) -> dict:
    """Build vLLM's manager for the model and replay `trace` through it."""
    return harness.run_through(run_steps(config_path, trace, memory, max_running, freeze_gc))


def run_steps(config_path: str, trace, memory="40GiB", max_running: int = 256, freeze_gc: bool = True):
    """`run`, yielding after every admission and decode step (harness.lockstep)."""
    kv, hasher, split, info = build_manager(config_path, memory)
    if freeze_gc:
        # EngineCore.__init__ ends with freeze_gc_heap(): the startup heap (the
        # pool's KVCacheBlock objects among it) is left out of GC passes.
        gc.collect()
        gc.freeze()
    try:
        row = yield from replay_steps(kv, hasher, trace, max_running=max_running, split=split)
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
    """vLLM's manager alone on the traces (manager_overhead.py --against
    vllm runs it beside hybridkv's)."""
    import_vllm()
    rows = []
    for name, make in TRACES.items():
        trace = make(20 if args.quick else args.requests)
        for label, file in CONFIGS.items():
            row = run(os.path.join(MODELS_DIR, file), trace, args.memory, freeze_gc=not args.no_gc_freeze)
            print(label, name, {k: v for k, v in row.items() if k != "notes"})
            print("   ", describe(row))
            rows.append({"model": label, "trace": name, **row})
    return {"models": rows}


if __name__ == "__main__":
    harness.main(main_run, arguments)
