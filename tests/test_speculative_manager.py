"""The manager under speculative decoding: lookahead slots reserved all or
nothing, and after verification only accepted tokens count.
No block holding a rejected draft is cached, blocks holding only rejected
drafts go back to the pool, window releases follow the accepted position, and
a Mamba state is carried on and checkpointed only after accepted tokens."""

from __future__ import annotations

import random

import pytest

from hybridkv.core import KVCacheManager
from kv_shadow import FULL, MAMBA, MIXES, ShadowRunner, layer_specs, layout_for_requests, manager, random_workload, window


def started(kv, rid, prompt):
    shadow = ShadowRunner(kv)
    kv.add_request(rid, prompt)
    assert shadow.run_prompt(rid)
    return shadow


@pytest.mark.parametrize("mix", sorted(MIXES))
def test_hybrid_speculative_random_workload_reads_only_accepted_tokens(mix):
    kv = KVCacheManager(layout_for_requests(layer_specs(MIXES[mix]), 4, 40))
    counts = random_workload(kv, random.Random(f"spec-{mix}"), num_ops=1200, speculative=True)
    assert counts["speculated"] > 50 and 0 < counts["accepted"] < counts["drafts"]
    assert counts["hits"] > 0


def test_lookahead_is_all_or_nothing():
    kv = manager({"f": FULL}, pages=4)  # 3 usable pages of 4 tokens
    started(kv, "a", list(range(5)))  # 2 blocks
    kv.append_token_ids("a", [9])
    free, tables = kv.num_free_pages, kv.get_page_tables("a")
    assert not kv.allocate_slots("a", 1, num_lookahead=7)  # needs 3 blocks more
    assert (kv.num_free_pages, kv.get_page_tables("a")) == (free, tables)
    assert kv.allocate_slots("a", 1, num_lookahead=6)  # 12 slots: one block more
    assert len(kv.get_page_tables("a")[0]) == 3


def test_blocks_holding_only_rejected_drafts_go_back_and_nothing_rejected_is_cached():
    kv = manager({"f": FULL})
    shadow = started(kv, "a", list(range(6)))
    free = kv.num_free_pages
    cached = kv.stats.cached_blocks
    kv.append_token_ids("a", [50])
    assert kv.allocate_slots("a", 1, num_lookahead=6)  # tokens 6..12: blocks 1, 2, 3
    assert len(kv.get_page_tables("a")[0]) == 4
    shadow.speculate("a", [60, 61, 62, 63, 64, 65], accepted=1, bonus=70)  # 8 computed
    assert kv.num_computed_tokens("a") == 8 and kv.token_ids("a")[6:] == [50, 60, 70]
    assert len(kv.get_page_tables("a")[0]) == 2  # block 2 held only rejected drafts
    assert kv.num_free_pages == free  # block 1 was already held
    assert kv.stats.cached_blocks == cached + 1  # block 1 (tokens 4..7) is all accepted
    # The next step writes over the rejected slots; a rejected draft's block
    # never becomes findable: a prompt with the drafts does not hit on it.
    kv.add_request("probe", list(range(6)) + [50, 60, 61, 62, 63, 99])
    assert kv.get_computed_tokens("probe") == 8
    shadow.check_all()


def test_a_block_is_cached_only_once_all_its_tokens_are_accepted():
    kv = manager({"f": FULL})
    shadow = started(kv, "a", list(range(5)))
    before = kv.stats.cached_blocks
    kv.append_token_ids("a", [10])
    assert kv.allocate_slots("a", 1, num_lookahead=3)  # slots 5..8, block 1 would fill
    shadow.speculate("a", [11, 12, 13], accepted=1, bonus=20)  # 7 computed: block 1 is not full
    assert kv.stats.cached_blocks == before
    assert kv.allocate_slots("a", 1, num_lookahead=2)
    shadow.speculate("a", [21, 22], accepted=2, bonus=30)  # 10 computed: block 1 is
    assert kv.stats.cached_blocks == before + 1
    shadow.check_all()


def test_sliding_window_releases_follow_the_accepted_position():
    # Window 5, blocks of 4: after n computed tokens the request needs
    # [n - 4, n). Drafts never push a block out: rejecting all of them
    # leaves the table a plain one-token step would leave.
    spec = {"w": window(5)}
    plain, spec_kv = manager(spec), manager(spec)
    shadows = [started(kv, "a", list(range(7))) for kv in (plain, spec_kv)]
    for kv in (plain, spec_kv):
        kv.append_token_ids("a", [40])
    assert plain.allocate_slots("a", 1)
    plain.mark_computed("a", 1)
    shadow = shadows[1]
    assert spec_kv.allocate_slots("a", 1, num_lookahead=8)  # drafts up to position 16
    shadow.speculate("a", list(range(80, 88)), accepted=0, bonus=41)
    held = [[b != 0 for b in kv.get_page_tables("a")[0]] for kv in (plain, spec_kv)]
    assert held[0] == held[1] == [False, True]  # [4, 8) is still read; block 0 left the window
    assert spec_kv.stats.released_pages == plain.stats.released_pages
    shadow.check_all()


def test_hybrid_mamba_state_is_checkpointed_only_after_accepted_tokens():
    # Rolling checkpoints past the prompt sit at block boundaries; an
    # engine ends a speculative step there (next_checkpoint), and the state
    # at the boundary is cached only when every draft up to it was accepted.
    kv = manager({"f": FULL, "m": MAMBA})
    shadow = started(kv, "a", list(range(5)))
    kv.append_token_ids("a", [10])
    assert kv.next_checkpoint("a") == 8
    assert kv.allocate_slots("a", 1, num_lookahead=2)  # positions 5, 6, 7: ends at 8
    cached = kv.stats.cached_blocks
    shadow.speculate("a", [11, 12], accepted=1, bonus=13)  # 7 computed
    assert kv.stats.cached_blocks == cached  # no state at 8 yet
    assert kv.next_checkpoint("a") == 8
    assert kv.allocate_slots("a", 1, num_lookahead=0)
    shadow.speculate("a", [], accepted=0, bonus=14)  # 8 computed: the rolling checkpoint
    mamba = next(g.index for g in kv.layout.groups if g.kind == "mamba")
    assert any(kv.block_cache.key_group[b] == mamba for b in kv.block_cache.cached[mamba].values())
    shadow.check_all()  # the cached state is the state after the accepted 8 tokens
    kv.add_request("next-turn", kv.token_ids("a")[:8] + [99, 98])
    assert kv.get_computed_tokens("next-turn") == 8


def test_marking_drafts_computed_before_appending_them_is_an_error():
    kv = manager({"f": FULL})
    started(kv, "a", list(range(5)))
    kv.append_token_ids("a", [10])
    assert kv.allocate_slots("a", 1, num_lookahead=3)
    with pytest.raises(ValueError, match="append the accepted draft tokens first"):
        kv.mark_computed("a", 3)
    kv.append_token_ids("a", [11, 12])
    kv.mark_computed("a", 3)
    assert kv.num_computed_tokens("a") == 8
    kv.fork("a", "b")  # between steps again: the lookahead slots are gone
    kv.free("a"), kv.free("b")
    kv.check_invariants()


def test_allocate_slots_many_with_lookahead_is_all_or_nothing_per_request():
    kv = manager({"f": FULL}, pages=8)
    for rid in ("a", "b"):
        started(kv, rid, list(range(rid == "a" and 3 or 4)))
        kv.append_token_ids(rid, [7])
    assert kv.allocate_slots_many(["a", "b"], 1, num_lookahead=4) == 2
    with pytest.raises(ValueError):
        kv.allocate_slots("a", 1, num_lookahead=-1)
