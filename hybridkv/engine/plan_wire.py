"""A step plan (step_plan.StepPlan) as one int64 array: what the driver of a
tensor-parallel engine broadcasts to its workers each step, as a tensor,
with no pickling.

The array, in order (every part int64):

    header   T tokens, S sequences, K sampled rows, C page copies,
             V (1: a verifying mask follows), A accepted entries (-1: none),
             N table changes, L (1: tier copies follow), D (1: a decode step),
             P prompt-logprob rows, B top tokens for them
    ids[T] first_positions[S] counts[S] rows[S] verifying[S if V] sampled[K]
    logprob_rows[P] logprob_tokens[P]
    copies[2C]   (source page, destination page) pairs
    accepted[2A] (sequence index in the previous plan, drafts kept) pairs
    N table changes (one per group that changed), each: g, m, rows[m], then
        attention group: columns[m], pages[width * m] (plane by plane)
        recurrent group: read[m * width], write[m * width], zero[m]
    tier copies, if L (core/tiers.py TierPlan): clear, flush, stores,
        loads, then each store and each load: group, key, n, pages[n]
        (a key: its length in bytes, then its bytes in int64 words; a
        load's request is the driver's business)
    W, then W checkpoint saves, each: sequence index, offset, group,
        pages[width] (a recurrent state saved inside a prefill chunk)

Besides plans, one smaller message uses the same words: tier copies alone
(`encode_tiers`: those a flush, a reset or a step that runs nothing
decided).

Sequences travel by their index in the plan, not their id, as in every
plan: `accepted` is keyed by those indexes. Widths and group kinds come from the
layout, which every rank holds.
"""

from __future__ import annotations

import numpy as np

from ..core.layout import KVCacheLayout
from ..core.tiers import BlockLoad, BlockStore, TierPlan
from .step_plan import StepPlan

HEADER = 11


def encode(plan: StepPlan) -> np.ndarray:
    accepted = plan.accepted
    parts = [np.array([len(plan.ids), len(plan.counts), len(plan.sampled), len(plan.copies),
                       plan.verifying is not None, -1 if accepted is None else len(accepted),
                       len(plan.table_changes), plan.tiers is not None, plan.decode, len(plan.logprob_rows),
                       plan.logprob_top], dtype=np.int64),
             plan.ids, plan.first_positions, plan.counts, plan.rows]
    if plan.verifying is not None:
        parts.append(plan.verifying)
    parts += [plan.sampled, plan.logprob_rows, plan.logprob_tokens]
    if plan.copies:
        parts.append(np.asarray(plan.copies, dtype=np.int64).reshape(-1))
    if accepted:
        parts.append(np.fromiter((x for pair in accepted.items() for x in pair), dtype=np.int64,
                                 count=2 * len(accepted)))
    for change in plan.table_changes:
        parts.append((change[0], len(change[1])))
        parts.extend(change[1:])
    if plan.tiers is not None:
        parts.append(_tier_words(plan.tiers))
    parts.append([len(plan.checkpoint_saves)])
    for sequence, offset, group, pages in plan.checkpoint_saves:
        parts.append([sequence, offset, group, *pages])
    return np.concatenate([np.asarray(p, dtype=np.int64).reshape(-1) for p in parts])


def encode_tiers(tiers: TierPlan) -> np.ndarray:
    return np.asarray(_tier_words(tiers), dtype=np.int64)


def decode_tiers(data: np.ndarray) -> TierPlan:
    reader = _Reader(data)
    tiers = reader.tiers()
    reader.end()
    return tiers


def _key(key: bytes) -> list:
    padded = key + bytes(-len(key) % 8)
    return [len(key), *np.frombuffer(padded, dtype="<i8").tolist()]


def _tier_words(tiers: TierPlan) -> list:
    words = [int(tiers.clear), int(tiers.flush), len(tiers.stores), len(tiers.loads)]
    for entry in (*tiers.stores, *tiers.loads):
        words += [entry.group, *_key(entry.key), len(entry.pages), *entry.pages]
    return words


class _Reader:
    """Reads an encoded message front to back."""

    def __init__(self, data: np.ndarray):
        self.data, self.at = data, 0

    def take(self, count: int) -> np.ndarray:
        part = self.data[self.at:self.at + count]
        self.at += count
        return part

    def key(self) -> bytes:
        size = int(self.take(1)[0])
        return self.take(-(-size // 8)).astype("<i8").tobytes()[:size]

    def tiers(self) -> TierPlan:
        take = self.take
        clear, flush, stores, loads = (int(x) for x in take(4))
        entries = []
        for _ in range(stores + loads):
            group, key = int(take(1)[0]), self.key()
            entries.append((group, key, tuple(take(int(take(1)[0])).tolist())))
        return TierPlan([BlockStore(*e) for e in entries[:stores]], [BlockLoad("", *e) for e in entries[stores:]],
                        bool(clear), bool(flush))

    def end(self) -> None:
        if self.at != len(self.data):
            raise ValueError(f"a message of {len(self.data)} values held {self.at}: the ranks disagree on its "
                             f"format")


def decode(data: np.ndarray, layout: KVCacheLayout) -> StepPlan:
    """The plan `encode` wrote."""
    t, s, k, c, v, a, n, has_tiers, is_decode, p, top = (int(x) for x in data[:HEADER])
    reader = _Reader(data)
    reader.take(HEADER)
    take = reader.take
    ids, first_positions, counts, rows = take(t), take(s), take(s), take(s)
    verifying = take(s).astype(bool) if v else None
    sampled = take(k)
    logprob_rows, logprob_tokens = take(p), take(p)
    copies = [tuple(pair) for pair in take(2 * c).reshape(c, 2).tolist()]
    accepted = None if a < 0 else dict(take(2 * a).reshape(a, 2).tolist())
    changes = []
    for _ in range(n):
        g, m = (int(x) for x in take(2))
        group = layout.groups[g]
        width = group.pages_per_block
        changed = take(m).copy()
        if group.recurrent:
            read, write = take(m * width).reshape(m, width).copy(), take(m * width).reshape(m, width).copy()
            changes.append((g, changed, read, write, take(m).astype(bool)))
        else:
            changes.append((g, changed, take(m).copy(), take(width * m).reshape(width, m).copy()))
    tiers = reader.tiers() if has_tiers else None
    saves = []
    for _ in range(int(take(1)[0])):
        sequence, offset, g = (int(x) for x in take(3))
        saves.append((sequence, offset, g, tuple(take(layout.groups[g].pages_per_block).tolist())))
    reader.end()
    plan = StepPlan(ids, first_positions, counts, rows, verifying, sampled, bool(is_decode), copies, changes,
                    accepted, tiers, logprob_rows=logprob_rows, logprob_tokens=logprob_tokens, logprob_top=top)
    plan.checkpoint_saves = saves
    return plan
