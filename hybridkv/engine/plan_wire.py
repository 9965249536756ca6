"""A step plan (step_plan.StepPlan) as one int64 array: what the driver of a
tensor-parallel engine broadcasts to its workers each step, as a tensor,
with no pickling.

The array, in order (every part int64):

    header   T tokens, S sequences, K sampled rows, C page copies,
             V (1: a verifying mask follows), A accepted entries (-1: none),
             N table changes, L tier calls, D (1: a decode step),
             P prompt-logprob rows, B top tokens for them
    ids[T] first_positions[S] counts[S] rows[S] verifying[S if V] sampled[K]
    logprob_rows[P] logprob_tokens[P]
    copies[2C]   (source page, destination page) pairs
    accepted[2A] (sequence index in the previous plan, drafts kept) pairs
    N table changes (one per group that changed), each: g, m, rows[m], then
        attention group: columns[m], pages[width * m] (plane by plane)
        recurrent group: read[m * width], write[m * width], zero[m]
    L tier calls (kv_tiers.TieredStore.log: the workers replay them), each:
        put 1, group, key, n, pages[n] | fetch 2, group, key, tier, found |
        load 3, the fetch's place in the calls, n, pages[n] | clear 4 |
        write 5, group, key, n, pages[n] (a flush: a cached block to disk)
        (a key: its length in bytes, then its bytes in int64 words)
    W, then W checkpoint saves, each: sequence index, offset, group,
        pages[width] (a recurrent state saved inside a prefill chunk)

Besides plans, two smaller messages use the same words: tier calls alone
(`encode_tier_calls`: L, then the calls; the calls a flush or a step that
runs nothing decided) and one block (`encode_block`: group, key; a disk
read every rank makes before the driver's manager may count it as a hit).

Sequences travel by their index in the plan, not their id, as in every
plan: `accepted` is keyed by those indexes. Widths and group kinds come from the
layout, which every rank holds.
"""

from __future__ import annotations

import numpy as np

from ..core.layout import KVCacheLayout
from .step_plan import StepPlan

HEADER = 11
TIERS = ("host", "disk")


def encode(plan: StepPlan) -> np.ndarray:
    accepted = plan.accepted
    parts = [np.array([len(plan.ids), len(plan.counts), len(plan.sampled), len(plan.copies),
                       plan.verifying is not None, -1 if accepted is None else len(accepted),
                       len(plan.table_changes), len(plan.tier_log), plan.decode, len(plan.logprob_rows),
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
    for call in plan.tier_log:
        parts.append(_tier_call(call))
    parts.append([len(plan.checkpoint_saves)])
    for sequence, offset, group, pages in plan.checkpoint_saves:
        parts.append([sequence, offset, group, *pages])
    return np.concatenate([np.asarray(p, dtype=np.int64).reshape(-1) for p in parts])


def encode_tier_calls(calls: list) -> np.ndarray:
    return np.asarray([len(calls), *(x for call in calls for x in _tier_call(call))], dtype=np.int64)


def decode_tier_calls(data: np.ndarray) -> list:
    reader = _Reader(data)
    calls = reader.tier_calls(int(reader.take(1)[0]))
    reader.end()
    return calls


def encode_block(group: int, key: bytes) -> np.ndarray:
    return np.asarray([group, *_key(key)], dtype=np.int64)


def decode_block(data: np.ndarray) -> tuple[int, bytes]:
    reader = _Reader(data)
    block = int(reader.take(1)[0]), reader.key()
    reader.end()
    return block


def _key(key: bytes) -> list:
    padded = key + bytes(-len(key) % 8)
    return [len(key), *np.frombuffer(padded, dtype="<i8").tolist()]


_CALLS = {"put": 1, "fetch": 2, "load": 3, "clear": 4, "write": 5}


def _tier_call(call) -> list:
    kind = call[0]
    if kind in ("put", "write"):
        return [_CALLS[kind], call[1], *_key(call[2]), len(call[3]), *call[3]]
    if kind == "fetch":
        return [_CALLS[kind], call[1], *_key(call[2]), TIERS.index(call[3]), int(call[4])]
    if kind == "load":
        return [_CALLS[kind], call[1], len(call[2]), *call[2]]
    return [_CALLS["clear"]]


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

    def tier_calls(self, count: int) -> list:
        take, calls = self.take, []
        for _ in range(count):
            kind = int(take(1)[0])
            if kind in (1, 5):
                group, key = int(take(1)[0]), self.key()
                calls.append(("put" if kind == 1 else "write", group, key, take(int(take(1)[0])).tolist()))
            elif kind == 2:
                group, key = int(take(1)[0]), self.key()
                tier, found = (int(x) for x in take(2))
                calls.append(("fetch", group, key, TIERS[tier], bool(found)))
            elif kind == 3:
                position = int(take(1)[0])
                calls.append(("load", position, take(int(take(1)[0])).tolist()))
            else:
                calls.append(("clear",))
        return calls

    def end(self) -> None:
        if self.at != len(self.data):
            raise ValueError(f"a message of {len(self.data)} values held {self.at}: the ranks disagree on its "
                             f"format")


def decode(data: np.ndarray, layout: KVCacheLayout) -> StepPlan:
    """The plan `encode` wrote."""
    t, s, k, c, v, a, n, calls, is_decode, p, top = (int(x) for x in data[:HEADER])
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
    tier_log = reader.tier_calls(calls)
    saves = []
    for _ in range(int(take(1)[0])):
        sequence, offset, g = (int(x) for x in take(3))
        saves.append((sequence, offset, g, tuple(take(layout.groups[g].pages_per_block).tolist())))
    reader.end()
    plan = StepPlan(ids, first_positions, counts, rows, verifying, sampled, bool(is_decode), copies, changes,
                    accepted, tier_log, logprob_rows=logprob_rows, logprob_tokens=logprob_tokens, logprob_top=top)
    plan.checkpoint_saves = saves
    return plan
