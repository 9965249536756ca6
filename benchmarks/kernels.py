"""Kernel timings: each Triton kernel's time, the bytes it must move and the
bandwidth it reaches, beside the torch reference and (for decode attention)
torch's scaled_dot_product_attention over the same K/V laid out
contiguously.

Shapes: Gemma-3-27B attention (32 query heads, 16 KV heads, head_dim 128,
bfloat16, sliding window 1024; the pool's pages hold two layers, as the
layout planner makes them), decode at batch 64 x 8K and x 32K; a prefill
chunk of 2048 tokens after 6144 cached; the store of an 8192-token step; a
Jamba-1.5-Mini Mamba layer's decode step (8192 channels, state 16, conv 4)
at batch 64.

Where they import, the field's kernels run on the same pool in the same
run: FlashInfer's paged decode and prefill attention (the "flashinfer"
backend, layers/backends/flashinfer/attention.py; its per-step plan timed apart,
host work done once per step and column) and mamba-ssm's
selective_state_update (layers/backends/flashinfer/mamba_ssm.py: on gathered states, as
that backend runs it; the gather and write-back timed with it).

Bandwidth is bytes that must move (K/V rows a query may see, states read
and written, inputs and outputs) over the median time, against the
device's nominal peak and against a measured device-to-device copy.

    python -m benchmarks.kernels            # CUDA: writes benchmarks/results/kernels.json
    python -m benchmarks.kernels --quick    # tiny shapes; without CUDA under triton's interpreter
                                            # (checks the script and the numbers, times mean nothing)
"""

from __future__ import annotations

import os
import sys
import time

import torch

QUICK = "--quick" in sys.argv
if not torch.cuda.is_available() and QUICK:
    os.environ["TRITON_INTERPRET"] = "1"  # before the kernels are imported

import numpy as np  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from benchmarks import harness  # noqa: E402
from hybridkv.core import FullAttentionSpec, SlidingWindowSpec  # noqa: E402
from hybridkv.layers.backends.reference import attention as paged_attention  # noqa: E402
from hybridkv.layers.backends.triton import attention as kernel_attention  # noqa: E402
from hybridkv.layers.backends.triton import kernels as triton_kernels  # noqa: E402
from hybridkv.layers.mamba_ops import causal_conv_step, selective_scan_step  # noqa: E402
from hybridkv.layers.step import StepInputs, attention_step  # noqa: E402

try:
    import flashinfer  # noqa: E402
    FIELD_ERROR = None
except ModuleNotFoundError:
    flashinfer, FIELD_ERROR = None, "flashinfer: not installed"
except Exception as error:  # noqa: BLE001 - present and broken: say why, go on without it
    flashinfer, FIELD_ERROR = None, f"flashinfer: {type(error).__name__}: {error}"[:300]

# Nominal HBM bandwidth, GB/s (vendor figures).
PEAKS = {"H100 PCIe": 2000, "H100 NVL": 3900, "H100": 3350, "H200": 4800, "A100-SXM4-80GB": 2039,
         "A100-SXM4-40GB": 1555, "A100-PCIE": 1935}


def nominal_peak(name: str) -> float | None:
    for key, gbps in PEAKS.items():
        if key in name:
            return gbps
    return None


class Timer:
    def __init__(self, device):
        self.device = device

    def __call__(self, fn) -> float:
        """Median seconds per call."""
        if self.device.type == "cuda":
            import triton.testing

            return triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median") * 1e-3
        fn()  # the interpreter: one call, after a first one that traces
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start


def copy_bandwidth(device, nbytes) -> float | None:
    """GB/s of a device-to-device copy (read + write), a practical ceiling."""
    if device.type != "cuda":
        return None
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    seconds = Timer(device)(lambda: dst.copy_(src))
    del src, dst
    return 2 * nbytes / seconds / 1e9


# -- attention -----------------------------------------------------------------
class PagedLayer:
    """One attention layer's cache in a pool whose pages hold
    `layers_per_page` layers' blocks; requests' blocks on shuffled pages in
    a persistent table; both backends' metadata for one step of (cached
    tokens, new tokens)."""

    def __init__(self, device, step, kind, window, q_heads, kv_heads, dim, bs=16, layers_per_page=2,
                 dtype=torch.bfloat16, seed=0):
        rng = np.random.default_rng(seed)
        self.step, self.bs = step, bs
        self.spec = (SlidingWindowSpec(kv_heads, dim, sliding_window=window) if kind == "sliding_window"
                     else FullAttentionSpec(kv_heads, dim))
        blocks = [-(-(c + n) // bs) for c, n in step]
        pages = 1 + sum(blocks)
        layer_elems = 2 * bs * kv_heads * dim
        pool = torch.empty(pages, layers_per_page * layer_elems, dtype=dtype, device=device)
        self.cache = pool[:, :layer_elems].view(pages, 2, bs, kv_heads, dim)
        self.cache.normal_()
        order = rng.permutation(np.arange(1, pages))
        table = np.zeros((1, len(step), max(blocks)), dtype=np.int64)
        taken = 0
        for i, nb in enumerate(blocks):
            table[0, i, :nb] = order[taken:taken + nb]
            taken += nb
        self.table = torch.from_numpy(table).to(device)
        tokens = sum(n for _, n in step)
        self.q = torch.randn(tokens, q_heads, dim, dtype=dtype, device=device)
        counts = np.array([n for _, n in step])
        self.inputs = StepInputs.from_host(np.zeros(tokens, dtype=np.int64), np.array([c for c, _ in step]), counts,
                                           np.arange(len(step)), device)
        step = attention_step(self.inputs, self.table, self.spec, bs)
        self.attention_step = step
        self.meta = {"torch": paged_attention.build(step), "triton": kernel_attention.build(step)}
        self.flashinfer = None
        if flashinfer is not None and device.type == "cuda":
            from hybridkv.layers.backends.flashinfer import attention as flashinfer_attention

            self.flashinfer = flashinfer_attention.FlashInferAttention(flashinfer, device)
            self.meta["flashinfer"] = flashinfer_attention.build(step)

    def visible_keys(self) -> int:
        """Keys read by the step: per request, from the first key its first
        query sees to its last query."""
        return sum(cached + count - self.spec.first_visible(cached) for cached, count in self.step)

    def kv_bytes(self) -> int:
        _, _, _, heads, dim = self.cache.shape
        return self.visible_keys() * 2 * heads * dim * self.cache.element_size()

    def attend(self, name, scale):
        if name == "torch":
            return paged_attention.attend(self.q, self.cache, self.meta["torch"], 0, scale, None)
        if name == "flashinfer":  # planned on the first call, the plan kept in the metadata
            return self.flashinfer.attend(self.q, self.cache, self.meta["flashinfer"], 0, scale, None)
        return kernel_attention.TritonAttention(triton_kernels()).attend(self.q, self.cache, self.meta["triton"], 0,
                                                                         scale, None)

    def flashinfer_plan_seconds(self, scale) -> float:
        """Host time of a step's FlashInfer plan for one column (fresh
        metadata each time, as each engine step makes), median of 20."""
        from hybridkv.layers.backends.flashinfer import attention as flashinfer_attention

        times = []
        for _ in range(20):
            torch.cuda.synchronize()
            start = time.perf_counter()
            meta = flashinfer_attention.build(self.attention_step)
            kind = "decode" if meta.decode_tokens is not None else "prefill"
            self.flashinfer._planned(meta, 0, kind, self.q, self.cache, scale, None)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
        return sorted(times)[len(times) // 2]

    def field_rows(self, row, ref, scale, timer):
        """FlashInfer beside our kernel in `row` (when it imports): time,
        error against the reference, plan time, bandwidth."""
        if self.flashinfer is None:
            return
        try:
            err = (self.attend("flashinfer", scale).float() - ref.float()).abs().max().item()
            seconds = timer(lambda: self.attend("flashinfer", scale))
            row["flashinfer"] = dict(seconds=seconds, max_abs_err=err,
                                     plan_seconds=self.flashinfer_plan_seconds(scale),
                                     gbps=row["bytes"] / seconds / 1e9)
        except Exception as error:  # noqa: BLE001 - report it beside our kernel's numbers, go on
            row["flashinfer"] = dict(error=f"{type(error).__name__}: {error}"[:300])

    def contiguous(self, context):
        """K and V of each request as [batch, kv_heads, context, dim] (the
        SDPA baseline's layout), copied once, outside the timing."""
        rows = self.table[0, :, :context // self.bs]
        k = self.cache[rows, 0].flatten(1, 2).transpose(1, 2).contiguous()
        v = self.cache[rows, 1].flatten(1, 2).transpose(1, 2).contiguous()
        return k, v


def decode_rows(args, device, timer, peak):
    rows = []
    q_heads, kv_heads, dim, window = (4, 2, 16, 48) if args.quick else (32, 16, 128, 1024)
    scale = dim ** -0.5
    contexts = [64, 160] if args.quick else [8192, 32768]
    batch = 2 if args.quick else 64
    for context in contexts:
        for kind in ("full", "sliding_window"):
            # Every request at the same length, so that SDPA needs no mask.
            layer = PagedLayer(device, [(context - 1, 1)] * batch, kind, window, q_heads, kv_heads, dim,
                               layers_per_page=1 if context > 8192 else 2)
            ref = layer.attend("torch", scale)
            out = layer.attend("triton", scale)
            err = (out.float() - ref.float()).abs().max().item()
            moved = layer.kv_bytes() + 2 * layer.q.numel() * layer.q.element_size()
            t_kernel = timer(lambda: layer.attend("triton", scale))
            t_torch = timer(lambda: layer.attend("torch", scale))
            k, v = layer.contiguous(context)
            if kind == "sliding_window":
                k, v = k[:, :, -window:].contiguous(), v[:, :, -window:].contiguous()
            q = layer.q.unsqueeze(2)  # [batch, q_heads, 1, dim]

            def sdpa():
                return F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=True)

            t_sdpa = timer(sdpa)
            err_sdpa = (sdpa().squeeze(2).float() - ref.float()).abs().max().item()
            del k, v
            sweep = {}
            step = layer.meta["triton"].step
            rows_t, table_rows = step.inputs.decodes.tokens, step.inputs.decodes.table_rows
            q_pos, first = step.inputs.positions[rows_t], step.first_key[rows_t]
            ops = triton_kernels()
            out2 = torch.empty_like(layer.q)
            configs = ([(16, 1, 4), (32, 2, 4)] if args.quick else
                       [(n, s, w) for n in (32, 64, 128) for s in (1, 2, 4) for w in (4, 8)])
            for block_n, splits, warps in configs:
                def run():
                    ops.paged_decode_attention(out2, layer.q, layer.cache, rows_t, step.table[0], table_rows, q_pos,
                                               first, scale=scale, block_n=block_n, splits=splits, num_warps=warps)
                run()
                assert (out2.float() - ref.float()).abs().max().item() <= max(4 * err, 5e-2), "sweep config is wrong"
                sweep[f"block_n={block_n} splits={splits} warps={warps}"] = timer(run) * 1e6
            rows.append(dict(kernel="paged decode attention", kind=kind, shape=f"{batch} x {context}",
                             seconds=t_kernel, bytes=moved, max_abs_err=err, torch_seconds=t_torch,
                             sdpa_seconds=t_sdpa, sdpa_max_abs_err=err_sdpa, sweep_us=sweep,
                             **bandwidth(moved, t_kernel, peak)))
            layer.field_rows(rows[-1], ref, scale, timer)
            del layer
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return rows


def prefill_rows(args, device, timer, peak):
    rows = []
    q_heads, kv_heads, dim, window = (4, 2, 16, 48) if args.quick else (32, 16, 128, 1024)
    cached, chunk = (96, 64) if args.quick else (6144, 2048)
    scale = dim ** -0.5
    for kind in ("full", "sliding_window"):
        layer = PagedLayer(device, [(cached, chunk)], kind, window, q_heads, kv_heads, dim)
        ref = layer.attend("torch", scale)
        err = (layer.attend("triton", scale).float() - ref.float()).abs().max().item()
        t_kernel = timer(lambda: layer.attend("triton", scale))
        t_torch = timer(lambda: layer.attend("torch", scale))
        # Score and value FLOPs of the visible (query, key) pairs.
        pairs = sum(min(pos + 1, window) if kind == "sliding_window" else pos + 1
                    for pos in range(cached, cached + chunk))
        flops = 4 * pairs * q_heads * dim
        moved = layer.kv_bytes() + 2 * layer.q.numel() * layer.q.element_size()
        rows.append(dict(kernel="paged prefill attention", kind=kind, shape=f"{chunk} after {cached}",
                         seconds=t_kernel, bytes=moved, max_abs_err=err, torch_seconds=t_torch,
                         tflops=flops / t_kernel / 1e12, sweep_us=prefill_sweep(args, layer, ref, err, scale, timer),
                         **bandwidth(moved, t_kernel, peak)))
        layer.field_rows(rows[-1], ref, scale, timer)
    return rows


def prefill_sweep(args, layer, ref, err, scale, timer) -> dict:
    """The prefill kernel's tiles (block_m x block_n), warps, pipeline
    stages, and dots on 16-bit operands (compiled kernels only: the
    interpreter's are wrong) against float32 tiles: µs per config, each
    checked against the reference first."""
    step = layer.meta["triton"].step
    chunks = step.inputs.chunks
    ops = triton_kernels()
    out = torch.empty_like(layer.q)
    configs = ([(16, 32, 4, None, False), (32, 32, 4, None, False)] if args.quick else
               # The float32-tile default of before, and the 16-bit configs that led the full sweep of
               # 12 on an H100 (2026-11-27; docs/kernels.md): a fresh machine's FlashInfer JIT leaves the
               # GPU run's prefill part about a minute for the sweep.
               [(32, 64, 8, None, False), (64, 64, 4, 2, True), (64, 32, 4, 3, True), (128, 32, 8, 3, True),
                (32, 64, 8, None, True)])
    sweep = {}
    for block_m, block_n, warps, stages, dot16 in configs:
        def run():
            ops.paged_prefill_attention(out, layer.q, layer.cache, chunks.starts, chunks.lengths, step.table[0],
                                        chunks.table_rows, step.inputs.positions, step.first_key,
                                        max_length=chunks.longest, scale=scale, block_m=block_m, block_n=block_n,
                                        num_warps=warps, num_stages=stages, dot_16bit=dot16)
        name = f"block_m={block_m} block_n={block_n} warps={warps} stages={stages or '-'} dot16={int(dot16)}"
        try:
            run()
        except Exception as error:  # noqa: BLE001 - a config that does not compile (shared memory): say so
            sweep[name] = f"{type(error).__name__}: {error}"[:200]
            continue
        config_err = (out.float() - ref.float()).abs().max().item()
        assert config_err <= max(4 * err, 5e-2), f"prefill sweep config {name} is wrong ({config_err})"
        sweep[name] = timer(run) * 1e6
    return sweep


def store_rows(args, device, timer, peak):
    rows = []
    kv_heads, dim = (2, 16) if args.quick else (16, 128)
    for tokens in ((16, 2) if args.quick else (8192, 64)):
        layer = PagedLayer(device, [(0, tokens)], "full", 0, kv_heads, kv_heads, dim)
        k = torch.randn(tokens, kv_heads, dim, dtype=torch.bfloat16, device=device)
        v = torch.randn_like(k)
        ref = layer.meta["torch"]
        slots = layer.meta["triton"].slots[0]
        ops = triton_kernels()
        ops.store_kv(layer.cache, k, v, slots)
        err = max((layer.cache[ref.store_pages[0], 0, ref.store_offsets] - k).abs().max().item(),
                  (layer.cache[ref.store_pages[0], 1, ref.store_offsets] - v).abs().max().item())
        t_kernel = timer(lambda: ops.store_kv(layer.cache, k, v, slots))

        def torch_store():
            paged_attention.store(layer.cache, k, v, ref, 0)

        t_torch = timer(torch_store)
        moved = 2 * (k.numel() + v.numel()) * k.element_size() + slots.numel() * 8  # read + write
        rows.append(dict(kernel="store K/V", kind="-", shape=f"{tokens} tokens", seconds=t_kernel, bytes=moved,
                         max_abs_err=err, torch_seconds=t_torch, **bandwidth(moved, t_kernel, peak)))
    return rows


def mamba_rows(args, device, timer, peak):
    """Jamba-1.5-Mini: d_inner 8192, d_state 16, d_conv 4, conv state
    bfloat16, SSM state float32; state blocks of whole pages, as planned."""
    batch, I, N, K = (4, 32, 8, 4) if args.quick else (64, 8192, 16, 4)
    page = 4096 if args.quick else 128 << 10
    conv_bytes, ssm_bytes = I * (K - 1) * 2, I * N * 4
    conv_at = 16
    ssm_at = conv_at + -(-conv_bytes // 16) * 16
    width = -(-(ssm_at + ssm_bytes) // page)
    pool = torch.zeros(1 + 2 * batch * width, page, dtype=torch.uint8, device=device)
    ids = 1 + torch.randperm(2 * batch * width, device=device).view(2 * batch, width)
    read, write = ids[:batch], ids[batch:]
    zero = torch.zeros(batch, dtype=torch.bool, device=device)
    flat = pool[read].view(batch, -1)
    flat[:, conv_at:conv_at + conv_bytes].view(torch.bfloat16).normal_()
    flat[:, ssm_at:ssm_at + ssm_bytes].view(torch.float32).normal_()
    pool[read] = flat.view(batch, width, page)
    x = torch.randn(batch, I, dtype=torch.bfloat16, device=device)
    gate = torch.randn(batch, I, device=device)
    weight = torch.randn(I, K, dtype=torch.bfloat16, device=device)
    bias = torch.randn(I, dtype=torch.bfloat16, device=device)
    dt = F.softplus(torch.randn(batch, I, device=device))
    A = -torch.exp(torch.randn(I, N, device=device))
    B, C, D = torch.randn(batch, N, device=device), torch.randn(batch, N, device=device), torch.randn(I, device=device)
    ops = triton_kernels()

    def conv():
        return ops.mamba_conv_step(pool, read, write, zero, conv_at, torch.bfloat16, x, weight, bias, silu=True)

    def ssm(xc):
        return ops.mamba_ssm_step(pool, read, write, zero, ssm_at, torch.float32, xc, dt, A, B, C, D, gate)

    def reference():
        """The torch path: gather, conv + scan steps, scatter."""
        states = pool[read].reshape(batch, -1)
        conv_state = states[:, conv_at:conv_at + conv_bytes].view(torch.bfloat16).view(batch, I, K - 1)
        ssm_state = states[:, ssm_at:ssm_at + ssm_bytes].view(torch.float32).view(batch, I, N)
        xc, new_conv = causal_conv_step(x, conv_state, weight, bias)
        xc = F.silu(xc)
        y, new_ssm = selective_scan_step(xc, dt, A, B, C, ssm_state)
        conv_state.copy_(new_conv)
        ssm_state.copy_(new_ssm)
        pool[write] = states.view(batch, width, page)
        return xc, (y + xc.float() * D) * F.silu(gate)

    before = pool.clone()
    ref_x, ref_y = reference()
    pool.copy_(before)
    xc = conv()
    y = ssm(xc)
    err_x = (xc.float() - ref_x.float()).abs().max().item()
    err_y = (y - ref_y).abs().max().item()
    t_conv = timer(conv)
    t_ssm = timer(lambda: ssm(xc))
    t_torch = timer(reference)
    conv_moved = 2 * batch * conv_bytes + 2 * x.numel() * 2 + weight.numel() * 2 + bias.numel() * 2
    ssm_moved = (2 * batch * ssm_bytes + A.numel() * 4 + (xc.numel() * 2) + (dt.numel() + gate.numel() + y.numel()) * 4
                 + (B.numel() + C.numel()) * 4 + D.numel() * 4)
    shape = f"{batch} x {I} ch"
    field = mamba_ssm_row(batch, read, write, pool, ssm_at, ssm_bytes, I, N, xc, dt, A, B, C, D, gate, ref_y,
                          ssm_moved, timer)
    return [dict(kernel="mamba conv step", kind="-", shape=shape, seconds=t_conv, bytes=conv_moved, max_abs_err=err_x,
                 torch_seconds=t_torch, **bandwidth(conv_moved, t_conv, peak)),
            dict(kernel="mamba ssm step", kind="-", shape=shape, seconds=t_ssm, bytes=ssm_moved, max_abs_err=err_y,
                 torch_seconds=t_torch, **bandwidth(ssm_moved, t_ssm, peak),
                 **({"mamba_ssm": field} if field is not None else {}))]


def mamba_ssm_row(batch, read, write, pool, ssm_at, ssm_bytes, I, N, xc, dt, A, B, C, D, gate, ref_y, moved, timer):
    """mamba-ssm's selective_state_update as the "flashinfer" backend runs
    it (layers/backends/flashinfer/mamba_ssm.py): the states gathered from their pages,
    updated in place, written back; and the kernel alone on gathered rows;
    its error against the reference's output `ref_y`. None where mamba-ssm
    does not import (or no CUDA). The pool is left as it was."""
    if pool.device.type != "cuda":
        return None
    from hybridkv.layers.backends.flashinfer.mamba_ssm import load_kernels

    try:
        kernels = load_kernels()
    except Exception as error:  # noqa: BLE001
        return dict(error=f"{type(error).__name__}: {error}"[:300])
    if kernels is None:
        return None
    update = kernels[0]
    rows = torch.arange(batch, dtype=torch.int32, device=pool.device)
    zero_bias = torch.zeros(I, device=pool.device)  # (mamba-ssm 2.3.2 needs one: backends/flashinfer/mamba_ssm.py)
    width = read.shape[1]

    def step():
        states = pool[read].reshape(batch, -1)
        ssm_state = states[:, ssm_at:ssm_at + ssm_bytes].view(torch.float32).view(batch, I, N)
        y = update(ssm_state, xc, dt, A, B, C, D=D, z=gate, dt_bias=zero_bias, dt_softplus=False,
                   state_batch_indices=rows)
        pool[write] = states.view(batch, width, -1)
        return y.float()

    gathered = (pool[read].reshape(batch, -1)[:, ssm_at:ssm_at + ssm_bytes].view(torch.float32)
                .view(batch, I, N).clone())
    before = pool.clone()
    try:
        err = (step() - ref_y).abs().max().item()
        seconds = timer(step)
        kernel_seconds = timer(lambda: update(gathered, xc, dt, A, B, C, D=D, z=gate, dt_bias=zero_bias,
                                              dt_softplus=False, state_batch_indices=rows))
    except Exception as error:  # noqa: BLE001 - report it beside our kernel's numbers, go on
        return dict(error=f"{type(error).__name__}: {error}"[:300])
    finally:
        pool.copy_(before)
    return dict(seconds=seconds, kernel_seconds=kernel_seconds, max_abs_err=err, gbps=moved / seconds / 1e9)


def bandwidth(moved, seconds, peak):
    gbps = moved / seconds / 1e9
    return dict(gbps=gbps, peak_fraction=gbps / peak if peak else None)


def run(args) -> dict | None:
    """(--quick: tiny shapes; on the CPU under triton's interpreter.)"""
    cuda = torch.cuda.is_available()
    if not cuda and not args.quick:
        print("benchmarks/kernels.py needs CUDA (the kernels' timings mean nothing on the CPU interpreter); "
              "run with --quick for a smoke run of the script under the interpreter.")
        return None
    device = torch.device("cuda" if cuda else "cpu")
    name = torch.cuda.get_device_name(device) if cuda else "CPU (triton interpreter)"
    peak = nominal_peak(name) if cuda else None
    timer = Timer(device)
    torch.manual_seed(0)
    copy = copy_bandwidth(device, 4 << 30) if not args.quick else None
    parts = {"decode": decode_rows, "prefill": prefill_rows, "store": store_rows, "mamba": mamba_rows}
    chosen = args.only.split(",") if args.only else list(parts)
    unknown = sorted(set(chosen) - set(parts))
    if unknown:
        raise SystemExit(f"kernels: unknown --only {unknown}; choose from {sorted(parts)}")
    rows = [row for part in chosen for row in parts[part](args, device, timer, peak)]

    print(f"device: {name}; nominal peak {peak or '?'} GB/s; measured copy "
          f"{f'{copy:.0f}' if copy else '-'} GB/s; torch {torch.__version__}")
    print(f"{'kernel':<24} {'kind':<15} {'shape':<16} {'time us':>10} {'MB moved':>9} {'GB/s':>8} {'% peak':>7} "
          f"{'torch ref us':>12} {'SDPA us':>9} {'max err':>9}")
    for r in rows:
        frac = f"{100 * r['peak_fraction']:.0f}%" if r["peak_fraction"] else "-"
        sdpa = f"{r['sdpa_seconds'] * 1e6:.1f}" if "sdpa_seconds" in r else "-"
        print(f"{r['kernel']:<24} {r['kind']:<15} {r['shape']:<16} {r['seconds'] * 1e6:>10.1f} "
              f"{r['bytes'] / 1e6:>9.1f} {r['gbps']:>8.1f} {frac:>7} {r['torch_seconds'] * 1e6:>12.1f} {sdpa:>9} "
              f"{r['max_abs_err']:>9.2e}")
        if r.get("tflops"):
            print(f"{'':<24} {'':<15} {'':<16} {r['tflops']:>10.1f} TFLOP/s")
    field = [r for r in rows if "flashinfer" in r or "mamba_ssm" in r]
    if field or FIELD_ERROR:
        print("\nthe field's kernels on the same pool, beside ours (ours us / theirs us: > 1 means ours is slower)")
        print(f"{'kernel':<24} {'kind':<15} {'shape':<16} {'library':<11} {'ours us':>9} {'theirs us':>10} "
              f"{'ratio':>6} {'GB/s':>8} {'max err':>9} {'plan us':>8}")
    if FIELD_ERROR:
        print(f"  ({FIELD_ERROR})")
    for r in field:
        name = "flashinfer" if "flashinfer" in r else "mamba_ssm"
        f = r[name]
        if "error" in f:
            print(f"{r['kernel']:<24} {r['kind']:<15} {r['shape']:<16} {name:<11} failed: {f['error']}")
            continue
        plan = f"{f['plan_seconds'] * 1e6:.0f}" if "plan_seconds" in f else "-"
        print(f"{r['kernel']:<24} {r['kind']:<15} {r['shape']:<16} {name:<11} {r['seconds'] * 1e6:>9.1f} "
              f"{f['seconds'] * 1e6:>10.1f} {r['seconds'] / f['seconds']:>6.2f} {f['gbps']:>8.1f} "
              f"{f['max_abs_err']:>9.2e} {plan:>8}")
        if "kernel_seconds" in f:
            print(f"{'':<24} {'':<15} {'':<16} {'(alone)':<11} {'':>9} {f['kernel_seconds'] * 1e6:>10.1f}"
                  f"   (on gathered states, without the gather and write-back)")
    sweeps = [r for r in rows if r.get("sweep_us") and r["kernel"] == "paged decode attention"]
    if sweeps:
        print("\npaged decode attention, tile sweep (best of block_n x splits x warps; "
              "default: kernel_attention.decode_block_n, decode_splits, 4)")
        for r in sweeps:
            best = min(r["sweep_us"], key=r["sweep_us"].get)
            us = r["sweep_us"][best]
            print(f"  {r['kind']:<15} {r['shape']:<12} {best:<32} {us:>9.1f} us {r['bytes'] / us / 1e3:>8.1f} GB/s")
    prefills = [r for r in rows if r["kernel"] == "paged prefill attention" and r.get("sweep_us")]
    if prefills:
        print("\npaged prefill attention, sweep (block_m x block_n, warps, stages, 16-bit dots; "
              "default: 32 x 64, 8 warps, float32 tiles)")
        for r in prefills:
            for config, us in sorted(r["sweep_us"].items(), key=lambda kv: (isinstance(kv[1], str), kv[1])):
                shown = f"{us:>9.1f} us {r['tflops'] * r['seconds'] * 1e6 / us:>6.1f} TFLOP/s" \
                    if not isinstance(us, str) else us
                print(f"  {r['kind']:<15} {config:<52} {shown}")
    return {"device": [{"device": name, "nominal_peak_gbps": peak, "copy_gbps": copy}], "kernels": rows}


def arguments(parser) -> None:
    parser.add_argument("--only", default=None,
                        help="comma-separated parts: decode, prefill, store, mamba (default: all)")


if __name__ == "__main__":
    harness.main(run, arguments)
