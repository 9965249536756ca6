"""The core's parts on their own: the page allocator, the block cache's one
place for keys, the request record's fork rule, the deprecated names."""

from __future__ import annotations

import dataclasses
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridkv.core import (BlockCache, ChunkedLocalSpec, FullAttentionSpec, KVCacheManager, MambaSpec, PageAllocator,
                           SlidingWindowSpec, plan_layout)
from hybridkv.core.request import INHERITED, NOT_INHERITED, CacheRequest


def test_every_request_field_is_inherited_at_a_fork_or_not_by_decision():
    names = {f.name for f in dataclasses.fields(CacheRequest)}
    assert set(INHERITED) | set(NOT_INHERITED) == names
    assert not set(INHERITED) & set(NOT_INHERITED)


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 10**6), widths=st.lists(st.integers(1, 5), min_size=1, max_size=3))
def test_allocated_blocks_never_share_a_page_and_take_exactly_their_width(seed, widths):
    # Blocks of several widths come and go (freed ones are reclaimed, whole
    # or taken apart): at every step each page is in at most one live block,
    # the null page in none, and the spare count is what is left.
    rng = random.Random(seed)
    num_pages = 40
    allocator = PageAllocator(num_pages)
    free: list[int] = []  # blocks given back, oldest first (the cache's queue)
    live: dict[int, int] = {}

    def reclaim(pages, want, reused):
        return sort_reclaimed(allocator, [free.pop(0) for _ in range(_blocks_for(allocator, free, pages))],
                              want, reused)

    for _ in range(30):
        if live and rng.random() < 0.4:
            block = rng.choice(list(live))
            del live[block]
            free.append(block)
            continue
        needs = [(w, rng.randint(0, 3)) for w in widths]
        asked = sum(w * c for w, c in needs)
        if asked > allocator.num_spare_pages + sum(allocator.width(b) for b in free):
            continue
        for (width, count), blocks in zip(needs, allocator.take(needs, reclaim)):
            assert len(blocks) == count
            for block in blocks:
                assert len(list(allocator.pages(block))) == width == allocator.width(block)
                live[block] = width
        seen: set[int] = set()
        for block in list(live) + free:
            pages = set(allocator.pages(block))
            assert 0 not in pages and not pages & seen
            seen |= pages
        assert len(seen) + allocator.num_spare_pages == num_pages - 1


def _blocks_for(allocator: PageAllocator, queue: list[int], pages: int) -> int:
    """How many blocks from the queue's head hold at least `pages` pages."""
    got = count = 0
    while got < pages:
        got += allocator.width(queue[count])
        count += 1
    return count


def sort_reclaimed(allocator: PageAllocator, blocks: list[int], want: dict, reused: dict) -> list[int]:
    """PageAllocator.take's rule for reclaimed blocks, block by block: one
    of a width `want` still counts goes whole to `reused`; the others are
    returned, in order, to be taken apart (BlockCache._reclaim does this as
    it takes them from its queue)."""
    apart = []
    for block in blocks:
        width = allocator.width(block)
        if want.get(width):
            want[width] -= 1
            reused[width].append(block)
        else:
            apart.append(block)
    return apart


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 10**6))
def test_reclaiming_sorts_the_queues_head_as_the_rule_does(seed):
    # BlockCache._reclaim pops the queue's head and sorts the blocks for
    # take in one pass: the same blocks, in the same order, as popping
    # first and sorting after (sort_reclaimed), the same keys evicted.
    rng = random.Random(seed)
    widths = [1, 3, 5]
    cache = BlockCache(200, 2)
    blocks = cache.allocate([(w, 12) for w in widths])
    everything = [b for group in blocks for b in group]
    group_of = {}
    for i, block in enumerate(everything):
        if rng.random() < 0.7:
            group_of[block] = i % 2
            cache.store(i % 2, [block], [f"k{block}"])
    rng.shuffle(everything)
    for block in everything[:30]:
        cache.release(block)
    queue = list(cache._free)
    free_pages = cache.num_free_pages
    pages = rng.randint(1, sum(cache.width(b) for b in queue))
    want = {w: rng.randint(0, 4) for w in widths}
    model_want, model_reused = dict(want), {w: [] for w in want}
    taken = queue[:_blocks_for(cache.allocator, queue, pages)]
    apart_model = sort_reclaimed(cache.allocator, taken, model_want, model_reused)
    keys_before = {b: cache.key[b] for b in taken}
    reused = {w: [] for w in want}
    apart = cache._reclaim(pages, want, reused)
    assert (apart, reused, want) == (apart_model, model_reused, model_want)
    assert list(cache._free) == queue[len(taken):]
    for block in taken:
        assert cache.key[block] is None
        assert keys_before[block] is None or keys_before[block] not in cache.cached[0] | cache.cached[1]
    assert cache.evictions["lru"] == [sum(1 for b in taken if group_of.get(b) == g) for g in range(2)]
    assert cache.num_free_pages == free_pages - sum(cache.width(b) for b in taken)


def test_a_key_leaves_the_map_only_through_evict_and_moves_to_a_live_copy():
    cache = BlockCache(10, 1)
    a, b = cache.allocate([(1, 2)])[0]
    assert cache.store(0, [a], ["k"]) == 1
    assert cache.store(0, [b], ["k"], keep_copies=True) == 0  # b: a copy of a's content
    version = cache.version
    cache.release(a)
    cache.evict([a], "lru")
    assert cache.cached[0] == {"k": b} and cache.version > version  # the key moved to the copy
    cache.evict([b], "superseded")
    assert cache.cached[0] == {} and cache.evictions["superseded"] == [1]
    cache.release(b)
    cache.check_invariants({})


def test_old_page_counting_names_still_answer_with_a_deprecation_warning():
    layout = plan_layout({"l0": FullAttentionSpec(1, 8, "float32")}, 64 * 1024, block_size=4)
    kv = KVCacheManager(layout)
    kv.add_request("a", [1, 2, 3, 4, 5])
    assert kv.allocate_slots("a", 5)
    with pytest.warns(DeprecationWarning):
        assert kv.num_free_blocks == kv.num_free_pages
    with pytest.warns(DeprecationWarning):
        assert kv.num_total_blocks == kv.num_total_pages
    with pytest.warns(DeprecationWarning):
        assert kv.get_block_tables("a") == kv.get_page_tables("a")
    with pytest.warns(DeprecationWarning):
        assert layout.num_blocks == layout.num_pages


def test_state_pages_are_asked_by_group_not_by_layer_kind():
    specs = {"a": FullAttentionSpec(1, 8, "float32"), "m": MambaSpec(shapes=((4, 3), (4, 8)),
                                                                      dtypes=("float32", "float32"))}
    layout = plan_layout(specs, 1 << 20, block_size=4)
    kv = KVCacheManager(layout)
    kv.add_request("a", list(range(1, 10)))
    assert kv.allocate_slots("a", 9)
    recurrent = [g.index for g in layout.groups if g.recurrent]
    states = kv.get_state_pages("a")
    assert sorted(states) == recurrent
    read, write = states[recurrent[0]]
    assert read is None and write and list(write) == kv.get_page_tables("a")[recurrent[0]]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 2), st.integers(1, 90), st.integers(0, 40), st.booleans()),
                min_size=1, max_size=10), st.sampled_from([None, "tenant-a"]))
def test_keys_taken_from_recent_chains_equal_freshly_hashed_ones(turns, salt):
    # A prompt opening like a recent one (a chat's next turn, a shared
    # system prompt, one that leaves it inside a block) takes the common
    # blocks' keys from that request's chain (hashing.KnownChains): they
    # must be the keys hashing it afresh gives, under its own salt.
    from hybridkv.core.hashing import BlockHasher

    bs = 4
    layout = plan_layout({"a": FullAttentionSpec(1, 8, "float32"),
                          "m": MambaSpec(shapes=((4, 3), (4, 8)), dtypes=("float32", "float32"))}, 1 << 20,
                         block_size=bs)
    kv = KVCacheManager(layout)
    rng = random.Random(len(turns))
    bases = [[rng.randrange(100) for _ in range(90)] for _ in range(3)]
    history: list[int] = []
    for i, (base, cut, answer, continue_chat) in enumerate(turns):
        prompt = history + [7, i] if continue_chat and history else bases[base][:cut] + [200 + i]
        rid = f"r{i}"
        kv.add_request(rid, prompt, cache_salt=salt if i % 2 else None)
        assert kv.allocate_slots(rid, len(prompt) - kv.get_computed_tokens(rid))
        kv.mark_computed(rid, len(prompt) - kv.num_computed_tokens(rid))
        for t in range(answer):  # decoding: the answer's blocks get keys too
            kv.append_token_ids(rid, [300 + t])
            assert kv.allocate_slots(rid, 1)
            kv.mark_computed(rid, 1)
        tokens = kv.token_ids(rid)
        fresh: list = []
        hasher = BlockHasher()
        hasher.extend(fresh, hasher.root(salt if i % 2 else None), tokens, bs, len(tokens) // bs)
        assert kv.block_keys(rid, 0, len(tokens)) == fresh
        kv.free(rid)
        history = tokens


def test_a_recent_chain_is_taken_only_as_far_as_its_tokens_agree():
    # KnownChains.seed skips comparing a chain's tokens where the chain holds
    # the very key object of the best chain so far (one request took its
    # keys from the other's chain); a chain with equal-looking later blocks
    # but other tokens earlier, and keys of its own, must not be taken.
    import hashlib

    from hybridkv.core.hashing import KnownChains, token_bytes

    def keys_of(name, n):
        return [hashlib.sha256(f"{name}{j}".encode()).digest() for j in range(n)]

    chains = KnownChains(block_size=1)
    newer, older = keys_of("a", 4), keys_of("b", 6)
    chains.remember("root", token_bytes([1, 9, 3, 4, 5, 6]), older)
    chains.remember("root", token_bytes([1, 2, 3, 7]), newer)
    keys: list = []
    chains.seed(keys, "root", token_bytes([1, 2, 3, 4, 5]))
    assert keys == newer[:3] and all(k is n for k, n in zip(keys, newer))  # the older chain parts at block 1

    taken = newer[:3] + keys_of("c", 3)  # took the newer chain's keys, then went on: agrees with it on 3 blocks
    chains.remember("root", token_bytes([1, 2, 3, 4, 5, 6]), taken)
    chains.remember("root", token_bytes([1, 2, 3, 7]), newer)  # newest again: it is asked first
    keys = []
    chains.seed(keys, "root", token_bytes([1, 2, 3, 4, 5]))
    assert keys == taken[:5]


def test_a_recurrent_scan_answers_rfind_like_the_whole_mask():
    # A recurrent group's scan looks its keys up lazily, backwards from the
    # bound a search asks about (managers/mamba.py); every search must give
    # what bytes.rfind gives over the mask of all positions.
    from hybridkv.core.managers.mamba import _Checkpoints

    rng = random.Random(0)
    for _ in range(300):
        limit = rng.randint(0, 90)
        keys = [f"k{j}" for j in range(limit + 5)]
        cached = {k: j + 1 for j, k in enumerate(keys) if rng.random() < rng.choice([0.02, 0.2, 0.7])}
        mask = bytes(k in cached for k in keys[:limit])
        scan = _Checkpoints(cached, keys, limit)
        for _ in range(6):  # one scan answers several searches, as the fixed point asks
            end = rng.randint(0, limit)
            start = rng.randint(0, end)
            assert scan.rfind(1, start, end) == mask.rfind(1, start, end)
        assert all(scan[j] == cached.get(keys[j]) for j in range(limit))


def test_adjacent_blocks_taken_apart_make_one_run_for_a_wide_block():
    # A request's blocks leave the free queue together, last first; taken
    # apart for a wider block, adjacent ones join one spare run, so the wide
    # block is one run of pages rather than a piece per freed block.
    pages = PageAllocator(9)
    narrow = pages.take([(1, 8)], lambda need, want, reused: [])[0]
    assert narrow == list(range(1, 9))
    wide = pages.take([(8, 1)], lambda need, want, reused: sort_reclaimed(pages, narrow[::-1], want, reused))[0][0]
    assert pages.runs[wide] is None and list(pages.pages(wide)) == list(range(1, 9))
    wide_again = PageAllocator(9)
    blocks = wide_again.take([(1, 8)], lambda need, want, reused: [])[0]
    # freed first to last: joins too
    wide = wide_again.take([(8, 1)], lambda need, want, reused: sort_reclaimed(wide_again, blocks, want, reused))[0][0]
    assert wide_again.runs[wide] is None


def test_a_checkpoint_on_probation_keeps_its_lru_place_for_its_grace_then_goes_first():
    # A prompt-end checkpoint released on probation stays in LRU order while
    # less than an eighth of the pool's pages has been released after it (a
    # prompt sent again soon still finds it), then is the first to go.
    from hybridkv.core.block_cache import BlockCache

    cache = BlockCache(num_pages=33, num_groups=1)  # 32 usable pages; a grace of 33 // 8 = 4 pages
    blocks = cache.allocate([(1, 32)])[0]
    cache.store(0, blocks, [bytes([i]) * 32 for i in range(32)])
    cache.release(blocks[0])
    cache.release(blocks[1])
    cache.release(blocks[2], probation=True)
    assert cache.allocate([(1, 1)]) == [[blocks[0]]]  # within its grace: the oldest block goes
    for block in blocks[3:6]:
        cache.release(block)  # 3 pages after it: still within its grace
    assert cache.allocate([(1, 1)]) == [[blocks[1]]]
    cache.release(blocks[6])  # the 4th: its grace is over
    assert cache.allocate([(1, 1)]) == [[blocks[2]]]  # first, before the older blocks 3 to 6
    assert cache.evictions["probation"] == [1] and cache.evictions["lru"] == [2]


def _pool_state(cache: BlockCache) -> tuple:
    """What a block cache can be seen to hold: the free queue in order, the
    key maps and their copies, references, counters, the spare pages."""
    return (list(cache._free.items()), [dict(t) for t in cache.cached],
            [{k: list(v) for k, v in c.items()} for c in cache.copies], list(cache.ref), list(cache.key),
            {r: list(n) for r, n in cache.evictions.items()}, list(cache.allocator._spare),
            cache.num_free_pages)


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10**6), policy=st.sampled_from(["hybridkv", "every_block"]))
def test_evicting_inline_leaves_the_pool_as_evicting_in_queue_order_does(seed, policy):
    # Without a tier or events, _reclaim drops keys as the queue gives up
    # their blocks; with events on, evict drops them after the loop, in
    # queue order (what the events report). Nothing else may differ.
    bs = 4
    layout = plan_layout({"a": FullAttentionSpec(1, 8, "float32"),
                          "w": SlidingWindowSpec(1, 8, "float32", sliding_window=9),
                          "m": MambaSpec(shapes=((4, 3), (4, 8)), dtypes=("float32", "float32"))}, 1 << 14,
                         block_size=bs)
    quiet, loud = KVCacheManager(layout, checkpoint_policy=policy), \
        KVCacheManager(layout, checkpoint_policy=policy, enable_kv_events=True)
    rng = random.Random(seed)
    prefixes = [[rng.randrange(50) for _ in range(40)] for _ in range(3)]
    running: list[str] = []
    for i in range(60):
        if running and (rng.random() < 0.4 or len(running) > 6):
            rid = running.pop(rng.randrange(len(running)))
            for kv in (quiet, loud):
                kv.free(rid)
            continue
        prompt = prefixes[rng.randrange(3)][:rng.randrange(1, 40)] + [rng.randrange(50) for _ in range(8)]
        rid = f"r{i}"
        fits = []
        for kv in (quiet, loud):
            kv.add_request(rid, prompt)
            fits.append(kv.allocate_slots(rid, len(prompt) - kv.get_computed_tokens(rid)))
        assert fits[0] == fits[1]
        if not fits[0]:
            for kv in (quiet, loud):
                kv.free(rid)
            continue
        answer = rng.randrange(12)
        for kv in (quiet, loud):
            kv.mark_computed(rid, len(prompt) - kv.num_computed_tokens(rid))
            for t in range(answer):
                kv.append_token_ids(rid, [t])
                if not kv.allocate_slots(rid, 1):
                    break
                kv.mark_computed(rid, 1)
        running.append(rid)
        assert _pool_state(quiet.block_cache) == _pool_state(loud.block_cache)
    quiet.check_invariants()
    assert sum(quiet.block_cache.evictions["lru"])  # (the pool filled: blocks were reclaimed)


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 10**6))
def test_releasing_a_table_at_once_is_releasing_its_blocks_one_by_one(seed):
    # release_all sums the pages once and writes no probation stamps: the
    # queue, the counts and the pages released must be release's.
    rng = random.Random(seed)
    caches = [BlockCache(64, 1) for _ in range(2)]
    for cache in caches:
        cache.allocator.take([(1, 3)], cache._reclaim)  # (the same ids in both)
    tables = []
    for _ in range(4):
        count = rng.randrange(1, 6)
        blocks = [cache.allocate([(1, count)])[0] for cache in caches]
        assert blocks[0] == blocks[1]
        tables.append(blocks[0])
    for cache in caches:  # some blocks shared, some cached
        for table in tables[:2]:
            cache.touch_all(table)
        cache.store(0, tables[1], [f"k{b}" for b in tables[1]])
    for table in tables + tables[:2]:
        table = [0] + table[::-1]  # (a null entry, as a window leaves them)
        caches[0].release_all(table)
        for block in table:
            if block:
                caches[1].release(block)
        assert (_pool_state(caches[0]), caches[0]._released_pages) == \
            (_pool_state(caches[1]), caches[1]._released_pages)


def test_free_pages_in_counts_the_free_blocks_of_a_table_once_each():
    cache = BlockCache(40, 1)
    a, b, c = cache.allocate([(2, 1), (3, 1), (1, 1)])
    for block in a + b:
        cache.release(block)
    table = [0, 0] + a + b + c
    assert cache.free_pages_in(table) == sum(cache.width(x) for x in table if x and not cache.ref[x]) == 5
    assert cache.free_pages_in(c) == 0


@given(st.lists(st.integers(0, 2**40), min_size=0, max_size=64), st.integers(1, 8), st.integers(1, 5))
def test_a_decode_steps_block_is_keyed_as_a_prompts_blocks_are(tokens, block_size, step):
    # Fewer than _NATIVE_FROM blocks at a time are packed by struct and
    # hashed by hashlib; a prompt's run by hash_chain.c where built: one chain.
    from hybridkv.core.hashing import BlockHasher

    hasher = BlockHasher()
    root = hasher.root()
    whole: list = []
    hasher.extend(whole, root, tokens, block_size, len(tokens) // block_size)
    stepwise: list = []
    for upto in range(0, len(tokens) // block_size + step, step):
        hasher.extend(stepwise, root, tokens, block_size, min(upto, len(tokens) // block_size))
    assert stepwise == whole


def test_a_group_skips_release_work_only_where_its_rule_never_releases():
    # AttentionManager.releases (full attention: False) lets the slow paths
    # skip the release arithmetic: it must agree with the read rule.
    layout = plan_layout({"a": FullAttentionSpec(1, 8, "float32"),
                          "w": SlidingWindowSpec(1, 8, "float32", sliding_window=9),
                          "c": ChunkedLocalSpec(1, 8, "float32", chunk_size=8)}, 1 << 14, block_size=4)
    for manager in KVCacheManager(layout).coordinator.managers:
        assert manager.releases == any(manager.spec.first_visible(n) > 0 for n in range(64)), manager.kind


def test_freeing_a_windowed_request_releases_what_releasing_its_whole_table_does():
    # AttentionManager.free skips the null entries before num_released
    # (check_invariants holds that they are null): the pool must end as
    # releasing every entry of the table, last first, leaves it.
    layout = plan_layout({"a": FullAttentionSpec(1, 8, "float32"),
                          "w": SlidingWindowSpec(1, 8, "float32", sliding_window=9)}, 1 << 14, block_size=4)
    kvs = [KVCacheManager(layout) for _ in range(2)]
    for kv in kvs:
        for rid, prompt in (("a", list(range(1, 30))), ("b", list(range(1, 20)) + [7] * 9)):
            kv.add_request(rid, prompt)
            assert kv.allocate_slots(rid, len(prompt) - kv.get_computed_tokens(rid))
            kv.mark_computed(rid, len(prompt) - kv.num_computed_tokens(rid))
        for t in range(6):
            kv.append_token_ids("a", [t])
            assert kv.allocate_slots("a", 1)
            kv.mark_computed("a", 1)
        kv.check_invariants()
    req = kvs[1]._requests["a"]
    assert req.num_released[1] > 0 and req.tables[1][0] == 0  # (the window left blocks behind)
    kvs[0].free("a")
    for manager in kvs[1].coordinator.managers:
        kvs[1].block_cache.release_all(req.tables[manager.index][::-1])
        req.tables[manager.index] = []
    del kvs[1]._requests["a"]
    assert _pool_state(kvs[0].block_cache) == _pool_state(kvs[1].block_cache)
    for kv in kvs:
        kv.check_invariants()
