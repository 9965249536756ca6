"""Why a prefix missed (explain_hit, per-group stats), the coordinators by
name, and the two hits that memory held but the manager used to lose."""

from __future__ import annotations

import functools

import pytest

from hybridkv.core import HybridCoordinator, UnitaryCoordinator
from kv_shadow import FULL, MAMBA, window
from kv_shadow import manager as small_manager

manager = functools.partial(small_manager, block_size=16)


def run(kv, rid, tokens, chunk=None):
    """Add and compute a prompt, chunk by chunk, stopping at checkpoints."""
    kv.add_request(rid, tokens)
    while True:
        done = kv.get_computed_tokens(rid)
        if kv._requests[rid].started and done == len(tokens):
            return
        size = kv.next_chunk(rid, chunk or len(tokens))
        assert kv.allocate_slots(rid, size)
        kv.mark_computed(rid, size)


# -- the two lost hits ---------------------------------------------------------

def test_hit_after_appending_tokens_before_the_first_allocation_is_the_longest():
    # The repro: the remembered hit of 32 tokens was taken after a
    # token was appended, though 48 were valid by then.
    kv = manager({"f": FULL})
    run(kv, "a", list(range(64)))
    kv.add_request("r", list(range(48)))
    assert kv.get_computed_tokens("r") == 32  # 48 tokens: the last block is left to compute
    kv.append_token_ids("r", [48])
    assert kv.get_computed_tokens("r") == 48
    kv.add_request("fresh", list(range(49)))
    assert kv.get_computed_tokens("fresh") == 48
    assert kv.allocate_slots("r", 1)
    assert kv.num_computed_tokens("r") == 48
    kv.check_invariants()


@pytest.mark.parametrize("blocks", [2, 9])  # (9: blocks stored in one pass, core/block_cache.py)
def test_a_key_moves_to_a_live_copy_when_the_first_copy_is_evicted(blocks):
    # The repro: A and B computed the same blocks, A registered the
    # keys; A is freed and its blocks reused; B still holds the content.
    kv = manager({"f": FULL}, pages=2 * blocks + 4)
    tokens = list(range(16 * blocks + 1))
    for rid in ("A", "B"):  # both admitted before either computed: no hit
        kv.add_request(rid, tokens)
        assert kv.allocate_slots(rid, len(tokens))
    for rid in ("A", "B"):
        kv.mark_computed(rid, len(tokens))
    b_blocks = kv.get_page_tables("B")[0][:blocks]
    kv.free("A")
    kv.add_request("filler", [1000 + i for i in range(16 * kv.num_free_pages)])
    assert kv.allocate_slots("filler", 16 * kv.num_free_pages)  # every free page, A's included
    kv.check_invariants()
    kv.free("filler")  # never computed: its blocks hold nothing cached
    kv.add_request("C", tokens)
    assert kv.get_computed_tokens("C") == 16 * blocks
    assert kv.allocate_slots("C", 1)
    assert kv.get_page_tables("C")[0][:blocks] == b_blocks
    kv.check_invariants()
    stats = kv.stats
    assert stats.evictions_by_reason["lru"] == (0,)  # the content never left the cache


def test_a_copy_that_is_evicted_leaves_the_key_with_its_first_block():
    kv = manager({"f": FULL}, pages=8)
    tokens = list(range(33))
    for rid in ("A", "B"):
        kv.add_request(rid, tokens)
        assert kv.allocate_slots(rid, 33)
        kv.mark_computed(rid, 33) if rid == "B" else None
    kv.mark_computed("A", 33)  # B registered first this time; A's blocks are copies
    a_blocks = kv.get_page_tables("A")[0][:2]
    kv.free("B")
    kv.add_request("filler", [1000 + i for i in range(16 * kv.num_free_pages)])
    assert kv.allocate_slots("filler", 16 * kv.num_free_pages)
    kv.free("filler")
    kv.add_request("C", tokens)
    assert kv.get_computed_tokens("C") == 32
    assert kv.allocate_slots("C", 1) and kv.get_page_tables("C")[0][:2] == a_blocks
    kv.free("A"), kv.free("C")
    kv.check_invariants()
    assert kv.reset_prefix_cache() == 2  # two keys; the copies went with them
    kv.check_invariants()


# -- explain_hit -------------------------------------------------------------

def test_explain_hit_splits_what_no_cache_can_serve():
    kv = manager({"f": FULL})
    run(kv, "a", list(range(100)))
    kv.add_request("whole", list(range(64)))  # ends on a block boundary
    why = kv.explain_hit("whole")
    assert (why.prompt_tokens, why.hit_tokens, why.limit_tokens) == (64, 48, 48)
    assert (why.lost_to_block_rounding, why.lost_to_one_token_minimum) == (0, 16)
    assert why.missed_tokens == 0 and why.capping_groups == ()
    kv.add_request("tail", list(range(70)))
    why = kv.explain_hit("tail")
    assert (why.hit_tokens, why.limit_tokens, why.lost_to_block_rounding, why.lost_to_one_token_minimum) == (64, 64, 6, 0)


def test_explain_hit_names_the_group_that_capped_a_hybrid_hit():
    # Full attention has 64 tokens cached, the Mamba group a checkpoint only
    # at 32 (a shorter prompt's end): Mamba caps the hit at 32.
    kv = manager({"f": FULL, "m": MAMBA})
    run(kv, "short", list(range(40)))
    run(kv, "long", list(range(100)))  # checkpoints at 32 (where it leaves "short") and 96
    kv.free("short"), kv.free("long")
    prompt = list(range(64)) + [500] * 20
    kv.add_request("q", prompt)
    why = kv.explain_hit("q")
    kinds = {g.kind: g for g in why.groups}
    assert why.hit_tokens == kv.get_computed_tokens("q")
    assert kinds["full"].alone_tokens == 64
    assert kinds["mamba"].alone_tokens == why.hit_tokens < 64
    assert kinds["mamba"].capped and kinds["mamba"].without_tokens == 64
    assert not kinds["full"].capped and kinds["full"].without_tokens == why.hit_tokens
    assert why.capping_groups == (kinds["mamba"].group,)
    assert "capped the hit: 64 without it" in str(why)
    # After the first allocation it still describes the hit taken.
    before = why
    assert kv.allocate_slots("q", len(prompt) - why.hit_tokens)
    assert kv.explain_hit("q") == before
    stats = kv.stats
    assert stats.group_kinds[kinds["mamba"].group] == "mamba"
    assert stats.capped_tokens[kinds["mamba"].group] == 64 - why.hit_tokens
    assert stats.capped_tokens[kinds["full"].group] == 0


def test_explain_hit_hybrid_window_group_alone_serves_past_evicted_early_blocks():
    # A sliding window only needs the blocks under its window: after the
    # early blocks of a prompt are evicted, the window group alone still
    # serves the whole prefix, and full attention caps the hit.
    kv = manager({"f": FULL, "w": window(20)}, pages=40)
    run(kv, "a", list(range(96)))
    kv.free("a")
    req = kv._requests
    # Evict the first blocks of both groups by hand (the LRU would take the
    # last ones first): drop the keys of block 0 in every group.
    kv.add_request("probe", list(range(97)))
    kv.coordinator.extend_keys(req["probe"], 6)
    for g in range(2):
        block = kv.block_cache.cached[g][req["probe"].keys[0]]
        kv.block_cache.evict([block], "superseded")
    why = kv.explain_hit("probe")
    by_kind = {g.kind: g for g in why.groups}
    assert by_kind["sliding_window"].alone_tokens == 96
    assert by_kind["full"].alone_tokens == 0 == why.hit_tokens
    assert by_kind["full"].capped_tokens == 96
    assert kv.stats.evictions_by_reason["superseded"] == (1, 1)


def test_explain_hit_with_caching_off_says_so():
    kv = manager({"f": FULL}, enable_prefix_caching=False)
    kv.add_request("x", list(range(40)))
    why = kv.explain_hit("x")
    assert not why.caching and why.hit_tokens == 0 and why.limit_tokens == 0
    assert "prefix caching is off" in str(why)


def test_a_forked_child_explains_its_parents_hit():
    kv = manager({"f": FULL})
    run(kv, "a", list(range(50)))
    run(kv, "b", list(range(50)))
    kv.fork("b", "b-1")
    assert kv.explain_hit("b-1") == kv.explain_hit("b").__class__(**{**kv.explain_hit("b").__dict__,
                                                                     "request_id": "b-1"})


def test_unknown_request_in_explain_hit_is_a_value_error():
    kv = manager({"f": FULL})
    with pytest.raises(ValueError):
        kv.explain_hit("nope")


# -- eviction reasons ------------------------------------------------------------

def test_evictions_are_counted_per_group_by_reason():
    kv = manager({"f": FULL}, pages=6)
    run(kv, "a", list(range(80)))  # 5 blocks, all cached
    kv.free("a")
    run(kv, "b", [900 + i for i in range(48)])  # takes 3 free cached blocks
    assert kv.stats.evictions_by_reason["lru"] == (3,)
    assert kv.stats.evictions == 3
    kv.free("b")
    dropped = kv.reset_prefix_cache()
    assert kv.stats.evictions_by_reason["reset"] == (dropped,)
    assert kv.stats.evictions == 3  # resets are not evictions for reuse


def test_hybrid_probation_checkpoint_evictions_are_counted_apart():
    # The prompt-end Mamba checkpoint of a one-off prompt (32 of 40 tokens) is
    # released on probation once the request moves past it
    # (core/checkpoints.py): first to go, and counted as such.
    kv = manager({"f": FULL, "m": MAMBA}, pages=20)
    run(kv, "a", list(range(40)))
    kv.free("a")
    mamba = next(g.index for g in kv.layout.groups if g.kind == "mamba")
    blocks = kv.num_free_pages - 3
    kv.add_request("b", [700 + i for i in range(16 * blocks)])
    assert kv.allocate_slots("b", 16 * blocks)  # the free fresh pages, then the probation checkpoint
    counts = kv.stats.evictions_by_reason
    assert counts["probation"][mamba] == 1
    assert sum(counts["lru"]) == 0  # the full-attention blocks of "a" are still cached
    kv.check_invariants()


# -- the coordinators -----------------------------------------------------------

def test_one_group_gets_the_unitary_coordinator_and_hybrids_the_hybrid_one():
    assert type(manager({"f": FULL}).coordinator) is UnitaryCoordinator
    assert type(manager({"f": FULL, "w": window(8)}).coordinator) is HybridCoordinator
    assert type(manager({"f": FULL, "m": MAMBA}).coordinator) is HybridCoordinator


# -- what the pool caches, per group ------------------------------------------

def test_cached_keys_and_pages_list_what_each_group_can_serve():
    kv = manager({"w": window(32), "f": FULL, "m": MAMBA})
    run(kv, "a", list(range(64)), chunk=64)
    kinds = [g.kind for g in kv.layout.groups]
    for g in range(len(kinds)):
        keys = kv.cached_keys(g)
        pages = kv.cached_pages(g)
        assert sorted(keys) == sorted(key for key, _ in pages)
        assert all(len(p) == kv.layout.groups[g].pages_per_block and 0 not in p for _, p in pages)
    full = kinds.index("full")
    assert len(kv.cached_keys(full)) == 4  # every block of the prompt
    assert kv.cached_keys(kinds.index("mamba"))  # a checkpoint state at the end of the prompt
    assert sum(len(kv.cached_keys(g)) for g in range(len(kinds))) == kv.stats.cached_blocks
    kv.reset_prefix_cache()
    assert kv.cached_keys(full) == []
    with pytest.raises(ValueError, match="group must be an index"):
        kv.cached_keys(len(kinds))
