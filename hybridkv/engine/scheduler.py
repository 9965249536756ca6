"""Continuous batching: which sequences run in the next step, with how many
tokens each.

Each step has a token budget. Running sequences go first, oldest first: a
decoding one takes one token (consecutive decoding sequences get their
slots in one `allocate_slots_many` call), one still in prefill takes the
next chunk. Then waiting sequences are admitted first come, first served,
while the budget, `max_num_seqs` and the KV cache allow; a prompt longer than
what is left of the budget is prefilled in chunks over several steps. A
prefill chunk runs past Mamba checkpoint positions where the backend's
recurrent ops save states inside a chunk (the manager gives each a state
block, and the worker writes it); where it does not, every prefill chunk
ends at the next checkpoint, so the state there exists
(`KVCacheManager.next_chunk` decides).

A waiting prompt whose next block is being computed in this very step by
another sequence (two requests with the same system prompt arriving
together) waits one step: then it finds that block in the cache instead of
computing it a second time.

With speculative decoding (`propose` given), a decoding sequence may also
verify draft tokens in its step: `propose(seq, budget)` gives them, their
slots are reserved with the step's (`num_lookahead`, all or nothing) from
spare pages only (a block of every group per running sequence stays free),
and a sequence whose drafts do not fit decodes one token as usual.

When the cache cannot hold a running sequence's next tokens, the newest
running sequence is preempted by recompute: its blocks are freed and it goes
back to the head of the queue with its tokens so far as its prompt (prefix
caching usually gives most of them back).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from ..core import KVCacheManager
from .request import Sequence, Status


@dataclass
class Scheduled:
    seq: Sequence
    start: int  # tokens already computed
    count: int  # tokens computed in this step (drafts included)
    drafts: list[int] = field(default_factory=list)  # draft tokens verified after the known ones

    @property
    def completes(self) -> bool:
        """The step reaches the end of the known tokens: sample the next one."""
        return self.start + self.count - len(self.drafts) == len(self.seq.token_ids)


class Scheduler:
    def __init__(self, kv: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int,
                 on_release: Callable[[str], None] = lambda seq_id: None,
                 propose: Callable[[Sequence, int], list[int]] | None = None):
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.on_release = on_release  # a sequence left the running set (its table row is freed)
        self.propose = propose  # speculative decoding: draft tokens for a decoding sequence
        self._pages_per_step = sum(g.pages_per_block for g in kv.layout.groups)  # one new block of every group
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence, token_ids) -> None:
        """Queue a sequence with its prompt (the manager keeps the tokens;
        the sequence reads them from there)."""
        self.kv.add_request(seq.seq_id, token_ids, cache_salt=seq.request.cache_salt,
                            read_cache=seq.request.reads_prefix_cache)
        seq.token_ids = self.kv.token_ids(seq.seq_id)
        self.waiting.append(seq)

    def add_running(self, seq: Sequence) -> None:
        """A forked child: it already holds its blocks."""
        seq.token_ids = self.kv.token_ids(seq.seq_id)
        seq.status = Status.RUNNING
        self.running.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def _drop(self, seq: Sequence) -> None:
        self.kv.free(seq.seq_id)
        self.on_release(seq.seq_id)

    def preempt(self, seq: Sequence) -> None:
        """Recompute later: free every block, requeue at the head."""
        tokens = seq.token_ids
        self._drop(seq)
        self.running.remove(seq)
        self.kv.add_request(seq.seq_id, tokens, cache_salt=seq.request.cache_salt,
                            read_cache=seq.request.reads_prefix_cache)
        seq.token_ids = self.kv.token_ids(seq.seq_id)
        seq.status = Status.WAITING
        self.waiting.appendleft(seq)
        seq.request.metrics.num_preemptions += 1
        self.num_preemptions += 1

    def _decoding(self, seq: Sequence) -> bool:
        """Has the sequence computed all but its last (sampled) token?"""
        return self.kv.num_computed_tokens(seq.seq_id) == len(seq.token_ids) - 1

    def schedule(self) -> list[Scheduled]:
        """The next step: running sequences first (preempting the newest
        when the cache is full), then, if no one was preempted, waiting
        ones while the budget and the cache allow."""
        out: list[Scheduled] = []
        budget, preempted = self._schedule_running(out)
        if not preempted:
            self._admit_waiting(out, budget)
        return out

    def _schedule_running(self, out: list[Scheduled]) -> tuple[int, bool]:
        """Running sequences, oldest first: a run of decoding ones gets its
        slots in one call, one with drafts or in prefill its own. Returns the
        budget left and whether someone was preempted."""
        kv = self.kv
        budget = self.max_num_batched_tokens
        taken: set[str] = set()  # scheduled this step: never a victim
        proposed: dict[str, list[int]] = {}  # each sequence's drafts, asked once per step
        preempted = False
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            if self._decoding(seq):
                drafts = self._drafts(seq, budget, proposed) if self.propose is not None else []
                if self._speculate(seq, drafts[:budget - 1], out):
                    taken.add(seq.seq_id)
                    budget -= out[-1].count
                    i += 1
                    continue
                run = self._decoding_run(i, budget, proposed)
                got = kv.allocate_slots_many([s.seq_id for s in run], 1)
                for s in run[:got]:
                    out.append(Scheduled(s, len(s.token_ids) - 1, 1))
                    taken.add(s.seq_id)
                i += got
                budget -= got
                if got < len(run):  # run[got] did not fit: make room, then retry from it
                    self._preempt_newest(taken)
                    preempted = True
                continue
            done = kv.num_computed_tokens(seq.seq_id)
            count = kv.next_chunk(seq.seq_id, budget)
            while not kv.allocate_slots(seq.seq_id, count):
                preempted = True
                if self._preempt_newest(taken) is seq:
                    break
            else:
                out.append(Scheduled(seq, done, count))
                taken.add(seq.seq_id)
                budget -= count
                i += 1
        return budget, preempted

    def _drafts(self, seq: Sequence, budget: int, proposed: dict[str, list[int]]) -> list[int]:
        """A sequence's drafts, proposed once per step (the budget left is the same at both asks)."""
        if seq.seq_id not in proposed:
            proposed[seq.seq_id] = self.propose(seq, budget)
        return proposed[seq.seq_id]

    def _decoding_run(self, i: int, budget: int, proposed: dict[str, list[int]]) -> list[Sequence]:
        """The run of decoding sequences from running[i], within the budget,
        up to one that has drafts (it gets its own step)."""
        run: list[Sequence] = []
        j = i
        while j < len(self.running) and len(run) < budget and self._decoding(self.running[j]):
            if run and self.propose is not None and self._drafts(self.running[j], budget - len(run), proposed):
                break
            run.append(self.running[j])
            j += 1
        return run

    def _preempt_newest(self, taken: set[str]) -> Sequence:
        """Preempt the newest running sequence not scheduled in this step."""
        victim = next(s for s in reversed(self.running) if s.seq_id not in taken)
        self.preempt(victim)
        return victim

    def _admit_waiting(self, out: list[Scheduled], budget: int) -> None:
        """Waiting sequences, first come first served, while the budget,
        max_num_seqs and the cache allow; one whose next block another
        sequence computes in this step waits a step to hit it instead."""
        kv = self.kv
        computing = self._keys_computed(out)
        deferred: list[Sequence] = []
        while self.waiting and budget > 0:
            seq = self.waiting[0]
            # A prompt with n > 1 forks n - 1 children once computed: room for all of them.
            if len(self.running) + (seq.request.params.n if seq.request.fork_pending else 1) > self.max_num_seqs:
                break
            done = kv.get_computed_tokens(seq.seq_id)
            count = kv.next_chunk(seq.seq_id, budget)
            upcoming = kv.block_keys(seq.seq_id, done, done + count)
            if upcoming and upcoming[0] in computing and seq.request.reads_prefix_cache:
                deferred.append(self.waiting.popleft())  # its prefix is being computed: reuse it next step
                continue
            if not kv.allocate_slots(seq.seq_id, count):
                count = self._cut_at_checkpoint(seq, budget, count)
                if not count:
                    if not self.running:
                        raise RuntimeError(f"sequence {seq.seq_id} does not fit an empty KV cache; the engine "
                                           f"checks this at admission")
                    break
                upcoming = kv.block_keys(seq.seq_id, done, done + count)
            self.waiting.popleft()
            seq.status = Status.RUNNING
            self.running.append(seq)
            metrics = seq.request.metrics
            if metrics.first_scheduled_time is None:
                metrics.num_cached_tokens = done
            out.append(Scheduled(seq, done, count))
            computing.update(upcoming)
            budget -= count
        self.waiting.extendleft(reversed(deferred))

    def _speculate(self, seq: Sequence, drafts: list[int], out: list[Scheduled]) -> bool:
        """Schedule a decoding sequence with its drafts, if it has any and
        their slots fit now."""
        if not drafts:
            return False
        # Drafts only from spare pages: room for one more block of every group
        # for every running sequence stays free, so that a draft's slots never
        # make another sequence's next token preempt someone.
        reserve = len(self.running) * self._pages_per_step
        if self.kv.num_free_pages < reserve or \
                not self.kv.allocate_slots(seq.seq_id, 1, num_lookahead=len(drafts)):
            return False
        out.append(Scheduled(seq, len(seq.token_ids) - 1, 1 + len(drafts), drafts))
        return True

    def _cut_at_checkpoint(self, seq: Sequence, budget: int, count: int) -> int:
        """A chunk that saves recurrent states inside it takes a state block
        per checkpoint; where the pool cannot hold them beside the hit, the
        chunk ending at the next checkpoint, allocated (0: that does not fit
        either)."""
        cut = self.kv.next_chunk(seq.seq_id, budget, inside=False)
        return cut if cut < count and self.kv.allocate_slots(seq.seq_id, cut) else 0

    def _keys_computed(self, steps: list[Scheduled]) -> set:
        """Keys of the blocks this step's prefill chunks complete."""
        keys: set = set()
        for s in steps:
            if s.count > 1 and not s.drafts:
                keys.update(self.kv.block_keys(s.seq.seq_id, s.start, s.start + s.count))
        return keys

    def finish(self, seq: Sequence) -> None:
        self._drop(seq)
        self.running.remove(seq)
        seq.status = Status.FINISHED

    def abort(self, seq: Sequence) -> None:
        if seq.seq_id in self.kv:
            self._drop(seq)
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        seq.status = Status.FINISHED
