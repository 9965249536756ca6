"""The self-test of the CPU kernels: every exported function of kernels.c,
in float32 and in bfloat16, against torch written from its rules, on
small inputs (a scattered pool, windows, GQA, soft-capping, remainders
past the vector width), before the cpu backend uses any. `check(lib)`
raises AssertionError naming the first that disagrees; the backend then is
unavailable ("auto" warns and runs the reference). A few milliseconds.

Tolerances: float32 results equal torch's to float32 rounding
(`TOLERANCE`). bfloat16 ones round where torch's modules round, so they
equal torch's but where a float32 rounding apart falls either side of a
bfloat16 one: in at most one element in a thousand, by one bfloat16 step
(`_bf16_equal`); a rounding dropped or added changes far more. Attention
rounds once, its output: within one step of torch's float32 result.
(`host_all_reduce` needs ranks to meet: tests/test_host_reduce.py runs
it; the backend does not call it.)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ...kv_quant import QuantizedCache, dequantize, quantize, rotation
from .attention import STORAGE, CpuAttention, CpuDecodes, CpuPrefills, paged_cache
from .decoder import layer_weights, tiled, tiles
from .modules import gated_activation, norm_rotary

TOLERANCE = dict(atol=1e-5, rtol=1e-4)


def _close(got, expected, what: str) -> None:
    if not torch.allclose(got, expected, **TOLERANCE):
        raise AssertionError(f"{what} differs by {(got - expected).abs().max().item():.3g}")


def _steps(x: torch.Tensor) -> torch.Tensor:
    """One bfloat16 step (unit in the last place) at each |x|; 0 at 0."""
    _, exponent = torch.frexp(x.float())
    return torch.where(x == 0, 0.0, torch.ldexp(torch.ones_like(x, dtype=torch.float32), exponent - 8))


def _bf16_equal(got, expected, what: str, atol: float = 0.0) -> None:
    """got equals expected (bfloat16 both) but in at most one element in a
    thousand (at least one), each within one bfloat16 step (or atol)."""
    assert got.dtype == expected.dtype == torch.bfloat16, what
    diff = (got.float() - expected.float()).abs()
    far = diff > _steps(expected) + atol
    if far.any() or (diff > 0).sum() > max(1, got.numel() // 1000):
        raise AssertionError(f"{what} differs from torch's in {(diff > 0).sum().item()} of {got.numel()} "
                             f"bfloat16 elements, {far.sum().item()} by more than a step")


def _bf16_near(got, exact, what: str) -> None:
    """got (bfloat16) within one bfloat16 step of torch's float32 result,
    to float32's tolerance."""
    assert got.dtype == torch.bfloat16, what
    far = (got.float() - exact).abs() > _steps(exact) + TOLERANCE["atol"] + TOLERANCE["rtol"] * exact.abs()
    if far.any():
        raise AssertionError(f"{what} is over a bfloat16 step from torch's float32 result in {far.sum().item()} "
                             f"elements")


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


def _int16_bound(q, codes, scales, pages, positions, firsts, scale, block=64):
    """[rows, q_heads, 1]: how far decode attention over int8 pages may be
    moved by its integer products (kernels.c `dot4_codes`, `weigh_codes`),
    q the rotated queries: each query element by half its head's int16 step
    (its largest / 32,767), which moves each score by at most delta (scale
    x half a step x the key's sum of magnitudes) and each softmax weight by
    a factor within e^(+-2 delta) (a soft-cap and a sink move it no more);
    each value weight by half its block's step, times at most 127 codes
    over the denominator; the rotation back keeps the error's length, at
    most sqrt(dim) times its largest element. Doubled for the float32 sums
    around them."""
    bs, kv_heads, dim = codes.shape[2], codes.shape[3], codes.shape[4]
    keys, values = dequantize(codes, scales, torch.float32).unbind(1)
    bound = torch.empty(q.shape[0], q.shape[1], 1)
    for r, (p, f) in enumerate(zip(positions, firsts)):
        at = torch.arange(f, p + 1)
        slots = pages[r, at // bs - f // bs], at % bs
        for head in range(q.shape[1]):
            kv = head // (q.shape[1] // kv_heads)
            k, v = keys[slots[0], slots[1], kv], values[slots[0], slots[1], kv]
            delta = scale * q[r, head].abs().max() / 32767 / 2 * k.abs().sum(-1).max()
            weights = torch.softmax(scale * (k @ q[r, head]), 0) * scales[slots[0], 1, slots[1], kv]
            steps = torch.stack([w.max() for w in weights.split(block)]) / 32767
            rounding = (steps / 2 * 127 * torch.tensor([len(w) for w in weights.split(block)])).sum()
            moved = torch.expm1(2 * delta) * v.abs().max() + rounding
            bound[r, head] = 2 * dim ** 0.5 * moved
    return bound


def check_decode_attention(lib) -> None:
    gen = torch.Generator().manual_seed(0)
    positions, firsts = [0, 5, 13, 22], [0, 2, 0, 9]
    cache, pages = _scattered_pool(gen, 24, 4, 2, 80, positions, firsts)
    q = torch.randn(len(positions), 6, 80, generator=gen)
    dec = CpuDecodes(torch.arange(len(positions)), pages[None], torch.tensor(firsts), torch.tensor(positions))
    sinks = torch.randn(6, generator=gen) * 2
    for softcap, sink in ((None, None), (5.0, None), (None, sinks), (5.0, sinks)):
        what = f"decode_attention (softcap {softcap}, {'with' if sink is not None else 'no'} sinks"
        got = CpuAttention(lib).attend_decodes(q, cache, dec, 0, 0.3, softcap, sink)
        _close(got, _attention(q, cache, pages, positions, firsts, 0.3, softcap, sink), what + ")")
        # bfloat16 pages read by float32 queries, and bfloat16 both (the output too)
        q16, cache16 = q.bfloat16(), cache.bfloat16()
        got = CpuAttention(lib).attend_decodes(q, cache16, dec, 0, 0.3, softcap, sink)
        _close(got, _attention(q, cache16.float(), pages, positions, firsts, 0.3, softcap, sink),
               what + ", bfloat16 pages)")
        got = CpuAttention(lib).attend_decodes(q16, cache16, dec, 0, 0.3, softcap, sink)
        _bf16_near(got, _attention(q16.float(), cache16.float(), pages, positions, firsts, 0.3, softcap, sink),
                   what + ", bfloat16)")
        # int8 pages: codes and a scale per token and head, against the values they stand for; rows of
        # 80 are stored as they are, rows of 64 (a power of two) rotated, the kernel rotating the queries
        # and the output alike (kv_quant.py)
        # (heads of different sizes: each has its own int16 step where the integer products run)
        apart = (q * torch.linspace(0.5, 2.0, q.shape[1])[:, None]).contiguous()
        for width in (80, 64):
            hadamard = rotation(torch.int8, width, "cpu")
            turn = torch.eye(width) if hadamard is None else hadamard
            scaled = cache[..., :width] * torch.linspace(0.1, 10.0, cache.shape[2])[:, None, None]
            codes, scales = quantize(scaled @ turn, torch.int8)
            got = CpuAttention(lib).attend_decodes(apart[..., :width].contiguous(), QuantizedCache(codes, scales),
                                                   dec, 0, 0.3, softcap, sink)
            expected = _attention(apart[..., :width], dequantize(codes, scales, torch.float32) @ turn, pages,
                                  positions, firsts, 0.3, softcap, sink)
            # a rotation's sums round in another order than the product's: float32 rounding of the largest values;
            # rows of 64 may take the integer products, within what their int16 steps can move (_int16_bound)
            bound = 1e-5 + 2e-5 * expected.abs().max()
            if width % 64 == 0:
                bound = bound + _int16_bound(apart[..., :width] @ turn, codes, scales, pages, positions, firsts, 0.3)
            if ((got - expected).abs() > bound).any():
                raise AssertionError(f"{what}, int8 pages of {width}-wide rows) differs by "
                                     f"{(got - expected).abs().max().item():.3g}")
        # float8 pages: codes (not rotated) and their scales, every code of the type among them
        for codes_dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            scaled = cache * torch.logspace(-3, 1, cache.shape[2])[:, None, None]
            codes, scales = quantize(scaled, codes_dtype)
            got = CpuAttention(lib).attend_decodes(q, QuantizedCache(codes, scales), dec, 0, 0.3, softcap, sink)
            expected = _attention(q, dequantize(codes, scales, torch.float32), pages, positions, firsts, 0.3,
                                  softcap, sink)
            if (got - expected).abs().max() > 1e-5 + 1e-5 * expected.abs().max():
                raise AssertionError(f"{what}, {codes_dtype} pages) differs by "
                                     f"{(got - expected).abs().max().item():.3g}")
    check_decode_chunks(lib)


def check_decode_chunks(lib) -> None:
    """Rows past two of attend_heads' chunks (kernels.c DECODE_CHUNK, 256
    keys): 1,300 keys, and 700 from position 100 (a window), each row's
    largest scores planted in its last chunk (what the earlier chunks
    summed is rescaled) or its first (nothing is), float32 and int8 pages,
    with and without sinks and soft-capping."""
    gen = torch.Generator().manual_seed(12)
    positions, firsts = [1299, 799, 1299, 799], [0, 100, 0, 100]
    bs, dim = 16, 64
    cache = torch.randn(1 + 4 * 82, 2, bs, 1, dim, generator=gen)
    pages = torch.zeros(4, 82, dtype=torch.int64)
    for r, (p, f) in enumerate(zip(positions, firsts)):
        count = p // bs - f // bs + 1
        pages[r, :count] = 1 + r * 82 + torch.randperm(count, generator=gen)
    q = torch.randn(len(positions), 4, dim, generator=gen)
    # a key along the query: the row's largest scores, far past the others (e^(their difference) overflows float32)
    for r, near in enumerate((1290, 790, 5, 105)):
        cache[pages[r, near // bs - firsts[r] // bs], 0, near % bs, 0] = q[r].mean(0) * 40
    dec = CpuDecodes(torch.arange(len(positions)), pages[None], torch.tensor(firsts), torch.tensor(positions))
    sinks = torch.randn(4, generator=gen) * 2
    hadamard = rotation(torch.int8, dim, "cpu")
    codes, scales = quantize(cache @ hadamard, torch.int8)
    for softcap, sink in ((None, None), (30.0, sinks)):
        what = (f"decode_attention over rows of 1,300 and 700 keys (softcap {softcap}, "
                f"{'with' if sink is not None else 'no'} sinks")
        got = CpuAttention(lib).attend_decodes(q, cache, dec, 0, 0.3, softcap, sink)
        _close(got, _attention(q, cache, pages, positions, firsts, 0.3, softcap, sink), what + ")")
        got = CpuAttention(lib).attend_decodes(q, QuantizedCache(codes, scales), dec, 0, 0.3, softcap, sink)
        expected = _attention(q, dequantize(codes, scales, torch.float32) @ hadamard, pages, positions, firsts, 0.3,
                              softcap, sink)
        bound = 1e-5 + 2e-5 * expected.abs().max() + _int16_bound(q @ hadamard, codes, scales, pages, positions,
                                                                   firsts, 0.3)
        if ((got - expected).abs() > bound).any():
            raise AssertionError(f"{what}, int8 pages) differs by {(got - expected).abs().max().item():.3g}")


def check_norm_rotary(lib) -> None:
    gen = torch.Generator().manual_seed(1)
    full = torch.randn(3, 5, 40, generator=gen)
    x = full[:, :, :38]  # strided rows, a remainder past the vector width
    weight = torch.randn(38, generator=gen)
    cos, sin = torch.randn(3, 38, generator=gen), torch.randn(3, 38, generator=gen)
    for offset in (0.0, 1.0):
        _close(norm_rotary(lib, x, weight, offset, 1e-6), _norm(x, weight, offset), f"norm_rotary (offset {offset})")
        _close(norm_rotary(lib, x, weight, offset, 1e-6, cos, sin), _rotate(_norm(x, weight, offset), cos[:, None],
                                                                            sin[:, None]), "norm_rotary rotated")
    _close(norm_rotary(lib, x, None, 0.0, 1e-6, cos, sin), _rotate(x, cos[:, None], sin[:, None]),
           "norm_rotary, rotation alone")
    # bfloat16, as layers/norm.py's conventions round: Gemma's (1 + w) and a
    # float32 weight scale in float32, then round; Llama's w scales the
    # rounded norm. The rotation rounds each product and the sum.
    x, cos, sin = full.bfloat16()[:, :, :38], cos.bfloat16(), sin.bfloat16()
    for offset, w, round_first in ((1.0, weight.bfloat16(), False), (0.0, weight, False),
                                   (0.0, weight.bfloat16(), True)):
        what = f"norm_rotary (bfloat16, offset {offset}, {w.dtype} weight{', rounded first' if round_first else ''})"
        normed = _norm(x.float(), w.float(), offset).bfloat16() if not round_first else \
            w * (_norm(x.float(), torch.ones(()), 0.0).bfloat16())
        got = norm_rotary(lib, x, w, offset, 1e-6, round_first=round_first)
        _bf16_equal(got, normed, what)
        _bf16_equal(norm_rotary(lib, x, w, offset, 1e-6, cos, sin, round_first), _rotate(got, cos[:, None],
                                                                                       sin[:, None]), what + " rotated")
    _bf16_equal(norm_rotary(lib, x, None, 0.0, 1e-6, cos, sin), _rotate(x, cos[:, None], sin[:, None]),
                "norm_rotary, rotation alone (bfloat16)")


def check_gated_activation(lib) -> None:
    gen = torch.Generator().manual_seed(2)
    gate_up = torch.randn(3, 2 * 37, generator=gen) * 4
    for kind in (0, 1):
        _close(gated_activation(lib, gate_up, kind), _act(gate_up[:, :37], kind) * gate_up[:, 37:],
               f"gated_activation (kind {kind})")
    # bfloat16: the activation rounded, then the product (torch's two ops).
    # Against the rule in float64: torch's GELU-tanh loses its tail to
    # 1 + tanh cancelling (0 below a gate of -6); the kernel's exp stops at
    # e^-87, a difference below 1e-30.
    gate_up = gate_up.bfloat16()
    gate, up = gate_up[:, :37].double(), gate_up[:, 37:]
    for kind in (0, 1):
        y = gate if kind == 0 else 1.5957691216057308 * (gate + 0.044715 * gate ** 3)
        _bf16_equal(gated_activation(lib, gate_up, kind), (gate * torch.sigmoid(y)).bfloat16() * up,
                    f"gated_activation (bfloat16, kind {kind})", atol=1e-30)


def check_decode_layer(lib) -> None:
    """One decoder layer over five decode rows, Gemma's shape (every norm,
    offset 1, GELU) and Llama's (two norms, offset 0, SiLU) with attention
    sinks; in one call, in the three parts a tensor-parallel rank runs, and
    in the stages between the products (`layer_stage`, torch making the
    products of the weights in dtype: each product's output rounded to it
    too, and the activation's, which the rule then rounds alike).
    In bfloat16 (weights, pool, x, cos and sin) against the same rule in
    float32 from the same values, rounded where the kernel rounds: the K/V
    stored, x after each residual add, and (where the CPU has its bfloat16
    dot product) each product's input. The second rounding sees a
    float32 difference in the first's input, so the output is within two
    bfloat16 steps of the rule's. And in float32 over int8 pages (the K/V
    rotated) and float8_e4m3fn ones: the keys less a centre, stored as
    codes and scales (kv_quant.py), attention over the values the pages
    stand for; a code
    may round the other way where the kernel's float32 K differs from
    torch's in its last bit, so the output is compared to 1e-3."""
    gen = torch.Generator().manual_seed(3)
    # (48 and 38 wide: the tiled products' last tile holds zeros past a matrix's rows and columns)
    hidden, q_heads, kv_heads, dim, inter, bs = 48, 4, 2, 16, 38, 4
    # Five rows: the products' tiles take four at a time, and a fifth alone.
    positions, firsts = [5, 12, 2, 9, 15], [0, 4, 0, 8, 12]
    R = len(positions)
    for dtype, offset, kind, every_norm, codes in (
            (torch.float32, 1.0, 1, True, None), (torch.float32, 0.0, 0, False, None),
            (torch.bfloat16, 1.0, 1, True, None), (torch.bfloat16, 0.0, 0, False, None),
            (torch.float32, 1.0, 1, True, torch.int8), (torch.float32, 0.0, 0, False, torch.float8_e4m3fn)):
        def rand(*shape, scale=0.2):
            return (torch.randn(*shape, generator=gen) * scale).to(dtype).float()  # values dtype holds

        def rounded(t):  # as the kernel stores t in dtype
            return t.to(dtype).float()

        def product_input(t):  # bfloat16 products on the CPU's dot product read their input rounded
            return rounded(t) if dtype == torch.bfloat16 and lib.native_bf16_products else t

        w = {"qkv": rand((q_heads + 2 * kv_heads) * dim, hidden), "qkv_bias": rand((q_heads + 2 * kv_heads) * dim),
             "o": rand(hidden, q_heads * dim), "o_bias": None, "gate_up": rand(2 * inter, hidden),
             "down": rand(hidden, inter), "input_norm": rand(hidden), "pre_feedforward_norm": rand(hidden),
             "sinks": None if every_norm else rand(q_heads, scale=2.0)}
        for name, size in (("post_attention_norm", hidden), ("post_feedforward_norm", hidden), ("q_norm", dim),
                           ("k_norm", dim)):
            w[name] = rand(size) if every_norm else None
        if codes is not None and codes != torch.int8:
            # K/V elements down to float8's subnormal codes (each rotary pair, d and d + dim / 2, alike)
            spread = torch.logspace(0, -5.5, dim // 2).repeat(4 * kv_heads)
            w["qkv"][q_heads * dim:] *= spread[:, None]
            w["qkv_bias"][q_heads * dim:] *= spread
        cache, pages = _scattered_pool(gen, 32, bs, kv_heads, dim, positions, firsts)
        cache = rounded(cache)
        if codes is not None:  # pages of codes (int8 rows rotated: kv_quant.py), and the values they stand for
            hadamard = rotation(codes, dim, "cpu")
            turn = torch.eye(dim) if hadamard is None else hadamard
            pool_codes = quantize(cache @ turn, codes)
            cache = dequantize(*pool_codes, torch.float32) @ turn
        store_pages = pages[torch.arange(R), torch.tensor(positions) // bs - torch.tensor(firsts) // bs]
        store_offsets = torch.tensor(positions) % bs
        x = rand(R, hidden, scale=1.0)
        angles = torch.randn(R, dim, generator=gen) * 3.0
        cos, sin = rounded(angles.cos()), rounded(angles.sin())
        # torch, from the rules
        expected_cache = cache.clone()
        qkv = F.linear(product_input(_norm(x, w["input_norm"], offset)), w["qkv"], w["qkv_bias"])
        q, k, v = qkv.split([q_heads * dim, kv_heads * dim, kv_heads * dim], -1)
        q, k, v = q.view(R, q_heads, dim), k.view(R, kv_heads, dim), v.view(R, kv_heads, dim)
        if every_norm:
            q, k = _norm(q, w["q_norm"], offset), _norm(k, w["k_norm"], offset)
        q, k = _rotate(q, cos[:, None], sin[:, None]), _rotate(k, cos[:, None], sin[:, None])
        # over codes, the keys stored less a centre (kv_quant.KeyCentre; a large one, as real keys have)
        centre = rand(kv_heads, dim, scale=2.0) if codes is not None else None
        if codes is not None and codes != torch.int8:  # spread like K, down to float8's subnormal codes
            centre *= spread[:kv_heads * dim].view(kv_heads, dim)
        if centre is not None:
            k = k - centre
        stored = (lambda t: dequantize(*quantize(t @ turn, codes), torch.float32) @ turn) if codes is not None \
            else rounded
        for r in range(R):
            expected_cache[store_pages[r], 0, store_offsets[r]] = stored(k[r])
            expected_cache[store_pages[r], 1, store_offsets[r]] = stored(v[r])
        attn = _attention(q, expected_cache, pages, positions, firsts, 0.25, 0.0, w["sinks"]).reshape(R, -1)
        o = F.linear(product_input(attn), w["o"])
        x1 = rounded(x + (_norm(o, w["post_attention_norm"], offset) if every_norm else o))
        h = _norm(x1, w["pre_feedforward_norm"], offset)
        gate_up = F.linear(product_input(h), w["gate_up"])
        d = F.linear(product_input(_act(gate_up[:, :inter], kind) * gate_up[:, inter:]), w["down"])
        expected = x1 + (_norm(d, w["post_feedforward_norm"], offset) if every_norm else d)
        # the rule with every product's input and output in dtype (the stages'; in float32 the same rule)
        staged_cache = cache.clone()
        sq, sk, sv = rounded(F.linear(rounded(_norm(x, w["input_norm"], offset)), w["qkv"], w["qkv_bias"])).split(
            [q_heads * dim, kv_heads * dim, kv_heads * dim], -1)
        sq, sk, sv = sq.reshape(R, q_heads, dim), sk.reshape(R, kv_heads, dim), sv.reshape(R, kv_heads, dim)
        if every_norm:
            sq, sk = _norm(sq, w["q_norm"], offset), _norm(sk, w["k_norm"], offset)
        sq, sk = _rotate(sq, cos[:, None], sin[:, None]), _rotate(sk, cos[:, None], sin[:, None])
        if centre is not None:
            sk = sk - centre
        for r in range(R):
            staged_cache[store_pages[r], 0, store_offsets[r]] = stored(sk[r])
            staged_cache[store_pages[r], 1, store_offsets[r]] = stored(sv[r])
        so = rounded(F.linear(rounded(_attention(sq, staged_cache, pages, positions, firsts, 0.25, 0.0, w["sinks"])
                                      .reshape(R, -1)), w["o"]))
        sx1 = rounded(x + (_norm(so, w["post_attention_norm"], offset) if every_norm else so))
        sgu = rounded(F.linear(rounded(_norm(sx1, w["pre_feedforward_norm"], offset)), w["gate_up"]))
        sd = rounded(F.linear(rounded(_act(sgu[:, :inter], kind) * sgu[:, inter:]), w["down"]))
        staged = sx1 + (_norm(sd, w["post_feedforward_norm"], offset) if every_norm else sd)
        # C: the products' weights, the pool, x, cos and sin in dtype; the rest float32
        held = {name: t for name, t in w.items() if name not in ("qkv", "o", "gate_up", "down")}
        held.update(layer_weights(lib, dtype, *(w[name].to(dtype) for name in ("qkv", "o", "gate_up", "down")), inter))
        layer = lib.structs["decoder_layer"](
            hidden=hidden, q_heads=q_heads, kv_heads=kv_heads, head_dim=dim, inter=inter, activation=kind,
            dtype=STORAGE[dtype], eps=1e-6, norm_offset=offset, scale=0.25, softcap=0.0,
            tiled=int(tiled(lib, dtype)),
            k_centre=None if centre is None else centre.data_ptr(),
            **{name: None if t is None else t.data_ptr() for name, t in held.items()})
        first, last, store = torch.tensor(firsts), torch.tensor(positions), store_pages.contiguous()
        rows = lib.structs["decode_rows"](rows=R, max_blocks=pages.shape[1], pages=pages.data_ptr(),
                                          first=first.data_ptr(), last=last.data_ptr(), store_pages=store.data_ptr(),
                                          store_offsets=store_offsets.data_ptr())
        pool, cos, sin = cache.to(dtype), cos.to(dtype), sin.to(dtype)
        if codes is not None:
            pool = QuantizedCache(*pool_codes)
            if codes == torch.int8:
                _check_scales_apart(lib, layer, pool, rows, pages, first, last, store, store_offsets, x.to(dtype),
                                    cos, sin)
        # The whole layer in one call, then in its three parts (a tensor-parallel
        # rank's, here with nothing to add between them: one rank's sums are whole),
        # then in stages.
        for parts in ((0,), (1, 2, 3), "stages"):
            what = f"decode_layer ({dtype}{f', {codes} pages' if codes else ''}, offset {offset}, parts {parts})"
            got, sums = x.to(dtype, copy=True), torch.empty(x.shape)
            if parts == "stages":
                what = what.replace("decode_layer", "layer_stage")
                _stages(lib, layer, paged_cache(lib, pool), rows, got, cos, sin,
                        {name: w[name].to(dtype) for name in ("qkv", "o", "gate_up", "down")},
                        w["qkv_bias"].to(dtype), q_heads * dim, inter)
                expected, expected_cache = staged, staged_cache
            for part in parts if parts != "stages" else ():
                status = lib.decode_layer(layer, paged_cache(lib, pool), rows, got.data_ptr(), cos.data_ptr(),
                                          sin.data_ptr(), sums.data_ptr() if part else None, part,
                                          torch.get_num_threads())
                if status != 0:
                    raise AssertionError("decode_layer failed to allocate")
            written = [(int(p), int(s)) for p, s in zip(store_pages, store_offsets)]
            if codes == torch.int8:
                if not torch.allclose(got, expected, atol=1e-3, rtol=1e-3):
                    raise AssertionError(f"{what} differs by {(got - expected).abs().max().item():.3g}")
                values = dequantize(pool.codes, pool.scales, torch.float32) @ hadamard
                for page, slot in written:  # within one code of torch's in each element, rotated back
                    step = pool.scales[page, :, slot] * dim ** 0.5 * 1.01
                    if ((values[page, :, slot] - expected_cache[page, :, slot]).norm(dim=-1) > step).any():
                        raise AssertionError("decode_layer's int8 K/V store differs from kv_quant's")
                continue
            if codes is not None:  # float8: each element within half a code of torch's K/V (3 mantissa bits)
                if not torch.allclose(got, expected, atol=1e-3, rtol=1e-3):
                    raise AssertionError(f"{what} differs by {(got - expected).abs().max().item():.3g}")
                values = dequantize(pool.codes, pool.scales, torch.float32)
                for r, (page, slot) in enumerate(written):
                    for half, row in enumerate((k[r], v[r])):
                        scale = pool.scales[page, half, slot, :, None]  # subnormal codes below 2^-6 in steps of 2^-9
                        bound = torch.where(row.abs() < scale * 2 ** -6, scale * 2 ** -10, row.abs() * 2 ** -4) * 1.01
                        if ((values[page, half, slot] - row).abs() > bound).any():
                            raise AssertionError(f"decode_layer's {codes} K/V store differs from kv_quant's")
                continue
            if dtype == torch.float32:
                _close(got, expected, what)
                for page, slot in written:
                    _close(pool[page, :, slot], expected_cache[page, :, slot], "decode_layer's K/V store")
                continue
            far = (got.float() - expected).abs() > 2 * _steps(expected) + TOLERANCE["atol"]
            if far.any():
                raise AssertionError(f"{what} is over two bfloat16 steps from torch's float32 result")
            for page, slot in written:
                _bf16_near(pool[page, :, slot], expected_cache[page, :, slot], "decode_layer's K/V store (bfloat16)")


def _check_scales_apart(lib, layer, pool, rows, pages, first, last, store, offsets, x, cos, sin) -> None:
    """decode_layer over codes whose scales lie in pages of their own
    (core/layout.py `scales_apart`): the scales moved to other pages, named
    by decode_rows' scale_pages and store_scale_pages, give the output and
    stores the layer gives with them beside their codes, bit for bit."""
    moved = torch.roll(torch.arange(pool.scales.shape[0]), 5)  # page p's scales on page moved[p]
    apart = QuantizedCache(pool.codes.clone(), torch.zeros_like(pool.scales))
    apart.scales[moved] = pool.scales
    beside = QuantizedCache(pool.codes.clone(), pool.scales.clone())
    scale_pages, store_scales = moved[pages].contiguous(), moved[store].contiguous()
    apart_rows = lib.structs["decode_rows"](rows=rows.rows, max_blocks=rows.max_blocks, pages=pages.data_ptr(),
                                            first=first.data_ptr(), last=last.data_ptr(), store_pages=store.data_ptr(),
                                            store_offsets=offsets.data_ptr(), scale_pages=scale_pages.data_ptr(),
                                            store_scale_pages=store_scales.data_ptr())
    outs = []
    for cache, how in ((beside, rows), (apart, apart_rows)):
        got = x.clone()
        if lib.decode_layer(layer, paged_cache(lib, cache), how, got.data_ptr(), cos.data_ptr(), sin.data_ptr(),
                            None, 0, torch.get_num_threads()) != 0:
            raise AssertionError("decode_layer failed to allocate")
        outs.append(got)
    if not (torch.equal(*outs) and torch.equal(beside.codes, apart.codes) and
            torch.equal(beside.scales, apart.scales[moved])):
        raise AssertionError("decode_layer reads or writes scales apart from their codes (scale_pages) wrongly")


def _stages(lib, layer, cache, rows, x, cos, sin, w, qkv_bias, q_width: int, inter: int) -> None:
    """x through `layer_stage`'s five stages, torch making the products of
    the weights `w` (of x's dtype) between them, as decoder.py's
    CpuDecoderLayer does with the modules' products."""
    def stage(product, width, which):
        out = None if width == 0 else torch.empty(x.shape[0], width, dtype=x.dtype)
        product = None if product is None else product.contiguous()  # (held: C reads it)
        if lib.layer_stage(layer, cache, rows, x.data_ptr(), cos.data_ptr(), sin.data_ptr(),
                           None if product is None else product.data_ptr(),
                           None if out is None else out.data_ptr(), which, torch.get_num_threads()) != 0:
            raise AssertionError("layer_stage failed")
        return out

    h = stage(None, x.shape[1], 0)
    heads = stage(F.linear(h, w["qkv"], qkv_bias), q_width, 1)
    h = stage(F.linear(heads, w["o"]), x.shape[1], 2)
    act = stage(F.linear(h, w["gate_up"]), inter, 3)
    stage(F.linear(act, w["down"]), 0, 4)


def check_rotate_rows(lib) -> None:
    """Rows times the orthonormal Hadamard matrix (kv_quant.rotation), in
    place, through a stride (a wider row's first 256, 64, 16 and 8 elements:
    the butterflies within 16 elements run in registers where the CPU has
    AVX-512), and a width that is no power of two refused."""
    gen = torch.Generator().manual_seed(6)
    for width in (256, 64, 16, 8):
        x = torch.randn(5, 3, width + 16, generator=gen)
        expected = x[..., :width] @ rotation(torch.int8, width, "cpu")
        if lib.rotate_rows(x.data_ptr(), 15, width, width + 16, 2) != 0:
            raise AssertionError("rotate_rows failed")
        if (x[..., :width] - expected).abs().max() > 1e-5 * width ** 0.5:
            raise AssertionError(f"rotate_rows of {width}-wide rows differs from the Hadamard product")
    x = torch.randn(5, 3, 80, generator=gen)
    if lib.rotate_rows(x.data_ptr(), 1, 80, 80, 2) != -1:
        raise AssertionError("rotate_rows took rows of 80 elements")


def check_masked_softmax(lib) -> None:
    """A prefill tile's weights: float32 and bfloat16 scores (three query
    heads a row, 37 keys: a tail past the vector width), each row seeing
    its own keys through a strided mask (one row none: all zeros), with
    and without soft-capping, each with and without sinks (rows without a
    soft-cap take the AVX-512 passes where built), out of place and in place; within
    one bfloat16 step of torch's float32 softmax in bfloat16 (it rounds
    once, where it writes)."""
    gen = torch.Generator().manual_seed(8)
    rows, groups, keys, scale = 5, 3, 37, 0.3
    wide = torch.zeros(rows, keys + 11, dtype=torch.bool)  # rows keys + 11 bytes apart
    for r in range(rows):
        wide[r, :20 + 3 * r] = r != 2
    visible = wide[:, :keys]
    for dtype in STORAGE:
        sinks_of_row = torch.randn(groups, generator=gen)
        for softcap, sinks in ((0.0, None), (0.0, sinks_of_row), (4.0, None), (4.0, sinks_of_row)):
            for in_place in (False, True):
                scores = (torch.randn(rows, groups, keys, generator=gen) * 4).to(dtype)
                x = scores.float() * scale
                if softcap:
                    x = torch.tanh(x / softcap) * softcap
                x = x.masked_fill(~visible[:, None, :], float("-inf"))
                if sinks is not None:
                    x = torch.cat([x, sinks.view(1, groups, 1).expand(rows, groups, 1)], dim=-1)
                expected = torch.softmax(x, dim=-1)[..., :keys].nan_to_num(0.0)
                out = scores if in_place else torch.empty_like(scores)
                status = lib.masked_softmax(scores.data_ptr(), visible.data_ptr(), wide.stride(0), rows, groups, keys,
                                            scale, softcap, None if sinks is None else sinks.data_ptr(),
                                            out.data_ptr(), STORAGE[dtype], 2)
                what = f"masked_softmax ({dtype}, softcap {softcap}, sinks {sinks is not None})"
                if status != 0:
                    raise AssertionError(f"{what} failed")
                if dtype == torch.float32:
                    _close(out, expected, what)
                elif ((out.float() - expected).abs() > _steps(expected)).any():
                    raise AssertionError(f"{what} is more than one bfloat16 step from torch's float32 weights")


def check_prefill_attention(lib) -> None:
    """Prefill chunks on AMX tiles (bfloat16): three chunks of a step, of
    37 rows (16-row blocks whole and cut), 5 rows after 21 cached keys, and
    1 row; a window of 23 keys (first visible keys differing inside a
    block), six query heads over two KV heads (a batch of four and one of
    two), heads 96 wide (six 16-wide output blocks: four and two), pages
    scattered; with and without soft-capping and sinks. Within one bfloat16
    step of torch's float32 attention over the same values, plus what
    rounding the weights to bfloat16 (before the second product) can move:
    2^-9 of the largest value in the pool. Where the kernels have no AMX,
    the call must decline and leave the caller to the tiles' path."""
    gen = torch.Generator().manual_seed(9)
    bs, kv_heads, q_heads, dim, window = 8, 2, 6, 96, 23
    chunks = [(0, 37, 0), (37, 5, 21), (42, 1, 9)]  # (first row of q, rows, position of the first)
    tokens = sum(c[1] for c in chunks)
    q = (torch.randn(tokens, q_heads, dim, generator=gen) * 0.5).bfloat16()
    cache = torch.randn(40, 2, bs, kv_heads, dim, generator=gen).bfloat16()
    order = torch.randperm(40, generator=gen)
    positions, firsts, rows_pages, table, used = [], [], [], [], 0
    for start, count, q0 in chunks:
        key_pos = max(0, q0 - window + 1) // bs * bs
        blocks = (q0 + count - 1) // bs - key_pos // bs + 1
        pages = order[used:used + blocks]
        used += blocks
        table.append((start, count, q0, key_pos, blocks, pages))
        for j in range(count):
            p = q0 + j
            f = max(0, p - window + 1) if start != 42 else 0  # each row's first key is the caller's: this one, 0
            positions.append(p)
            firsts.append(f)
            rows_pages.append(pages[f // bs - key_pos // bs:])
    width = max(len(r) for r in rows_pages)
    row_pages = torch.zeros(tokens, width, dtype=torch.int64)
    for r, pages in enumerate(rows_pages):
        row_pages[r, :len(pages)] = pages
    blocks = max(t[4] for t in table)
    all_pages = torch.zeros(1, len(chunks), blocks, dtype=torch.int64)
    for i, t in enumerate(table):
        all_pages[0, i, :t[4]] = t[5]
    prefills = CpuPrefills(torch.tensor([t[:4] + (t[4] * bs,) for t in table], dtype=torch.int64).t().contiguous(),
                           all_pages, torch.tensor(firsts, dtype=torch.int64))
    sinks = torch.randn(q_heads, generator=gen) * 2
    for softcap, sink in ((None, None), (5.0, None), (None, sinks), (5.0, sinks)):
        what = f"prefill_attention (softcap {softcap}, {'with' if sink is not None else 'no'} sinks)"
        out = torch.zeros_like(q)
        ran = CpuAttention(lib).attend_prefills(q, cache, prefills, 0, 0.3, softcap, sink, out)
        if not lib.amx_prefill_attention:  # no AMX in the build, or Linux refused its state (lib.amx_refused)
            if ran:
                raise AssertionError(f"{what} ran in a build without AMX tiles")
            continue
        if not ran:
            raise AssertionError(f"{what} declined bfloat16 pages on a CPU with AMX tiles")
        exact = _attention(q.float(), cache.float(), row_pages, positions, firsts, 0.3, softcap, sink)
        far = (out.float() - exact).abs() > _steps(exact) + 2.0 ** -9 * cache.float().abs().max()
        if far.any():
            raise AssertionError(f"{what} is over a bfloat16 step from torch's float32 attention in "
                                 f"{far.sum().item()} elements (by {(out.float() - exact).abs().max().item():.3g})")


def check_row_max(lib) -> None:
    """The greedy pick: torch's max over rows wider than one span of the
    kernel (kernels.c MAX_SPAN) with a tail past the vector width, ties
    (values rounded to bfloat16, the largest repeated in a later span),
    a row of -inf, a row with a NaN; rows read through a stride; in
    float32 and in bfloat16 (the same values: ties stay ties)."""
    gen = torch.Generator().manual_seed(5)
    rows, cols = 6, 40_009
    x = torch.randn(rows, cols + 7, generator=gen).bfloat16().float()[:, :cols]
    x[1, 30_000] = x[1, 123] = x[1].max() + 1  # a tie across spans: the first column wins
    x[2, 17], x[2, 18] = 50.0, 50.0  # a tie inside one vector
    x[3] = float("-inf")
    x[4, 39_999] = float("nan")
    x[5, cols - 1] = 99.0  # the largest in the tail
    expected, at = x.max(dim=-1)
    ordered = ~torch.isnan(expected)
    for dtype in STORAGE:
        typed = x if dtype == torch.float32 else torch.empty(rows, cols + 3, dtype=dtype)[:, :cols].copy_(x)
        values, indices = torch.empty(rows), torch.empty(rows, dtype=torch.int64)
        if lib.row_max(typed.data_ptr(), rows, cols, typed.stride(0), values.data_ptr(), indices.data_ptr(), 2,
                       STORAGE[dtype]) != 0:
            raise AssertionError(f"row_max ({dtype}) failed")
        if not torch.equal(values.nan_to_num(7.0), expected.nan_to_num(7.0)):
            raise AssertionError(f"row_max's values ({dtype}) differ from torch's max")
        if not torch.equal(indices[ordered], at[ordered]):
            raise AssertionError(f"row_max's indices ({dtype}) differ from torch's max")


def check_head_products(lib) -> None:
    """The LM head's product over a tiled weight (head.py) against torch's
    in float32, rounded to bfloat16: every element within one bfloat16
    step (its sums run in another order), widths past the tiles' (k not a
    multiple of 32, n not of 4, so the zero padding is read), one to
    five rows (every count of rows a tile takes at once, and more); more
    rows than it takes are refused. Nothing to check where the CPU has no
    bfloat16 dot product (it refuses, and oneDNN runs the head)."""
    if not lib.native_bf16_products:
        return
    gen = torch.Generator().manual_seed(9)
    n, k = 38, 48
    w = torch.randn(n, k, generator=gen).bfloat16()
    tiled = tiles(w)
    for rows in (1, 2, 3, 4, 5):
        x = torch.randn(rows, k, generator=gen).bfloat16()
        out = torch.full((rows, n), float("nan"), dtype=torch.bfloat16)
        if lib.head_products(x.data_ptr(), rows, k, tiled.data_ptr(), n, out.data_ptr(), 2) != 0:
            raise AssertionError("head_products failed")
        expected = (x.float() @ w.float().t()).bfloat16().float()
        if not ((out.float() - expected).abs() <= _steps(expected)).all():
            raise AssertionError(f"head_products ({rows} rows) is more than one bfloat16 step from torch's product")
    many = torch.zeros(65, k, dtype=torch.bfloat16)
    if lib.head_products(many.data_ptr(), 65, k, tiled.data_ptr(), n, torch.empty(65, n).data_ptr(), 2) != -1:
        raise AssertionError("head_products took more rows than it holds sums for")


def _check_recurrence(what: str, out, states, before, rows, lengths, step) -> None:
    """A C recurrence's outputs `out` [R, L, ...] and states (rows `rows` of
    `states`, which held `before`) against `step(r, t, state) -> (output,
    state)`, the reference's one-token update, token by token; nothing
    written past a request's length, no other row changed."""
    for r in range(out.shape[0]):
        s = before[rows[r]][None]
        for t in range(out.shape[1]):
            if t >= lengths[r]:
                if out[r, t].abs().max() != 0:
                    raise AssertionError(f"{what} wrote past a request's length")
                continue
            o, s = step(r, t, s)
            _close(out[r, t], o[0], f"{what}'s output")
        _close(states[rows[r]], s[0], f"{what}'s state")
    others = sorted(set(range(states.shape[0])) - set(rows.tolist()))
    if not torch.equal(states[others], before[others]):
        raise AssertionError(f"{what} changed a state row it was not given")


def check_gated_delta(lib) -> None:
    """The gated delta rule against the reference's one-token step, token
    by token: three requests of different lengths (padding past them),
    two key heads for four value heads, value heads of 20 channels (a tail
    past the vector width), states at scattered rows of a wider buffer."""
    from ...gated_delta_ops import gated_delta_step

    gen = torch.Generator().manual_seed(6)
    requests, length, key_heads, value_heads, key_dim, value_dim = 3, 5, 2, 4, 16, 20
    q = F.normalize(torch.randn(requests, length, key_heads, key_dim, generator=gen), dim=-1) * key_dim ** -0.5
    k = F.normalize(torch.randn(requests, length, key_heads, key_dim, generator=gen), dim=-1)
    v = torch.randn(requests, length, value_heads, value_dim, generator=gen)
    g = -torch.rand(requests, length, value_heads, generator=gen)
    beta = torch.rand(requests, length, value_heads, generator=gen)
    lengths, rows = torch.tensor([5, 3, 1]), torch.tensor([3, 0, 4])
    size = value_heads * key_dim * value_dim
    flat = torch.randn(5, size + 7, generator=gen)  # rows of a wider buffer, as the gathered states hold them
    states = flat[:, :size].view(5, value_heads, key_dim, value_dim)
    before = states.clone()
    out = torch.zeros(requests, length, value_heads, value_dim)
    if lib.gated_delta(q.data_ptr(), k.data_ptr(), v.data_ptr(), g.data_ptr(), beta.data_ptr(), lengths.data_ptr(),
                       requests, length, key_heads, value_heads, key_dim, value_dim, flat.data_ptr(),
                       rows.data_ptr(), flat.stride(0), out.data_ptr(), 1) != 0:
        raise AssertionError("gated_delta failed")
    _check_recurrence("gated_delta", out, states, before, rows, lengths, lambda r, t, s: gated_delta_step(
        q[r, t][None], k[r, t][None], v[r, t][None], g[r, t][None], beta[r, t][None], s))


def check_ssd(lib) -> None:
    """Mamba-2's state update against the reference's one-token step, token
    by token: three requests of different lengths, four heads in two
    groups, head channels of 5 and a state of 20 (tails past the vector
    width), states at scattered rows of a wider buffer."""
    from ...ssd_ops import ssd_step

    gen = torch.Generator().manual_seed(7)
    requests, length, heads, head_dim, groups, state_size = 3, 5, 4, 5, 2, 20
    x = torch.randn(requests, length, heads, head_dim, generator=gen)
    dt = torch.rand(requests, length, heads, generator=gen) + 0.1
    A = -torch.rand(heads, generator=gen) - 0.1
    B = torch.randn(requests, length, groups, state_size, generator=gen)
    C = torch.randn(requests, length, groups, state_size, generator=gen)
    D = torch.randn(heads, generator=gen)
    lengths, rows = torch.tensor([5, 3, 1]), torch.tensor([3, 0, 4])
    size = heads * head_dim * state_size
    flat = torch.randn(5, size + 3, generator=gen)
    states = flat[:, :size].view(5, heads, head_dim, state_size)
    before = states.clone()
    y = torch.zeros(requests, length, heads, head_dim)
    lib.ssd(x.data_ptr(), dt.data_ptr(), A.data_ptr(), B.data_ptr(), C.data_ptr(), D.data_ptr(), lengths.data_ptr(),
            requests, length, heads, head_dim, groups, state_size, flat.data_ptr(), rows.data_ptr(), flat.stride(0),
            y.data_ptr(), 1)
    _check_recurrence("ssd", y, states, before, rows, lengths, lambda r, t, s: ssd_step(
        x[r, t][None], dt[r, t][None], A, B[r, t][None], C[r, t][None], D, s))


def check(lib) -> None:
    """Every exported function of the library against torch."""
    with torch.inference_mode():
        check_decode_attention(lib)
        check_norm_rotary(lib)
        check_gated_activation(lib)
        check_decode_layer(lib)
        check_rotate_rows(lib)
        check_masked_softmax(lib)
        check_prefill_attention(lib)
        check_row_max(lib)
        check_head_products(lib)
        check_gated_delta(lib)
        check_ssd(lib)
