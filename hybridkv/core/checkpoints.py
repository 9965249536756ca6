"""Where Mamba (recurrent) layers save state checkpoints for prefix hits.

A recurrent state after token L stands for the whole prefix [0, L): it cannot
be rebuilt from a later state, and every checkpoint costs a whole state. So a
model with recurrent layers only hits at positions where some request saved
its state, and saving everywhere floods the pool with states nobody reuses.

The admission rule of hybridkv ("hybridkv" below) saves a state where reuse is
likely, after the Marconi paper's observation that reuse concentrates at a
few positions:
* the end of the prompt, rounded down to the block size (a request with the
  same prompt, a regenerated answer, hits there). Once the request has moved
  on, this state enters the free queue on probation: in LRU order for a
  grace (an eighth of the pool's pages released after it: a prompt sent
  again soon finds it), then first to go, because in a chat the next turn
  resumes from the end of the answer, not of the prompt (block_cache.py);
* the branch point: the end of the longest prefix this prompt shares with
  another request's, earlier or waiting beside it (a shared system prompt or
  chat history shows up as such a prefix from its second use on, and is then
  likely to be shared again);
* the end of the sequence: while decoding, a rolling checkpoint at each block
  boundary, each one replacing the request's previous one, so that when the
  request finishes its latest state is cached for the next turn of a chat,
  at the price of one state per request.
The baselines for comparison (benchmarks/hybrid_prefix.py): "every_block"
saves at every block boundary, "prompt_end" only at the end of the prompt.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from itertools import repeat


@dataclass(frozen=True)
class CheckpointPolicy:
    name: str
    every_block: bool = False  # plan a checkpoint at every block boundary of the prompt
    branch_points: bool = False  # plan one where the prompt leaves the prefixes other requests share
    rolling: bool = False  # checkpoint at block boundaries past the prompt
    supersede: bool = False  # a rolling checkpoint drops the request's previous one
    probation: bool = False  # the prompt-end checkpoint (unless also a branch point) is released on probation

    def plan(self, num_tokens: int, block_size: int, hit: int, shared: int) -> list[int]:
        """Checkpoint positions inside the prompt (ascending, all > hit).
        `shared` is the length of the longest prefix seen in other prompts."""
        last = (num_tokens - 1) // block_size * block_size  # a later hit can reach at most this
        if self.every_block:
            return list(range(hit + block_size, last + 1, block_size))
        positions = []
        if self.branch_points and hit < shared < last:
            positions.append(shared)
        if last > hit:
            positions.append(last)
        return positions

    def on_probation(self, position: int, num_tokens: int, block_size: int, shared: int) -> bool:
        """Is the checkpoint at `position` the prompt-end one, released on probation?"""
        last = (num_tokens - 1) // block_size * block_size
        return self.probation and position == last and not (self.branch_points and shared >= last)


POLICIES = {
    "hybridkv": CheckpointPolicy("hybridkv", branch_points=True, rolling=True, supersede=True, probation=True),
    "prompt_end": CheckpointPolicy("prompt_end"),
    "every_block": CheckpointPolicy("every_block", every_block=True, rolling=True),
}


def get_policy(policy: str | CheckpointPolicy) -> CheckpointPolicy:
    if isinstance(policy, CheckpointPolicy):
        return policy
    try:
        return POLICIES[policy]
    except (KeyError, TypeError):
        raise ValueError(f"unknown checkpoint policy {policy!r}; expected one of {sorted(POLICIES)}") from None


_SHARED = object()  # held by two or more requests (compared by identity: never a request id)


def _leading_run(holds: Callable, keys: list) -> int:
    """How many leading keys `holds`, for a test that holds a key's prefix
    whenever it holds the key (keys chain): a binary search."""
    lo, hi = 0, len(keys)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if holds(keys[mid - 1]):
            lo = mid
        else:
            hi = mid - 1
    return lo


class PrefixSightings:
    """A bounded map of the block keys of recent prompts, to find branch
    points: the prefix a prompt shares with any other request's. A key maps
    to the one request whose prompt held it, or to `_SHARED` once a second
    one's did. A request is recorded when it is added, so a request waiting
    beside it counts as much as one that came before: a burst of requests
    with one system prompt checkpoints it on its first prefill, and the
    others hit there (rather than a second request computing it once more to
    leave the checkpoint).

    Bounded by two generations of plain dicts rather than an exact LRU (an
    OrderedDict costs about 0.3 us per key inserted, and a prompt records
    hundreds): keys go into the young generation; once it holds half the
    capacity it becomes the old one and the old one's keys are forgotten; a
    key seen again moves to the young one. So the map keeps at most
    `capacity` keys (plus the last prompt's) and at least the last
    capacity/2 seen. Recording a
    prompt records every key of its prefix with it, so a prefix is never
    older than its extensions: what is forgotten is whole chain ends, and
    the shared prefixes stay prefix-closed (what the binary search in
    shared_blocks needs)."""

    def __init__(self, capacity: int = 1 << 16):
        self.capacity = capacity
        self._young: dict = {}  # key -> the request that held it, or _SHARED
        self._old: dict = {}
        # The requests recorded into each generation: a key can be held by
        # a request only if the request is in one of them (a key moves
        # between generations only by another record, which makes it shared).
        self._young_owners: set = set()
        self._old_owners: set = set()
        self.version = 0  # bumped by every change (a plan made before one may differ)

    def _holder(self, key):
        holder = self._young.get(key)
        return self._old.get(key) if holder is None else holder

    def shared_blocks(self, keys: list) -> int:
        """Number of leading keys that a recorded request's prompt shares
        with at least one other request's. Keys chain, so such prefixes are
        prefix-closed and a binary search finds the boundary."""
        return _leading_run(lambda key: self._holder(key) is _SHARED, keys)

    def record(self, keys: list, owner: str) -> None:
        """`owner`'s prompt holds `keys`. Recording again for the same owner
        (a preempted request added back) does not make its blocks shared."""
        young, old = self._young, self._old
        if owner in self._young_owners or owner in self._old_owners:
            # Recorded before: key by key, so that its own keys stay its own.
            holders = list(map(young.get, keys, map(old.get, keys)))  # young first
            young.update(zip(keys, [owner if h is None or h == owner else _SHARED for h in holders]))
        else:
            # A new owner holds none of the keys, so every key some request
            # holds is shared from now on and the others are its own. Each
            # generation is prefix-closed (a record writes a whole prefix),
            # so each holds a leading run of the keys: two binary searches
            # rather than a lookup per key (a prompt has hundreds). Shared
            # keys are prefix-closed too (a key shared by two prompts has
            # its prefix in both), so a young run ending in a shared key is
            # shared throughout and stays as it is.
            fresh = _leading_run(young.__contains__, keys)
            held = max(fresh, _leading_run(old.__contains__, keys)) if old and fresh < len(keys) else fresh
            start = fresh if fresh and young[keys[fresh - 1]] is _SHARED else 0
            if held > start:
                young.update(zip(keys[start:held], repeat(_SHARED)))
            if len(keys) > held:
                young.update(zip(keys[held:], repeat(owner)))
        self._turn_over(owner)

    def _turn_over(self, owner) -> None:
        young = self._young
        self._young_owners.add(owner)
        if len(young) >= max(1, self.capacity // 2):
            self._old, self._young = young, {}
            self._old_owners, self._young_owners = self._young_owners, set()
        self.version += 1

    def clear(self) -> None:
        self._young.clear()
        self._old.clear()
        self._young_owners.clear()
        self._old_owners.clear()
        self.version += 1


class CheckpointPlanner:
    """Where one model's requests save Mamba states: planned at a request's
    first allocation (`plan`), and told to the scheduler (`next_checkpoint`)
    and to the recurrent managers (`inside`). A runner that saves states
    inside a prefill chunk (the mixers scan up to a checkpoint, copy the
    state there, go on) gets a state block for each planned position inside
    the chunk; for one that does not, a chunk ends at the next checkpoint,
    so the state exists there. One planner serves all the Mamba groups of a
    model: they save at the same positions. `extend_keys(req, n)` makes the
    request's first n block keys."""

    def __init__(self, policy: CheckpointPolicy, block_size: int, extend_keys: Callable):
        self.policy = policy
        self.block_size = block_size
        self.extend_keys = extend_keys
        self.sightings = PrefixSightings() if policy.branch_points else None

    def sight(self, req) -> None:
        """Record a new request's prompt, for branch points."""
        if self.sightings is not None:
            blocks = len(req.tokens) // self.block_size
            self.extend_keys(req, blocks)
            self.sightings.record(req.keys[:blocks], req.request_id)

    def plan(self, req, hit: int) -> None:
        """Choose where the request saves states inside its prompt, past the
        hit (once for a lookup: the scheduler's next_chunk and the first
        allocation both ask, and nothing it depends on changes between)."""
        made_from = (hit, len(req.tokens), self.sightings.version if self.sightings is not None else 0)
        if req.planned_for == made_from:
            return
        req.planned_for = made_from
        bs = self.block_size
        shared = 0
        if self.sightings is not None:
            prompt_blocks = len(req.tokens) // bs
            self.extend_keys(req, prompt_blocks)
            shared = self.sightings.shared_blocks(req.keys[:prompt_blocks]) * bs
        req.checkpoints = self.policy.plan(len(req.tokens), bs, hit, shared)
        last = (len(req.tokens) - 1) // bs * bs
        req.probation_at = last if self.policy.on_probation(last, len(req.tokens), bs, shared) else -1

    def next_checkpoint(self, req, hit: int, skip: int = 0) -> int | None:
        """The next checkpoint after the computed tokens (or, before the
        first allocation, after the hit it will take), past the first `skip`
        planned ones (those a chunk may hold inside). Past the prompt, with
        rolling checkpoints, the next block boundary: a speculative step must
        not jump over it, or the state there would never exist."""
        if not req.started:
            self.plan(req, hit)
            done = hit
        else:
            done = req.num_computed
        for position in req.checkpoints:
            if position > done:
                if skip:
                    skip -= 1
                    continue
                return position
        if req.started and self.policy.rolling and done >= req.num_prompt_tokens:
            return (done // self.block_size + 1) * self.block_size
        return None

    def inside(self, req, start: int, end: int) -> list[int]:
        """The planned checkpoints strictly inside tokens (start, end): the
        states a chunk over them saves on its way."""
        return [p for p in req.checkpoints if start < p < end]

    def is_checkpoint(self, req, n: int) -> bool:
        """Does the state after `n` tokens get saved?"""
        if n == 0 or n % self.block_size:
            return False
        return n in req.checkpoints or (self.policy.rolling and n >= req.num_prompt_tokens)

    def is_rolling(self, req, n: int) -> bool:
        """Is the checkpoint at `n` a rolling one (past the prompt)?"""
        return self.policy.rolling and n >= req.num_prompt_tokens

    def clear(self) -> None:
        if self.sightings is not None:
            self.sightings.clear()
