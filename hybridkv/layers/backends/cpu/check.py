"""The self-test of the CPU kernels: every exported function of kernels.c
against torch written from its rules, on small inputs (a scattered pool,
windows, GQA, soft-capping, remainders past the vector width), before the
cpu backend uses any. `check(lib)` raises AssertionError naming the first
that disagrees; the backend then is unavailable ("auto" warns and runs the
reference). A few milliseconds."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .attention import CpuAttention, CpuDecodes, paged_cache
from .modules import gated_activation, norm_rotary

TOLERANCE = dict(atol=1e-5, rtol=1e-4)


def _close(got, expected, what: str) -> None:
    if not torch.allclose(got, expected, **TOLERANCE):
        raise AssertionError(f"{what} differs by {(got - expected).abs().max().item():.3g}")


def _norm(x, weight, offset, eps=1e-6):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (weight + offset)


def _rotate(x, cos, sin):
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], -1) * sin


def _act(x, kind):
    return F.silu(x) if kind == 0 else F.gelu(x, approximate="tanh")


def _scattered_pool(gen, num_pages, bs, kv_heads, dim, positions, firsts):
    """A pool and each row's pages (from the block of its first key), the
    pages drawn at random."""
    cache = torch.randn(num_pages, 2, bs, kv_heads, dim, generator=gen)
    blocks = max(p // bs - f // bs for p, f in zip(positions, firsts)) + 1
    order = torch.randperm(num_pages, generator=gen)
    pages = torch.zeros(len(positions), blocks, dtype=torch.int64)
    for r, (p, f) in enumerate(zip(positions, firsts)):
        count = p // bs - f // bs + 1
        pages[r, :count] = order[r * 6:r * 6 + count]
    return cache, pages


def _attention(q, cache, pages, positions, firsts, scale, softcap, sinks=None):
    """Dense torch: each row's heads over keys firsts[r] .. positions[r];
    sinks [heads]: one more logit per head, in the denominator only."""
    bs, kv_heads = cache.shape[2], cache.shape[3]
    out = torch.empty_like(q)
    for r, (p, f) in enumerate(zip(positions, firsts)):
        keys = torch.arange(f, p + 1)
        slots = pages[r, keys // bs - f // bs], keys % bs
        k = cache[slots[0], 0, slots[1]].repeat_interleave(q.shape[1] // kv_heads, dim=1)
        v = cache[slots[0], 1, slots[1]].repeat_interleave(q.shape[1] // kv_heads, dim=1)
        scores = torch.einsum("hd,nhd->hn", q[r], k) * scale
        if softcap:
            scores = torch.tanh(scores / softcap) * softcap
        if sinks is not None:
            weights = torch.cat([scores, sinks[:, None]], -1).softmax(-1)[:, :-1]
        else:
            weights = scores.softmax(-1)
        out[r] = torch.einsum("hn,nhd->hd", weights, v)
    return out


def check_decode_attention(lib) -> None:
    gen = torch.Generator().manual_seed(0)
    positions, firsts = [0, 5, 13, 22], [0, 2, 0, 9]
    cache, pages = _scattered_pool(gen, 24, 4, 2, 80, positions, firsts)
    q = torch.randn(len(positions), 6, 80, generator=gen)
    dec = CpuDecodes(torch.arange(len(positions)), pages[None], torch.tensor(firsts), torch.tensor(positions))
    sinks = torch.randn(6, generator=gen) * 2
    for softcap, sink in ((None, None), (5.0, None), (None, sinks), (5.0, sinks)):
        got = CpuAttention(lib).attend_decodes(q, cache, dec, 0, 0.3, softcap, sink)
        _close(got, _attention(q, cache, pages, positions, firsts, 0.3, softcap, sink),
               f"decode_attention (softcap {softcap}, {'with' if sink is not None else 'no'} sinks)")


def check_norm_rotary(lib) -> None:
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(3, 5, 40, generator=gen)[:, :, :38]  # strided rows, a remainder past the vector width
    weight = torch.randn(38, generator=gen)
    cos, sin = torch.randn(3, 38, generator=gen), torch.randn(3, 38, generator=gen)
    for offset in (0.0, 1.0):
        _close(norm_rotary(lib, x, weight, offset, 1e-6), _norm(x, weight, offset), f"norm_rotary (offset {offset})")
        _close(norm_rotary(lib, x, weight, offset, 1e-6, cos, sin), _rotate(_norm(x, weight, offset), cos[:, None],
                                                                            sin[:, None]), "norm_rotary rotated")
    _close(norm_rotary(lib, x, None, 0.0, 1e-6, cos, sin), _rotate(x, cos[:, None], sin[:, None]),
           "norm_rotary, rotation alone")


def check_gated_activation(lib) -> None:
    gen = torch.Generator().manual_seed(2)
    gate_up = torch.randn(3, 2 * 37, generator=gen) * 4
    for kind in (0, 1):
        _close(gated_activation(lib, gate_up, kind), _act(gate_up[:, :37], kind) * gate_up[:, 37:],
               f"gated_activation (kind {kind})")


def check_decode_layer(lib) -> None:
    """One decoder layer over two decode rows, Gemma's shape (every norm,
    offset 1, GELU) and Llama's (two norms, offset 0, SiLU) with attention
    sinks; in one call, and in the three parts a tensor-parallel rank runs."""
    gen = torch.Generator().manual_seed(3)
    hidden, q_heads, kv_heads, dim, inter, bs = 48, 4, 2, 16, 40, 4
    positions, firsts = [5, 12], [0, 4]
    for offset, kind, every_norm in ((1.0, 1, True), (0.0, 0, False)):
        def rand(*shape, scale=0.2):
            return torch.randn(*shape, generator=gen) * scale

        w = {"qkv": rand((q_heads + 2 * kv_heads) * dim, hidden), "qkv_bias": rand((q_heads + 2 * kv_heads) * dim),
             "o": rand(hidden, q_heads * dim), "o_bias": None, "gate_up": rand(2 * inter, hidden),
             "down": rand(hidden, inter), "input_norm": rand(hidden), "pre_feedforward_norm": rand(hidden),
             "sinks": None if every_norm else rand(q_heads, scale=2.0)}
        for name, size in (("post_attention_norm", hidden), ("post_feedforward_norm", hidden), ("q_norm", dim),
                           ("k_norm", dim)):
            w[name] = rand(size) if every_norm else None
        cache, pages = _scattered_pool(gen, 24, bs, kv_heads, dim, positions, firsts)
        store_pages = pages[torch.arange(2), torch.tensor(positions) // bs - torch.tensor(firsts) // bs]
        store_offsets = torch.tensor(positions) % bs
        x = rand(2, hidden, scale=1.0)
        angles = rand(2, dim, scale=3.0)
        cos, sin = angles.cos(), angles.sin()
        # torch, from the rules
        expected_cache = cache.clone()
        qkv = F.linear(_norm(x, w["input_norm"], offset), w["qkv"], w["qkv_bias"])
        q, k, v = qkv.split([q_heads * dim, kv_heads * dim, kv_heads * dim], -1)
        q, k, v = q.view(2, q_heads, dim), k.view(2, kv_heads, dim), v.view(2, kv_heads, dim)
        if every_norm:
            q, k = _norm(q, w["q_norm"], offset), _norm(k, w["k_norm"], offset)
        q, k = _rotate(q, cos[:, None], sin[:, None]), _rotate(k, cos[:, None], sin[:, None])
        for r in range(2):
            expected_cache[store_pages[r], 0, store_offsets[r]] = k[r]
            expected_cache[store_pages[r], 1, store_offsets[r]] = v[r]
        attn = _attention(q, expected_cache, pages, positions, firsts, 0.25, 0.0, w["sinks"]).reshape(2, -1)
        o = F.linear(attn, w["o"])
        x1 = x + (_norm(o, w["post_attention_norm"], offset) if every_norm else o)
        h = _norm(x1, w["pre_feedforward_norm"], offset)
        gate_up = F.linear(h, w["gate_up"])
        d = F.linear(_act(gate_up[:, :inter], kind) * gate_up[:, inter:], w["down"])
        expected = x1 + (_norm(d, w["post_feedforward_norm"], offset) if every_norm else d)
        # C
        layer = lib.structs["decoder_layer"](
            hidden=hidden, q_heads=q_heads, kv_heads=kv_heads, head_dim=dim, inter=inter, activation=kind, eps=1e-6,
            norm_offset=offset, scale=0.25, softcap=0.0,
            **{name: None if t is None else t.data_ptr() for name, t in w.items()})
        first, last, store = torch.tensor(firsts), torch.tensor(positions), store_pages.contiguous()
        rows = lib.structs["decode_rows"](rows=2, max_blocks=pages.shape[1], pages=pages.data_ptr(),
                                          first=first.data_ptr(), last=last.data_ptr(), store_pages=store.data_ptr(),
                                          store_offsets=store_offsets.data_ptr())
        # The whole layer in one call, then in its three parts (a tensor-parallel
        # rank's, here with nothing to add between them: one rank's sums are whole).
        for parts in ((0,), (1, 2, 3)):
            got, sums = x.clone(), torch.empty_like(x)
            for part in parts:
                status = lib.decode_layer(layer, paged_cache(lib, cache), rows, got.data_ptr(), cos.data_ptr(),
                                          sin.data_ptr(), sums.data_ptr() if part else None, part,
                                          torch.get_num_threads())
                if status != 0:
                    raise AssertionError("decode_layer failed to allocate")
            _close(got, expected, f"decode_layer (offset {offset}, parts {parts})")
            written = [(int(p), int(s)) for p, s in zip(store_pages, store_offsets)]
            for page, slot in written:
                _close(cache[page, :, slot], expected_cache[page, :, slot], "decode_layer's K/V store")


def check(lib) -> None:
    """Every exported function of the library against torch."""
    with torch.inference_mode():
        check_decode_attention(lib)
        check_norm_rotary(lib)
        check_gated_activation(lib)
        check_decode_layer(lib)
