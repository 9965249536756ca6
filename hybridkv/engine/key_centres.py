"""Keys less their layer's centre over int8 pages (layers/kv_quant.py
`KeyCentre`): which layers, the calibration prompt that measures the
centres, and what the cache's identity says of them.

An engine whose attention pages hold int8 codes measures each centrable
layer's centre once, before it serves anything: one prompt of
`CALIBRATION_TEXT` (or, for a model without a tokenizer, a fixed walk over
its vocabulary) runs through the engine's own step on a KV cache manager
of its own, which is then dropped, so that nothing of it stays (no cached
block, no event, no counted token). Every tensor-parallel rank runs the
same steps and measures its own heads.

The centres are a function of the weights, their dtype and the
calibration tokens, all of which the cache's identity holds (the tokens by
their digest), so a tier written with other centres is never read.
Machines whose float32 keys differ in the last bits agree on the centres
almost always (they are rounded to bfloat16); where they do not, the
difference is of the size the keys' own last bits already make.
"""

from __future__ import annotations

import hashlib

from ..core.layout import KVCacheLayout
from ..layers.kv_quant import KeyCentre
from ..modeling.sublayers import PagedSelfAttention

# At most this many calibration tokens: a mean over ~500 keys of varied
# text moves less between texts than int8's rounding step.
CALIBRATION_TOKENS = 512

# Varied on purpose (prose, a list, numbers, code, markup) and in no
# benchmark's or test's evaluation text.
CALIBRATION_TEXT = """\
Field notes from a week at the coastal weather station.

Monday. The wind came round to the north-west before dawn and the barometer rose four hectopascals by \
noon. We replaced the cracked louvre on the Stevenson screen, logged the maximum at 14.2 degrees and \
the minimum at 6.9, and found two gannets sheltering behind the generator shed.

Tuesday. Fog until eleven. Readings every hour: 1012.4, 1012.9, 1013.3, 1013.1 hPa; visibility under \
two hundred metres until the sun burned through. The new rain gauge over-reads by about three percent \
against the old funnel, so both stay in service until the end of the month.

Things to order before the supply boat on Friday:
- two spare anemometer cups and a bearing kit;
- batteries (twelve of the large cells, six of the small);
- coffee, oats, tinned tomatoes, lentils, and a new kettle.

The logger's export script, kept here so that the next crew can rebuild it:

    def daily_summary(rows):
        temps = [r["temp_c"] for r in rows if r["temp_c"] is not None]
        return {"min": min(temps), "max": max(temps), "mean": sum(temps) / len(temps),
                "rain_mm": round(sum(r.get("rain_mm", 0.0) for r in rows), 1)}

<entry date="2026-03-18" station="CWS-04"><wind dir="NW" speed_kn="23"/><note>Gusts to 41 knots at \
16:40; the mast held.</note></entry>

Thursday. A quiet day at last. The seals were back on the south rocks, eleven of them, and a trawler \
worked the bank all afternoon. Questions for the office: why does the humidity sensor drift after \
rain, and can we move the upload window from 06:00 to 05:30 UTC so that the forecasters see the night's \
data before their first meeting? If the answer to the second is no, we will keep the old schedule.
"""


# The page dtypes whose keys are centred: int8, whose error is set by each
# row's scale. float8's error is relative to each element, and centred
# float8 keys measured no better on the real Gemma-3 270M (e4m3 95.99%
# top-1 against 96.27%, e5m2 92.08% against 92.18%), so they stay as they
# are, as they stay unrotated.
CENTRED_DTYPES = ("int8",)


def centrable_layers(model, layout: KVCacheLayout) -> list[str]:
    """The attention layers whose keys are stored less their centre: int8
    pages, and nothing but softmax reading the scores."""
    names = []
    for name, module in model.cache_layers().items():
        view = layout.layer_views.get(name)
        if isinstance(module, PagedSelfAttention) and view is not None and \
                layout.groups[view.group].spec.dtype in CENTRED_DTYPES and module.centrable:
            names.append(name)
    return names


def bind_key_centres(model, layout: KVCacheLayout, device) -> list[KeyCentre]:
    """A zero centre on each centrable layer (`centrable_layers`)."""
    layers = model.cache_layers()
    centres = []
    for name in centrable_layers(model, layout):
        module = layers[name]
        module.key_centre = KeyCentre(module.num_kv_heads, module.head_dim, device)
        centres.append(module.key_centre)
    return centres


def calibration_ids(tokenizer, vocab_size: int, fits) -> list[int]:
    """The calibration prompt: CALIBRATION_TEXT's tokens (the model's BOS
    first where its tokenizer adds one), or a fixed walk over the
    vocabulary for a model without a tokenizer; at most CALIBRATION_TOKENS,
    and no longer than the engine can run (`fits(length)`: a prompt of that
    many tokens and its one new token fit the context and the pool)."""
    if tokenizer is not None:
        ids = list(tokenizer.encode(CALIBRATION_TEXT))[:CALIBRATION_TOKENS]
    else:  # a stride coprime to any vocabulary size that is no multiple of 7919
        ids = [(17 + 7919 * i) % vocab_size for i in range(CALIBRATION_TOKENS)]
    length = len(ids)
    while length > 1 and not fits(length):
        length //= 2
    return ids[:length]


def identity_note(ids: list[int]) -> str:
    """What the cache's identity holds of the centres (empty: none)."""
    if not ids:
        return ""
    digest = hashlib.sha256(",".join(map(str, ids)).encode()).hexdigest()[:32]
    return f"keys less their layer's centre over calibration tokens {digest}"
