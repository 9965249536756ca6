"""Random operation sequences against KVCacheManager over every layer-type
mix and tiny pools (allocation fails and eviction happens all the time).
After every step: the pool invariants (each page free xor in one held block,
ref counts equal references, key maps consistent, nothing leaked) and the
shadow runner's check that every block a request reads holds its own
tokens. At the end, freeing everything gives every page back."""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from hybridkv.core import KVCacheManager
from kv_shadow import MIXES, ShadowRunner, layer_specs, layout_with_pages

# Prompts share prefixes often: a few bases, cut anywhere, plus a short tail.
BASES = [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24],
         [1, 2, 3, 4, 5, 6, 7, 8, 30, 31, 32, 33, 34, 35, 36, 37, 38, 39, 40],
         [50, 51, 52, 53, 54, 55, 56, 57, 58, 59, 60, 61]]

EXAMPLES = int(os.environ.get("HYBRIDKV_STATEFUL_EXAMPLES", "40"))


class ManagerMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.next_id = 0
        self.live: list[str] = []
        self.history: list[list[int]] = []  # token ids of requests seen, to come back to

    @initialize(mix=st.sampled_from(sorted(MIXES)), pages=st.integers(12, 96), block_size=st.sampled_from([2, 4]),
                caching=st.booleans(), policy=st.sampled_from(["hybridkv", "prompt_end", "every_block"]),
                window=st.integers(1, 9), chunk=st.integers(2, 12))
    def setup(self, mix, pages, block_size, caching, policy, window, chunk):
        specs = layer_specs(MIXES[mix], window=window, chunk=chunk)
        layout = layout_with_pages(specs, pages, block_size)
        self.kv = KVCacheManager(layout, enable_prefix_caching=caching, checkpoint_policy=policy)
        self.shadow = ShadowRunner(self.kv)
        self.total = self.kv.num_free_pages

    @rule(base=st.sampled_from(range(len(BASES))), cut=st.integers(1, 24),
          tail=st.lists(st.integers(0, 3), max_size=6), salt=st.sampled_from([None, None, "tenant-b"]))
    def add(self, base, cut, tail, salt):
        self._add(BASES[base][:cut] + tail, salt)

    @precondition(lambda self: self.history)
    @rule(data=st.data(), tail=st.lists(st.integers(0, 3), max_size=6))
    def add_next_turn(self, data, tail):
        """A request whose prompt is an earlier request's whole sequence plus
        more (the next turn of a chat): hits on rolling checkpoints."""
        self._add(data.draw(st.sampled_from(self.history)) + tail, None)

    def _add(self, prompt, salt):
        rid = f"r{self.next_id}"
        self.next_id += 1
        self.kv.add_request(rid, prompt, cache_salt=salt)
        self.live.append(rid)

    @precondition(lambda self: self.live)
    @rule(data=st.data(), chunk=st.integers(1, 9))
    def step(self, data, chunk):
        rid = data.draw(st.sampled_from(self.live))
        kv = self.kv
        req = kv._requests[rid]
        if req.started and req.num_computed >= len(req.tokens):
            kv.append_token_ids(rid, [data.draw(st.integers(0, 3))])
        done = kv.get_computed_tokens(rid)
        size = min(chunk, len(req.tokens) - done)
        checkpoint = kv.next_checkpoint(rid)
        if checkpoint is not None and data.draw(st.sampled_from([True, True, True, False])):
            size = min(size, checkpoint - done)
        before = (kv.num_free_pages, [list(t) for t in req.tables], req.num_computed, req.started)
        if kv.allocate_slots(rid, size):
            self.shadow.compute(rid, size)
        else:
            after = (kv.num_free_pages, [list(t) for t in req.tables], req.num_computed, req.started)
            assert before == after, "a failed allocate_slots changed the request or the pool"

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def fork(self, data):
        rid = data.draw(st.sampled_from(self.live))
        req = self.kv._requests[rid]
        if not req.started or req.num_allocated != req.num_computed:
            return
        child = f"r{self.next_id}"
        self.next_id += 1
        self.kv.fork(rid, child)
        self.live.append(child)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def free(self, data):
        rid = data.draw(st.sampled_from(self.live))
        self.history.append(list(self.kv._requests[rid].tokens))
        self.kv.free(rid)
        self.live.remove(rid)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def lookup_has_no_side_effect(self, data):
        rid = data.draw(st.sampled_from(self.live))
        before = (self.kv.num_free_pages, self.kv.stats)
        self.kv.get_computed_tokens(rid)
        self.kv.next_checkpoint(rid)
        assert (self.kv.num_free_pages, self.kv.stats) == before

    @rule()
    def reset(self):
        self.kv.reset_prefix_cache()

    @invariant()
    def consistent(self):
        if hasattr(self, "kv"):
            self.shadow.check_all()

    def teardown(self):
        if hasattr(self, "kv"):
            for rid in self.live:
                self.kv.free(rid)
            self.kv.check_invariants()
            assert self.kv.num_free_pages == self.total, "pages leaked after freeing every request"


ManagerMachine.TestCase.settings = settings(max_examples=EXAMPLES, stateful_step_count=40, deadline=None,
                                            suppress_health_check=[HealthCheck.too_slow])
test_hybrid_manager_random_operations_keep_invariants = ManagerMachine.TestCase
