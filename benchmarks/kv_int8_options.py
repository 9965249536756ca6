"""What an int8 page would have to hold to keep the argmax: variants of
the int8 K/V format, each simulated where the reference stores K and V
(the rows rounded as that variant's pages would hold them, then kept in
float32 pages), on the real Gemma-3 270M in float32, teacher-forced over
the texts of benchmarks/kv_dtypes.py, against float32 pages: top-1
agreement and perplexity, as in kv_dtypes' accuracy table.

Variants (V rows as the format stores them unless named):
* bfloat16 pages, for reference;
* int8 per row, keys as they are: K and V rows rotated (Hadamard), one
  scale per token and head; the same not rotated;
* a scale per 64 or per 32 elements of a rotated row (4 or 8 per row at
  Gemma-3's 256-wide heads: 12 or 28 more bytes a row);
* K less a constant per layer and head before quantizing (its mean key
  over the engine's calibration prompt, engine/key_centres.py, rounded to
  bfloat16: the format, docs/kv_dtypes.md): a query's scores all move by
  the same amount, which softmax ignores where there is no softcap or sink;
* K less its block's first key, that key kept in bfloat16 in the page (one
  row per block: 6% more bytes at 16-token blocks);
* int8 K alone, int8 V alone.

    python -m benchmarks.kv_int8_options           # ~15 min on 2 cores
    python -m benchmarks.kv_int8_options --quick   # CI smoke run: the tiny random model
"""

from __future__ import annotations

import contextlib
import math
import time

from benchmarks import harness

VARIANTS = ("bfloat16 pages", "int8 per row, keys as they are", "int8 per row, not rotated", "int8, a scale per 64",
            "int8, a scale per 32", "int8, K less a constant per layer (the format)",
            "int8, K less its block's first key", "int8 K only", "int8 V only")


def rounded(x, group: int, rotate: bool):
    """x [..., dim] as int8 pages with a scale per `group` elements would
    hold it (rotated first where `rotate`), back in float32."""
    import torch

    from hybridkv.layers.kv_quant import dequantize, quantize, rotation

    x = x.float()
    h = rotation(torch.int8, x.shape[-1], x.device) if rotate else None
    y = x @ h if h is not None else x
    group = min(group, y.shape[-1])  # (the tiny model's heads are narrower than a group)
    # each group quantized as the format quantizes a row (kv_quant.quantize)
    parts = y.reshape(*y.shape[:-1], y.shape[-1] // group, group)
    back = dequantize(*quantize(parts, torch.int8), torch.float32).reshape(y.shape)
    return back @ h if h is not None else back


class Variant:
    """Rounds the K/V rows each store writes, as variant `name` would."""

    def __init__(self, name: str):
        self.name = name
        self.layer = None  # the attention layer storing now
        self.means: dict = {}  # layer -> [tokens, sum of keys] (while measuring)
        self.firsts: dict = {}  # (layer, page) -> the block's first key, in bfloat16

    def store_rows(self, k, v, meta, column):
        import torch

        name = self.name
        if name == "measure":
            seen = self.means.setdefault(self.layer, [0, 0.0])
            seen[0], seen[1] = seen[0] + k.shape[0], seen[1] + k.float().sum(0)
            return k, v
        if name == "bfloat16 pages":
            return k.bfloat16().to(k.dtype), v.bfloat16().to(v.dtype)
        row = {"int8, a scale per 64": 64, "int8, a scale per 32": 32}.get(name, k.shape[-1])
        rotate = name != "int8 per row, not rotated"
        new_v = v if name == "int8 K only" else rounded(v, row, rotate).to(v.dtype)
        if name == "int8 V only":
            return k, new_v
        if name == "int8, K less a constant per layer (the format)":
            tokens, total = self.means[self.layer]
            offset = (total.double() / tokens).to(torch.bfloat16).float().unsqueeze(0)  # as kv_quant.KeyCentre
            return (rounded(k - offset, row, rotate) + offset).to(k.dtype), new_v
        if name == "int8, K less its block's first key":
            pages, slots = meta.store_pages[column].tolist(), meta.store_offsets.tolist()
            offsets = []
            for i, (page, slot) in enumerate(zip(pages, slots)):
                if slot == 0:
                    self.firsts[self.layer, page] = k[i].float().bfloat16().float()
                offsets.append(self.firsts[self.layer, page])
            offset = torch.stack(offsets)
            return (rounded(k - offset, row, rotate) + offset).to(k.dtype), new_v
        return rounded(k, row, rotate).to(k.dtype), new_v


@contextlib.contextmanager
def rounding(variant: Variant):
    """The reference's store and the attention layers, patched to round
    each K/V row as `variant` would before it is stored."""
    from hybridkv.layers.backends.reference import attention
    from hybridkv.modeling.sublayers import PagedSelfAttention

    store, attend = attention.store, PagedSelfAttention.attend

    def rounded_store(cache, k, v, meta, column):
        return store(cache, *variant.store_rows(k, v, meta, column), meta, column)

    def named_attend(self, *args, **kw):
        variant.layer = self.layer_name
        return attend(self, *args, **kw)
    attention.store, PagedSelfAttention.attend = rounded_store, named_attend
    try:
        yield
    finally:
        attention.store, PagedSelfAttention.attend = store, attend


def teacher_forced(engine, prompts) -> tuple[list[int], list[float]]:
    from hybridkv import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1)
    top, logprobs = [], []
    for prompt, out in zip(prompts, engine.generate(prompts, params, use_tqdm=False)):
        for position, entry in enumerate(out.prompt_logprobs[1:], 1):
            top.append(list(entry)[-1])
            logprobs.append(entry[prompt[position]])
    return top, logprobs


def arguments(parser) -> None:
    pass


def run(args) -> dict:
    from hybridkv import Engine

    if args.quick:
        from hybridkv.tiny_models import tiny_model_dir

        model = tiny_model_dir("tiny-gemma3")
        prompts = [[(5 * i + 11 * j) % 200 + 3 for j in range(80)] for i in range(2)]
        calibration = [[(3 * j) % 190 + 5 for j in range(80)]]
    else:
        from benchmarks.kv_dtypes import PROMPT_TOKENS, texts
        from benchmarks.real_gemma3 import gguf_path, tokenizer
        from hybridkv.engine.key_centres import CALIBRATION_TEXT, CALIBRATION_TOKENS

        model, tok = gguf_path(), tokenizer()
        prompts = [[2] + tok.encode(t, add_special_tokens=False)[:PROMPT_TOKENS - 1] for t in texts()]
        # the constant offsets' text: the engine's calibration prompt (outside the evaluation's texts)
        calibration = [tok.encode(CALIBRATION_TEXT)[:CALIBRATION_TOKENS]]
    # the reference backend: every store goes through the patched function
    engine = Engine(model, dtype="float32", backend="torch", kv_cache_memory="256MiB", max_num_batched_tokens=512,
                    progress=False, enable_prefix_caching=False)
    base_top, base_logprobs = teacher_forced(engine, prompts)
    base = math.exp(-sum(base_logprobs) / len(base_logprobs))
    measured = Variant("measure")
    with rounding(measured):
        teacher_forced(engine, calibration)
    rows = []
    print(f"Teacher-forced over {len(base_top):,} positions; float32 pages: perplexity {base:.4f}")
    for name in VARIANTS:
        variant = Variant(name)
        variant.means = measured.means
        start = time.perf_counter()
        with rounding(variant):
            top, logprobs = teacher_forced(engine, prompts)
        agree = sum(a == b for a, b in zip(top, base_top)) / len(top)
        perplexity = math.exp(-sum(logprobs) / len(logprobs))
        rows.append({"variant": name, "positions": len(top), "top1_agreement": agree, "perplexity": perplexity,
                     "perplexity_change": perplexity / base - 1.0})
        print(f"  {name:<36} top-1 {100 * agree:6.2f}%  perplexity {perplexity:.4f} ({perplexity / base - 1:+.2%})"
              f"  {time.perf_counter() - start:.0f} s", flush=True)
    return {"rows": rows}


if __name__ == "__main__":
    harness.main(run, arguments, repeat=1)
