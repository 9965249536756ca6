"""Layout planning: from per-layer specs and a byte budget to KV cache
groups, one page size and the views each layer takes of the pool.

The rule (docs/architecture.md, "Layout") in short:

* Layers with the same spec form one group (one block table per request).
* The pool is `num_pages` pages of `page_size_bytes`. A group's block covers
  `block_size` tokens of every layer in the group (or one recurrent state
  for a Mamba group) and spans `pages_per_block` whole pages.
* The page size is the largest size that divides every attention group's
  block exactly and holds whole per-layer blocks, so attention blocks keep
  `block_size` tokens whatever the layer counts are (Gemma-3-27B: 52 sliding
  + 10 full layers -> pages of 2 layers, blocks of 26 and 5 pages) and no
  padding layer is ever allocated. A Mamba state is rounded up to whole
  pages; the page is chosen small enough that this rounding stays under
  `MAX_STATE_ROUNDING` of a state.

Every page can serve every group, so one LRU queue and one free count cover
the whole pool, and no type can starve while another holds idle pages.
"""

from __future__ import annotations

import itertools
import math
import warnings
from dataclasses import asdict, dataclass
from functools import reduce

from .specs import ATTENTION_KINDS, SPEC_TYPES, AttentionSpec, LayerSpec, RecurrentSpec

# A Mamba state is rounded up to whole pages; pick pages small enough that
# the rounding costs at most this fraction of the state.
MAX_STATE_ROUNDING = 0.005
# Byte alignment of every tensor part inside a page (vector loads, dtype views).
ALIGN = 16


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


@dataclass(frozen=True)
class KVCacheGroup:
    """Layers that share one block table per request."""

    index: int
    spec: LayerSpec
    layer_names: tuple[str, ...]
    block_size: int
    pages_per_block: int
    # Bytes of one block that layers use (the rest of its pages is rounding).
    block_bytes: int
    # Attention: bytes of one layer's block; Mamba: padded bytes of one layer's state.
    layer_bytes: int
    # Attention: 0, each layer's block whole in one page; else the group's
    # KV heads packed this many to a page, layer after layer, so that a
    # layer's block is cut by heads where a page ends (a page of least
    # rounding between groups of different dtypes need not hold whole
    # layer blocks: LayerView.runs).
    heads_per_page: int = 0
    # Quantized, heads packed: True where the group's scales lie in pages
    # of their own, the block's last ones, after every layer's codes (each
    # piece's scales in one page: LayerView.scale_runs), so that pages
    # sized to 16-bit heads split the codes exactly (a code head is half a
    # bfloat16 one; codes with their scales fit no power of two).
    scales_apart: bool = False

    @property
    def kind(self) -> str:
        return self.spec.kind

    @property
    def recurrent(self) -> bool:
        """One state per request (a recurrent layer of any kind), not a
        block table over positions."""
        return self.spec.recurrent

    @property
    def num_layers(self) -> int:
        return len(self.layer_names)

    @property
    def head_bytes(self) -> int:
        """Attention: bytes of one KV head's share of a layer's block."""
        return self.layer_bytes // self.spec.num_kv_heads

    @property
    def code_head_bytes(self) -> int:
        """Attention: bytes of one KV head's K/V elements in a layer's
        block (a quantized layer's codes, without their scales)."""
        return self.spec.code_bytes(self.block_size) // self.spec.num_kv_heads


@dataclass(frozen=True)
class LayerView:
    """Where one layer's cache lives inside a block of its group.

    Attention: the layer's K/V rows for a block are `layer_bytes` bytes at
    byte `offset` of page `column` of the block (never straddling pages).
    Where its group packs heads (`heads_per_page`), `runs` holds the block
    in pieces instead, in head order: (column, offset, heads), each piece
    laid out as a block of that many heads, whole in one page (`column`
    and `offset` are the first's).
    Where its group keeps scales apart (`scales_apart`), the runs hold the
    codes and `scale_runs` the (column, offset) of each piece's scales,
    `[2, block_size, heads]` float32 in one page.
    Mamba: the layer's state parts start at byte `offset` of the block's
    pages taken as one byte string (a state may straddle pages);
    `part_offsets` are relative to `offset`.
    """

    layer_name: str
    group: int
    column: int
    offset: int
    part_offsets: tuple[int, ...] = ()
    runs: tuple[tuple[int, int, int], ...] = ()
    scale_runs: tuple[tuple[int, int], ...] = ()

    @property
    def places(self) -> tuple[tuple[int, int, int], ...]:
        """(column, offset, heads) of each piece of the layer's block, first
        heads first; heads 0: the whole block, in one piece."""
        return self.runs or ((self.column, self.offset, 0),)


@dataclass(frozen=True)
class KVCacheLayout:
    groups: tuple[KVCacheGroup, ...]
    page_size_bytes: int
    num_pages: int
    block_size: int
    memory_bytes: int
    layer_views: dict[str, LayerView]
    block_size_why: str = "asked for"  # the planner's reason where it chose (default_block_size)

    @property
    def num_blocks(self) -> int:
        """Deprecated name of `num_pages` (it counts pages, the null page included)."""
        warnings.warn("KVCacheLayout.num_blocks is deprecated: use num_pages", DeprecationWarning, stacklevel=2)
        return self.num_pages

    @property
    def pool_bytes(self) -> int:
        return self.num_pages * self.page_size_bytes

    @property
    def static_waste_bytes(self) -> int:
        """Budget bytes no layer can ever use: the remainder under one page and
        the reserved null page."""
        return self.memory_bytes - self.pool_bytes + self.page_size_bytes

    def group_rounding_bytes(self, group: KVCacheGroup) -> int:
        """Bytes of each block of this group that its layers leave unused."""
        return group.pages_per_block * self.page_size_bytes - group.block_bytes

    def pages_per_request(self, num_tokens: int, chunk: int = 1) -> int:
        """Pages one request holds at `num_tokens` tokens, computing `chunk`
        tokens per step (no prefix sharing, no checkpoints)."""
        return sum(_blocks_held(g, num_tokens, chunk) * g.pages_per_block for g in self.groups)

    def hit_bytes(self, num_tokens: int) -> int:
        """Bytes of the blocks a hit of `num_tokens` tokens (whole blocks)
        reads, by each group's rule (the next query is at position
        `num_tokens`): every block of full attention, the blocks from the
        first key a window or chunk still sees, one state per recurrent
        group. What prefill/decode on different engines ships per prompt
        (KVCacheManager.blocks_for_hit gives the blocks themselves)."""
        blocks = num_tokens // self.block_size
        total = 0
        for g in self.groups:
            count = min(1, blocks) if g.recurrent else blocks - g.spec.first_visible(num_tokens) // self.block_size
            total += count * g.pages_per_block * self.page_size_bytes
        return total

    def all_layers_bytes(self, num_tokens: int) -> int:
        """Bytes of a prefix of `num_tokens` tokens (whole blocks) with every
        layer's cache at every position and one state per recurrent layer,
        in this layout's pages: what shipping a prompt whole takes, against
        which shipping only what its hit reads (blocks_for_hit) is measured."""
        blocks = -(-num_tokens // self.block_size)
        return sum((1 if g.recurrent else blocks) * g.pages_per_block * self.page_size_bytes for g in self.groups)

    def max_requests(self, num_tokens: int, chunk: int = 1) -> int:
        return (self.num_pages - 1) // max(1, self.pages_per_request(num_tokens, chunk))

    def to_dict(self) -> dict:
        """The layout as plain JSON-able data (`from_dict` reads it back):
        what a process without the model needs to apply its hit rule, e.g.
        a router holding a PrefixIndex of KV events from the wire."""
        out = asdict(self)
        for data, group in zip(out["groups"], self.groups):
            data["spec"]["kind"] = group.kind
        return out

    @classmethod
    def from_dict(cls, data: dict) -> "KVCacheLayout":
        def spec(fields: dict) -> LayerSpec:
            fields = dict(fields)
            kind = fields.pop("kind")
            if kind not in SPEC_TYPES:
                raise ValueError(f"unknown layer kind {kind!r} in a layout; expected one of {sorted(SPEC_TYPES)}")
            if SPEC_TYPES[kind] is RecurrentSpec:
                fields["kind"] = kind  # a field of the spec, not only its class
            return SPEC_TYPES[kind](**fields)

        groups = tuple(KVCacheGroup(**{**g, "spec": spec(g["spec"]), "layer_names": tuple(g["layer_names"])})
                       for g in data["groups"])
        views = {name: LayerView(**{**v, "part_offsets": tuple(v["part_offsets"]),
                                    "runs": tuple(tuple(p) for p in v.get("runs", ())),
                                    "scale_runs": tuple(tuple(p) for p in v.get("scale_runs", ()))})
                 for name, v in data["layer_views"].items()}
        return cls(groups, data["page_size_bytes"], data["num_pages"], data["block_size"], data["memory_bytes"],
                   views)

    def describe(self) -> str:
        lines = [
            f"page size {self.page_size_bytes:,} B x {self.num_pages:,} pages "
            f"({self.pool_bytes / 2**30:.2f} GiB of {self.memory_bytes / 2**30:.2f} GiB); "
            f"block size {self.block_size} tokens ({self.block_size_why})"
        ]
        for g in self.groups:
            shares = f" (KV heads {g.heads_per_page} to a page{', scales apart' if g.scales_apart else ''})" \
                if g.heads_per_page else ""
            lines.append(
                f"  group {g.index}: {g.kind:<14} {_spec_brief(g.spec):<42} {g.num_layers:3d} layers{shares}, "
                f"{g.pages_per_block} page(s)/block, rounding {self.group_rounding_bytes(g):,} B/block"
            )
        return "\n".join(lines)


def _spec_brief(spec: LayerSpec) -> str:
    if spec.recurrent:
        return f"state {spec.state_bytes:,} B ({'/'.join(dict.fromkeys(spec.dtypes))})"
    extra = ""
    if spec.kind == "sliding_window":
        extra = f" W={spec.sliding_window}"
    elif spec.kind == "chunked_local":
        extra = f" C={spec.chunk_size}"
    return f"{spec.num_kv_heads}x{spec.head_size} {spec.dtype}{extra} {spec.bytes_per_token:,} B/token"


def _blocks_held(group: KVCacheGroup, num_tokens: int, chunk: int) -> int:
    """At most this many blocks of a request at once: a Mamba group one
    state; an attention group the blocks covering what the next queries
    read (at most span - 1 earlier keys) and the `chunk` tokens being
    computed, a range that may straddle one more block boundary."""
    if group.recurrent:
        return 1  # one live recurrent state
    return _attention_blocks_held(group.spec, group.block_size, num_tokens, chunk)


def _attention_blocks_held(spec: AttentionSpec, block_size: int, num_tokens: int, chunk: int) -> int:
    all_blocks = -(-num_tokens // block_size)
    span = spec.span
    return all_blocks if span is None else min(all_blocks, -(-(span - 1 + chunk) // block_size) + 1)


def _mamba_layer_layout(spec: RecurrentSpec) -> tuple[int, tuple[int, ...]]:
    """Padded bytes of one layer's state and the offsets of its parts."""
    offsets, pos = [], 0
    for nbytes in spec.part_bytes:
        offsets.append(pos)
        pos += _round_up(nbytes, ALIGN)
    return pos, tuple(offsets)


# Pages tried where no page splits every attention group's block exactly:
# up to this many times the largest layer block.
MAX_PAGE_MULTIPLE = 64
# Where a group's heads are packed (KVCacheGroup.heads_per_page), a page
# holds at least 1/this of a layer's heads (rounded up): a layer then lies
# in at most this many pieces, plus one (each one more attention call per
# layer and step).
MAX_PIECES = 4
# Packing heads is taken only where it rounds at least this much less:
# within it of the least rounding, the fewest packed groups (and calls).
PACKING_SLACK = 0.005
# Request lengths (tokens) at which such a page is judged: what a request
# holds there in pages against its blocks' exact bytes.
JUDGED_LENGTHS = (1024, 4096, 32768)


def _least_rounding_page(pieces: list[tuple[int, int, tuple[int, ...]]], state_bytes: list[int],
                         smallest: int = 0) -> tuple[float, int]:
    """(rounding, page) for the page whose rounding costs requests least,
    `pieces` being each attention group's (bytes of one piece, pieces in
    its block, blocks a request holds at each of JUDGED_LENGTHS), pieces
    never straddling a page; rounding: the largest, over those lengths, of
    a request's pages over its blocks' exact bytes (its capacity lost),
    recurrent states held once. For pieces of sizes no page splits all
    exactly (attention pages of different dtypes: a quantized layer's block
    holds its scales beside its codes, so its size is no power of two; a
    bfloat16 one is). Candidates: multiples of each piece size that hold
    the largest and `smallest` bytes, up to MAX_PAGE_MULTIPLE times the
    largest; on a tie the smaller page."""
    biggest = max(size for size, _, _ in pieces)
    least = max(biggest, smallest)
    candidates = {size * m for size, _, _ in pieces for m in range(1, MAX_PAGE_MULTIPLE * biggest // size + 1)
                  if size * m >= least}
    exact = [sum(held[i] * size * count for size, count, held in pieces) + sum(state_bytes)
             for i in range(len(JUDGED_LENGTHS))]

    def rounding(page: int) -> float:
        states = sum(_round_up(s, page) for s in state_bytes)
        return max((sum(held[i] * -(-count // (page // size)) for size, count, held in pieces) * page + states) / e
                   for i, e in enumerate(exact))

    return min((rounding(p), p) for p in candidates)


# How a group's blocks lie in pages (_packed_heads_page): whole layers; KV
# heads packed; KV heads packed, a quantized group's codes in pages apart
# from its scales.
WHOLE, PACKED, SCALES_APART = 0, 1, 2


def _modes(spec: AttentionSpec, block_size: int) -> list[int]:
    """The ways this group's blocks may lie in pages: heads packed where
    each head's share keeps ALIGN; scales apart where codes and scales
    each do too."""
    heads = spec.num_kv_heads
    modes = [WHOLE]
    if heads > 1 and spec.block_bytes(block_size) // heads % ALIGN == 0:
        modes.append(PACKED)
    codes = spec.code_bytes(block_size) // heads
    if spec.quantized and codes % ALIGN == 0 and (spec.block_bytes(block_size) // heads - codes) % ALIGN == 0:
        modes.append(SCALES_APART)
    return modes


def _pieces(spec: AttentionSpec, layers: int, block_size: int, mode: int) -> list[tuple[int, int]]:
    """(bytes of one piece, pieces in the group's block) of each kind of
    piece a group's blocks hold in `mode`, none straddling a page."""
    heads, block = spec.num_kv_heads, spec.block_bytes(block_size)
    if mode == WHOLE:
        return [(block, layers)]
    if mode == PACKED:
        return [(block // heads, layers * heads)]
    codes = spec.code_bytes(block_size) // heads
    return [(codes, layers * heads), (block // heads - codes, layers * heads)]


def _packed_heads_page(attn: list[tuple[AttentionSpec, int, int]], state_bytes: list[int]) -> tuple[int, list[int]]:
    """(page, how each attention group's blocks lie: WHOLE, PACKED or
    SCALES_APART) of least rounding (_least_rounding_page), for attention
    groups `attn` (spec, layers, block size) whose blocks no page splits
    exactly. Packing a group's KV heads lets a page sized to another
    group's blocks hold its layers with little left over, a layer cut
    where a page ends (Gemma-3-4B, int8 full layers beside bfloat16
    sliding ones: pages of one int8 layer, each holding half a sliding
    layer's heads, round 1.5% of a sliding block and none of a full one,
    where pages of whole layers round a fifth of every full block;
    Gemma-2-27B: 31 heads of its int8 full layers to a page of one
    bfloat16 sliding layer round 0.3%, whole layers 2-3%). Scales apart
    round less where the codes alone split such a page (gpt-oss-20b, int8
    full layers beside bfloat16 sliding ones, 64-wide heads: pages of
    three sliding heads, six int8 heads' codes or 96 heads' scales, none
    left over, where codes with their scales round 6% of a sliding
    block). Within PACKING_SLACK of the least rounding, the fewest packed
    groups (scales apart counting two)."""
    options = [_modes(spec, bs) for spec, _, bs in attn]
    held = [tuple(_attention_blocks_held(spec, block_size, n, 1) for n in JUDGED_LENGTHS)
            for spec, _, block_size in attn]
    tried = []  # (cost, rounding, page, mode per group)
    for modes in itertools.product(*options):
        pieces = [(size, count, h) for (spec, layers, bs), mode, h in zip(attn, modes, held)
                  for size, count in _pieces(spec, layers, bs, mode)]
        smallest = max((-(-spec.num_kv_heads // MAX_PIECES) * _pieces(spec, 1, bs, mode)[0][0]
                        for (spec, _, bs), mode in zip(attn, modes) if mode != WHOLE), default=0)
        rounding, page = _least_rounding_page(pieces, state_bytes, smallest)
        tried.append((sum(modes), rounding, page, list(modes)))
    least = min(rounding for _, rounding, _, _ in tried)
    _, _, page, modes = min(t for t in tried if t[1] <= least + PACKING_SLACK)
    return page, modes


def _choose_page_size(attn: list[tuple[AttentionSpec, int, int]], state_bytes: list[int]) -> tuple[int, list[int]]:
    """(page, how each attention group's blocks lie: _packed_heads_page):
    the largest page that splits attention blocks exactly into whole
    per-layer blocks and rounds each recurrent state by at most
    MAX_STATE_ROUNDING; where none splits them exactly, the page of least
    rounding, a group's heads packed (its scales apart) where that rounds
    less. `attn`: per attention group, (spec, layers, block size)."""

    def rounding_ok(page: int) -> bool:
        return all(_round_up(s, page) - s <= MAX_STATE_ROUNDING * s for s in state_bytes)

    whole_layers = [WHOLE] * len(attn)
    if attn:
        unit = reduce(math.lcm, [spec.block_bytes(bs) for spec, _, bs in attn])
        whole = reduce(math.gcd, [spec.block_bytes(bs) * layers for spec, layers, bs in attn])
        if whole % unit:
            return _packed_heads_page(attn, state_bytes)
        quotient = whole // unit
        pages = [unit * d for d in range(quotient, 0, -1) if quotient % d == 0]
        for page in pages:
            if rounding_ok(page):
                return page, whole_layers
        # States too small for the threshold (tiny test models): least rounding.
        return min(pages, key=lambda p: (sum(_round_up(s, p) - s for s in state_bytes), -p)), whole_layers
    # Recurrent layers only: a page per state if possible, else a fraction.
    biggest = max(state_bytes)
    for parts in range(1, 4097):
        page = _round_up(-(-biggest // parts), ALIGN)
        if rounding_ok(page):
            return page, whole_layers
    return ALIGN, whole_layers


def _pack_heads(spec: AttentionSpec, names: list[str], block_size: int, page: int, scales_apart: bool,
                index: int, views: dict) -> tuple[int, int]:
    """Views of a group whose KV heads are packed (`heads_per_page`), its
    layers' heads one stream cut where a page ends; with `scales_apart`
    the codes so and the scales in pages after them, a piece cut where
    either page ends. Returns (heads per page, pages per block)."""
    heads = spec.num_kv_heads
    total = len(names) * heads
    block_head = spec.block_bytes(block_size) // heads
    head = spec.code_bytes(block_size) // heads if scales_apart else block_head
    per_page = page // head
    code_pages = -(-total // per_page)
    scale_head = block_head - head
    scales_per_page = page // scale_head if scales_apart else 0
    ends = set(range(per_page, total, per_page)) | set(range(heads, total, heads))
    if scales_apart:
        ends |= set(range(scales_per_page, total, scales_per_page))
    cuts = sorted(ends | {0, total})
    for i, name in enumerate(names):
        runs, scale_runs = [], []
        for first, end in zip(cuts, cuts[1:]):
            if i * heads <= first < (i + 1) * heads:
                column, slot = divmod(first, per_page)
                runs.append((column, slot * head, end - first))
                if scales_apart:
                    column, slot = divmod(first, scales_per_page)
                    scale_runs.append((code_pages + column, slot * scale_head))
        views[name] = LayerView(name, index, runs[0][0], runs[0][1], runs=tuple(runs), scale_runs=tuple(scale_runs))
    scale_pages = -(-total // scales_per_page) if scales_apart else 0
    return per_page, code_pages + scale_pages


def parse_memory(value: int | float | str) -> int:
    """'4GiB', '512MiB', '2GB', 1 << 30 -> bytes."""
    if isinstance(value, bool):
        raise ValueError(f"memory size must be a number of bytes or a string like '4GiB', got {value!r}")
    if isinstance(value, (int, float)):
        if value <= 0:
            raise ValueError(f"memory size must be positive, got {value!r}")
        return int(value)
    text = str(value).strip().lower().replace(" ", "")
    units = {"tib": 2**40, "gib": 2**30, "mib": 2**20, "kib": 2**10,
             "tb": 10**12, "gb": 10**9, "mb": 10**6, "kb": 10**3, "b": 1}
    for suffix, scale in units.items():
        if text.endswith(suffix):
            number = text[: -len(suffix)]
            break
    else:
        number, scale = text, 1
    try:
        result = int(float(number) * scale)
    except ValueError:
        raise ValueError(f"cannot read memory size {value!r}; use e.g. '4GiB', '512MiB' or a byte count") from None
    if result <= 0:
        raise ValueError(f"memory size must be positive, got {value!r}")
    return result


# Tokens per block where none is asked for (default_block_size).
ATTENTION_BLOCK_SIZE = 16
RECURRENT_HYBRID_BLOCK_SIZE = 64


def default_block_size(specs: dict[str, LayerSpec]) -> tuple[int, str]:
    """(the block size of a model whose user asks for none, why).

    Attention only: 16 tokens, the field's usual block, fine-grained hits.
    With recurrent layers, a block is also a checkpoint candidate and every
    block of a prompt is hashed, looked up and tabled at admission, while a
    hit there still needs a whole recurrent state: 64-token blocks take a
    quarter of 16's per-block work, and measured on Qwen3-Next and
    Nemotron-H (benchmarks/manager_overhead.py) they turn admission from
    0.76-1.11x vLLM's (its 1,040-1,056-token blocks) to 1.15-1.89x, with
    hits still 16x finer than vLLM's."""
    if any(getattr(spec, "recurrent", False) for spec in specs.values()):
        return RECURRENT_HYBRID_BLOCK_SIZE, ("the default with recurrent layers: a quarter of 16-token blocks' "
                                             "hashing and lookups at admission, where a hit needs a whole "
                                             "recurrent state anyway")
    return ATTENTION_BLOCK_SIZE, "the default for attention-only models"


def plan_layout(
    specs: dict[str, LayerSpec],
    memory_bytes: int | str,
    block_size: int | None = None,
) -> KVCacheLayout:
    """Group the layers, choose the page size and split the budget into
    pages. `block_size` None: the planner's choice (default_block_size)."""
    if not isinstance(specs, dict) or not specs:
        raise ValueError("plan_layout needs a non-empty dict of layer name -> spec")
    why = "asked for"
    if block_size is None:
        block_size, why = default_block_size(specs)
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size <= 0:
        raise ValueError(f"block_size must be a positive integer, got {block_size!r}")
    memory = parse_memory(memory_bytes)

    by_spec: dict[LayerSpec, list[str]] = {}
    for name, spec in specs.items():
        if not isinstance(spec, (AttentionSpec, RecurrentSpec)):
            raise ValueError(f"layer {name!r}: expected a layer spec, got {type(spec).__name__}")
        by_spec.setdefault(spec, []).append(name)

    attn, states = [], []
    for spec, names in by_spec.items():
        if spec.kind in ATTENTION_KINDS:
            attn.append((spec, len(names), block_size))
        else:
            states.append(_mamba_layer_layout(spec)[0] * len(names))
    page, packing = _choose_page_size(attn, states)
    packing = iter(packing)

    groups, views = [], {}
    for index, (spec, names) in enumerate(by_spec.items()):
        heads_per_page, mode = 0, WHOLE
        if spec.kind in ATTENTION_KINDS:
            layer_bytes = spec.block_bytes(block_size)
            mode = next(packing)
            if mode != WHOLE:
                heads_per_page, pages = _pack_heads(spec, names, block_size, page, mode == SCALES_APART, index,
                                                    views)
            else:
                per_page = max(1, page // layer_bytes)
                pages = -(-len(names) // per_page)
                for i, name in enumerate(names):
                    column, slot = divmod(i, per_page)
                    views[name] = LayerView(name, index, column, slot * layer_bytes)
        else:
            layer_bytes, part_offsets = _mamba_layer_layout(spec)
            pages = -(-layer_bytes * len(names) // page)
            for i, name in enumerate(names):
                views[name] = LayerView(name, index, 0, i * layer_bytes, part_offsets)
        groups.append(KVCacheGroup(index, spec, tuple(names), block_size, pages,
                                   layer_bytes * len(names), layer_bytes, heads_per_page, mode == SCALES_APART))

    num_pages = memory // page
    smallest = 1 + sum(g.pages_per_block for g in groups)
    if num_pages < smallest:
        raise ValueError(
            f"a budget of {memory:,} bytes holds {num_pages} page(s) of {page:,} bytes; "
            f"one block of every group plus the null page needs {smallest} pages "
            f"({smallest * page:,} bytes)"
        )
    return KVCacheLayout(tuple(groups), page, num_pages, block_size, memory, views, why)
