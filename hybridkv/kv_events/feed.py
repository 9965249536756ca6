"""How a replica's KV events reach the routers: numbered reports, with a
full snapshot now and then, so a router that missed one knows it and
recovers.

On Ray Serve the path is fixed by Ray: the controller calls each replica's
`record_routing_stats` every `request_routing_stats_period_s`, keeps the
latest answer, and pushes it to every router (one per proxy or handle
process) with the replica's other info. A router therefore sees the latest
report of each replica, not necessarily every one: it may start late, or
two reports may pass while it is busy. So each report carries its
replica's incarnation (`epoch`) and a sequence number:

* a report is the events since the previous report (a delta), or, every
  `snapshot_every` reports, on the first, and whenever the pool caches at
  most `small_snapshot_blocks` blocks, the whole state: a reset followed by
  every key each group holds (a snapshot). A router that starts after a
  replica sees its latest report first, not its first: while the cache is
  small (a replica's first minutes) every report lets it join at once (a
  router that follows the replica already takes such a report's delta,
  carried beside it); later it joins at the next periodic snapshot;
* each report also carries the deltas of the `backlog` reports before it,
  so a router that missed up to that many (the controller's push keeps
  only the latest, and two reports may pass between two pushes under load)
  applies what it missed, in order, and stays exact;
* a router applies a delta only on top of the reports numbered before it
  (its own or from the backlog); on a longer gap (or a new epoch: the
  replica was restarted) it forgets that replica and ignores its deltas
  until the next snapshot, instead of guessing.

Staleness: a router knows what a replica held one report period ago (plus
the controller's push); after a gap longer than the backlog it knows
nothing of that replica for at most `snapshot_every` periods, and routes to
it by queue length only.

Torch-free: the replica side reads a KVCacheManager, the router side holds
a PrefixIndex.
"""

from __future__ import annotations

import uuid
from collections import deque

from ..core.events import AllBlocksCleared, BlockStored
from ..core.prefix_index import PrefixIndex


class EventReporter:
    """The replica's side: turns the manager's events into numbered reports."""

    def __init__(self, snapshot_every: int = 20, backlog: int = 4, small_snapshot_blocks: int = 4096):
        if snapshot_every < 1:
            raise ValueError(f"snapshot_every must be >= 1, got {snapshot_every}")
        if backlog < 0:
            raise ValueError(f"backlog must be >= 0, got {backlog}")
        self.snapshot_every = snapshot_every
        # A snapshot of this many keys (32 bytes each) costs a report little.
        self.small_snapshot_blocks = small_snapshot_blocks
        self.epoch = uuid.uuid4().hex  # a restarted replica starts a new numbering
        self.seq = 0
        # The deltas of the latest reports, oldest first; a snapshot's own
        # delta too, so a router that missed the snapshot can still catch up.
        self._recent: deque = deque(maxlen=backlog)

    def report(self, kv) -> dict:
        """The next report of manager `kv` (made with enable_kv_events=True).
        Call where nothing else touches `kv` (the engine thread)."""
        delta = kv.take_events()  # drained every time, so a snapshot leaves nothing pending behind it
        self.seq += 1
        periodic = self.seq == 1 or self.seq % self.snapshot_every == 0
        small = not periodic and kv.stats.cached_blocks <= self.small_snapshot_blocks
        snapshot = periodic or small
        # A periodic snapshot every router takes whole (it needs no backlog).
        # A small one is for routers that join: one that follows the replica
        # takes its delta (and the backlog) instead, for applying a snapshot
        # of a few thousand keys costs a router milliseconds per replica.
        report = {"epoch": self.epoch, "seq": self.seq, "snapshot": snapshot,
                  "events": snapshot_events(kv) if snapshot else delta,
                  "delta": delta if small else None, "layout": kv.layout if snapshot else None,
                  "earlier": [] if periodic else list(self._recent)}
        self._recent.append(delta)
        return report


def snapshot_events(kv) -> list:
    """The manager's whole cache as events: a reset, then per group one
    BlockStored with every key it holds (no order or parent: an index only
    needs which keys are held)."""
    out = [AllBlocksCleared()]
    for group_idx, group in enumerate(kv.layout.groups):
        keys = kv.cached_keys(group_idx)
        if keys:
            out.append(BlockStored(keys, None, [], kv.layout.block_size, group_idx, group.kind))
    return out


class IndexFeed:
    """The router's side: applies each replica's reports to one PrefixIndex,
    in order, and drops a replica it lost track of until its next snapshot."""

    def __init__(self):
        self.index: PrefixIndex | None = None  # made from the first snapshot's layout
        self._seen: dict = {}  # replica -> (epoch, seq) of the last report taken
        self._synced: set = set()  # replicas whose index entry is exact up to their last report
        self.num_gaps = 0
        self.reports: dict = {}  # replica -> reports taken from it

    def offer(self, replica, report: dict | None) -> None:
        """The latest report of `replica` (the same one may come many times)."""
        if not report or "seq" not in report:
            return
        mark = (report["epoch"], report["seq"])
        last = self._seen.get(replica)
        if last is not None and last[0] == mark[0] and last[1] >= mark[1]:
            return  # taken already, or older than what was
        self._seen[replica] = mark
        self.reports[replica] = self.reports.get(replica, 0) + 1
        same_run = replica in self._synced and last is not None and last[0] == mark[0]
        if report["snapshot"]:
            delta = report.get("delta")
            if delta is not None and same_run and self._catch_up(replica, last[1], mark[1], report, delta):
                return
            if self.index is None:
                self.index = PrefixIndex(report["layout"])
            self.index.apply(replica, report["events"])  # it begins with a reset
            self._synced.add(replica)
            return
        if same_run and self._catch_up(replica, last[1], mark[1], report, report["events"]):
            return
        if replica in self._synced:
            self.num_gaps += 1
        self.forget(replica)
        self._seen[replica] = mark

    def _catch_up(self, replica, last: int, seq: int, report: dict, delta: list) -> bool:
        """Apply `delta` (report `seq`'s) on top of report `last`, with the
        deltas in between from the report's backlog; False (nothing
        applied) where the backlog does not reach back to `last`."""
        earlier = report.get("earlier", ())
        missed = seq - last - 1
        if not 0 <= missed <= len(earlier):
            return False
        for events in earlier[len(earlier) - missed:]:
            self.index.apply(replica, events)
        self.index.apply(replica, delta)
        return True

    def forget(self, replica) -> None:
        """`replica` is gone, or its reports have a gap: nothing is known of it."""
        self._synced.discard(replica)
        self._seen.pop(replica, None)
        if self.index is not None:
            self.index.remove_source(replica)

    def synced(self, replica) -> bool:
        return replica in self._synced

    def hits(self, token_ids, cache_salt: str | None = None, keys: list | None = None) -> dict:
        """Replica -> the hit (tokens) a request with these tokens would get
        there; `keys`: their block keys, where the caller has them."""
        if self.index is None:
            return {}
        ranked = self.index.best_of_keys(keys) if keys is not None else self.index.best(token_ids, cache_salt)
        return {replica: hit for hit, replica in ranked}


class RecentRoutes:
    """The blocks of the prompts a router sent to each replica that the
    replica's reports do not cover yet. The reports say what a replica cached
    one period late, so a request that follows another it shares a prefix
    with, within that period, would find no hit anywhere and go wherever. A
    router counts the blocks a replica is about to cache (those of the
    prompts it just sent there) as held there until two more reports of
    that replica have come (the second one was made after the prompt was
    computed, unless the prefill took longer than a period), or
    `horizon_s` passed without them.

    An estimate, by blocks only: the hit rule of the hybrid groups (a window
    tail, a Mamba checkpoint) is the reports' to judge; a request routed by
    it to a replica that then misses costs one prefill, as with a router that
    knows nothing."""

    def __init__(self, horizon_s: float):
        self.horizon_s = horizon_s
        self._entry: dict = {}  # (key, replica) -> (until when, the replica's report count when routed)
        self._expiry: deque = deque()  # ((key, replica), until), oldest first

    def add(self, replica, keys, now: float, reports: int) -> None:
        until = now + self.horizon_s
        for key in keys:
            self._entry[(key, replica)] = (until, reports)
            self._expiry.append(((key, replica), until))

    def hits(self, reports: dict, keys, block_size: int, now: float) -> dict:
        """Replica -> tokens of the leading blocks of `keys` recently sent
        there; `reports`: replica -> reports taken from it so far."""
        while self._expiry and self._expiry[0][1] <= now:
            entry, until = self._expiry.popleft()
            if self._entry.get(entry, (None,))[0] == until:
                del self._entry[entry]
        out = {}
        for replica, taken in reports.items():
            run = 0
            while run < len(keys):
                entry = self._entry.get((keys[run], replica))
                if entry is None or entry[0] <= now or taken > entry[1] + 1:
                    break
                run += 1
            if run:
                out[replica] = run * block_size
        return out
