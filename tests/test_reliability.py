"""Reliability and security: overload, aborts, bad input, broken models,
tenant isolation, colliding hashes. Nothing lost, nothing leaked."""

from __future__ import annotations

import random

import pytest

from hybridkv import Engine, SamplingParams
from hybridkv.core import FullAttentionSpec, KVCacheManager, SlidingWindowSpec
from hybridkv.tiny_models import tiny_model_dir
from kv_shadow import MIXES, ShadowRunner, layer_specs, layout_for_requests, layout_with_pages, random_workload

MODELS = ["tiny-gemma3", "tiny-jamba"]




def assert_idle(engine):
    assert not engine.has_unfinished_requests()
    assert engine.kv.num_free_pages == engine.kv.num_total_pages, "blocks leaked"
    engine.kv.check_invariants()


# -- overload -------------------------------------------------------------------

@pytest.mark.parametrize("name", MODELS)
def test_hybrid_overload_200_requests_in_a_pool_for_10(name):
    path = tiny_model_dir(name)
    rng = random.Random(1)
    system = [rng.randrange(10, 900) for _ in range(24)]
    prompts = [(system if i % 2 else []) + [rng.randrange(10, 900) for _ in range(rng.randint(8, 40))]
               for i in range(200)]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    ample = Engine(path, kv_cache_memory="64MiB", max_num_seqs=256, max_num_batched_tokens=4096, progress=False)
    expected = [o.outputs[0].token_ids for o in ample.generate(prompts, params, use_tqdm=False)]
    probe = ample.layout
    pages = 10 * probe.pages_per_request(80, chunk=256) + 1
    tight = Engine(path, kv_cache_memory=pages * probe.page_size_bytes, max_num_seqs=256,
                   max_num_batched_tokens=256, progress=False)
    got = [o.outputs[0].token_ids for o in tight.generate(prompts, params, use_tqdm=False)]
    assert got == expected
    assert tight.stats["preemptions"] > 0
    assert_idle(tight)


# -- aborts ---------------------------------------------------------------------

@pytest.mark.parametrize("name", MODELS)
def test_hybrid_aborts_at_every_stage_give_every_block_back(name):
    path = tiny_model_dir(name)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    bystanders = [[5, 6, 7, 8, 9], [11, 12, 13]]
    solo = Engine(path, kv_cache_memory="16MiB", progress=False)
    expected = [o.outputs[0].token_ids for o in solo.generate(bystanders, params, use_tqdm=False)]

    engine = Engine(path, kv_cache_memory="16MiB", max_num_batched_tokens=24, max_num_seqs=3, progress=False)
    keep = [engine.add_request(p, params) for p in bystanders]
    long_prompt = list(range(20, 120))  # several chunks of 24
    waiting = engine.add_request([1, 2, 3], params)  # max_num_seqs=3: still waiting after step 1
    prefill = engine.add_request(long_prompt, params)
    decode = engine.add_request([30, 31, 32, 33], SamplingParams(temperature=0, max_tokens=40, n=2, seed=3))
    engine.abort(waiting)
    engine.step()
    assert prefill in engine.requests and engine.kv.num_computed_tokens(
        engine.requests[prefill].sequences[0].seq_id) < len(long_prompt)
    engine.abort(prefill)  # between prefill chunks
    outs = {}
    for _ in range(200):
        for out in engine.step():
            outs[out.request_id] = out
        request = engine.requests.get(decode)
        if request is not None and len(request.sequences) == 2 and request.sequences[1].num_outputs >= 3:
            engine.abort(decode)  # mid-decode, parent and forked child
            break
    else:
        pytest.fail("the n=2 request never reached decode")
    outs.update(engine.drain())
    with pytest.raises(ValueError, match="unknown request id"):
        engine.abort(keep[0])  # after finishing
    assert [outs[k].outputs[0].token_ids for k in keep] == expected
    assert_idle(engine)


def test_forked_children_freed_before_the_parent_leak_nothing():
    specs = layer_specs(MIXES["full+window+mamba"])
    kv = KVCacheManager(layout_for_requests(specs, 6, 32))
    shadow = ShadowRunner(kv)
    kv.add_request("p", list(range(1, 22)))
    assert shadow.run_prompt("p")
    for i in range(3):
        kv.fork("p", f"c{i}")
        assert shadow.decode(f"c{i}", 40 + i)
    for i in range(3):
        kv.free(f"c{i}")
        shadow.check_all()
    assert shadow.decode("p", 7)
    kv.free("p")
    kv.check_invariants()
    assert kv.num_free_pages == kv.num_total_pages


# -- broken models and odd input ----------------------------------------------------

def test_non_finite_logits_fail_one_request_not_the_loop():
    engine = Engine(tiny_model_dir("tiny-gemma3"), kv_cache_memory="16MiB", progress=False)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    good = engine.add_request([5, 6, 7], params)
    bad = engine.add_request([8, 9, 10, 11], params)
    compute = engine.model.compute_logits
    state = {"steps": 0}

    def broken(hidden):
        logits = compute(hidden)
        state["steps"] += 1
        if state["steps"] == 3 and logits.shape[0] > 1:
            logits[1] = float("nan")  # the second row of the third step
        return logits

    engine.model.compute_logits = broken
    outs = engine.drain()
    assert outs[good].outputs[0].finish_reason == "length" and len(outs[good].outputs[0].token_ids) == 6
    assert outs[bad].outputs[0].finish_reason == "error"
    assert_idle(engine)


def test_random_bytes_through_the_tokenizer():
    engine = Engine(tiny_model_dir("tiny-gemma3"), kv_cache_memory="16MiB", progress=False)
    rng = random.Random(5)
    prompts = [bytes(rng.randrange(256) for _ in range(rng.randint(1, 60))).decode("utf-8", errors="replace")
               for _ in range(20)]
    prompts += ["\x00", "\ud7ff" * 3, "🙂" * 10, " ", "\n\n\t"]
    outs = engine.generate(prompts, SamplingParams(temperature=0.7, seed=1, max_tokens=4), use_tqdm=False)
    assert all(o.finished for o in outs)
    assert_idle(engine)


# -- tenant isolation ----------------------------------------------------------------

def test_hybrid_cache_salt_isolates_tenants_in_the_engine():
    engine = Engine(tiny_model_dir("tiny-jamba"), kv_cache_memory="16MiB", progress=False, block_size=16)
    prompt = list(range(40, 90))
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)

    def run(salt):
        rid = engine.add_request(prompt, params, cache_salt=salt)
        return engine.drain()[rid]

    first = run("tenant-a")
    other = run("tenant-b")
    again = run("tenant-a")
    assert first.metrics.num_cached_tokens == 0
    assert other.metrics.num_cached_tokens == 0  # same prompt, other tenant: nothing shared
    assert again.metrics.num_cached_tokens > 0
    assert first.outputs[0].token_ids == other.outputs[0].token_ids == again.outputs[0].token_ids


def _one_key_per_depth(parent: bytes, data: bytes) -> bytes:
    """A deliberately colliding hash: ignores the block's tokens, so every
    block at the same depth of every prompt gets the same key."""
    return bytes(reversed(parent[:8])) + b"."


def test_colliding_hash_is_caught_by_the_stored_token_check():
    specs = {"f": FullAttentionSpec(num_kv_heads=1, head_size=4, dtype="float32")}
    kv = KVCacheManager(layout_with_pages(specs, 64, block_size=4), hash_function=_one_key_per_depth)
    shadow = ShadowRunner(kv)
    kv.add_request("a", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    assert shadow.run_prompt("a")
    kv.add_request("b", [9, 9, 9, 9, 5, 6, 7, 8, 1])  # same keys at every depth, other tokens
    assert kv.get_computed_tokens("b") == 0
    assert shadow.run_prompt("b")
    kv.add_request("c", [1, 2, 3, 4, 5, 6, 7, 8, 2])  # really the same prefix: still hits
    assert kv.get_computed_tokens("c") == 8
    shadow.check_all()


@pytest.mark.parametrize("mix", ["full", "full+window", "full+mamba", "mamba"])
def test_colliding_hash_under_a_random_workload_serves_no_foreign_kv(mix):
    layout = layout_for_requests(layer_specs(MIXES[mix]), num_requests=3, num_tokens=16)
    kv = KVCacheManager(layout, hash_function=lambda parent, data: b"collide")
    counts = random_workload(kv, random.Random(mix), num_ops=600)
    assert counts["computed"] > 100


def test_without_a_collision_resistant_hash_a_window_hit_can_be_foreign():
    """Why SHA-256 is the default: with the token-blind hash, a sliding-window
    hit needs only the window's blocks, whose own tokens match, so the stored
    token check cannot see that their prefix differed; the shadow runner
    catches the foreign KV. With SHA-256 the same requests share nothing."""
    specs = {"w": SlidingWindowSpec(num_kv_heads=1, head_size=4, dtype="float32", sliding_window=4)}

    def run(hash_function):
        kv = KVCacheManager(layout_with_pages(specs, 64, block_size=4), hash_function=hash_function)
        shadow = ShadowRunner(kv)
        kv.add_request("a", [1, 1, 1, 1, 7, 7, 7, 7, 3])
        assert shadow.run_prompt("a")
        kv.add_request("b", [2, 2, 2, 2, 7, 7, 7, 7, 3])  # other prefix, same second block
        shadow.run_prompt("b")
        return kv

    with pytest.raises(AssertionError, match="foreign KV"):
        run(_one_key_per_depth)
    assert run("sha256").stats.hit_tokens == 0


# -- the property soak (pytest -m soak) ----------------------------------------------------

@pytest.mark.soak
@pytest.mark.parametrize("mix", sorted(MIXES))
def test_soak_one_million_operations(mix):
    """10^6 operations over all mixes (125,000 each), checked after every one."""
    layout = layout_for_requests(layer_specs(MIXES[mix]), num_requests=3, num_tokens=16)
    kv = KVCacheManager(layout)
    counts = random_workload(kv, random.Random(f"soak-{mix}"), num_ops=125_000)
    print(f"\nsoak {mix}: {dict(counts)}")
    assert counts["checks"] == 125_000
