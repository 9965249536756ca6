"""The worker's side of the tiers: a step plan's tier copies between the
pool and this rank's storage (tiers/store.py), before the forward pass.

Order (core/tiers.py `TierPlan`): a clear first, then the stores (every
page a store reads is read before any load writes one: a block evicted and
hit again in one step is loaded from what its store kept), then the loads.
A load whose block the tiers no longer hold whole (lost to a budget, a
damaged or missing file) fails; under tensor parallelism one all-reduce
of the failures (only in a step with loads) makes a load that failed on
any rank fail on every rank, which then drops that block from its own
storage and zeroes the pages, so the ranks agree on what the scheduler's
index holds and the failed request reads nothing stale while the engine
recomputes it.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from ..core.tiers import TierPlan, TierReport
from ..tiers import TierStore


def copy_tiers(store: TierStore, pool: torch.Tensor, plan: TierPlan, world: int = 1) -> TierReport:
    """Make `plan`'s copies on this rank; the report of what they did."""
    if plan.clear:
        store.clear()
    if plan.stores:
        pages = [p for s in plan.stores for p in s.pages]
        content = pool[pages].cpu()  # one gather, before any load writes a page
        at = 0
        for s in plan.stores:
            block = content[at:at + len(s.pages)]
            at += len(s.pages)
            if plan.flush:
                store.write_disk(s.group, s.key, block)
            else:
                store.keep(s.group, s.key, block)
    failed = []
    if plan.loads:
        started = time.perf_counter()
        ok = []
        for load in plan.loads:
            content = store.read(load.group, load.key)
            good = content is not None and tuple(content.shape) == (len(load.pages), pool.shape[1])
            if good:
                pool[list(load.pages)] = content.to(pool.device, non_blocking=True)
            ok.append(good)
        if world > 1:
            ok = _on_every_rank(ok, pool.device)
        for i, (load, good) in enumerate(zip(plan.loads, ok)):
            if not good:
                failed.append(i)
                pool[list(load.pages)] = 0
                store.drop(load.group, load.key)
        store.load_seconds += time.perf_counter() - started
    return TierReport(failed, store.take_moves())


def _on_every_rank(ok: list[bool], device: torch.device) -> list[bool]:
    """Each flag as every rank has it: true only where it is true on all
    (one all-reduce of the vector, its minimum; through the rank's device
    on NCCL)."""
    flags = torch.tensor(ok, dtype=torch.int32, device=device if dist.get_backend() == "nccl" else "cpu")
    dist.all_reduce(flags, op=dist.ReduceOp.MIN)
    return [bool(x) for x in flags.tolist()]
