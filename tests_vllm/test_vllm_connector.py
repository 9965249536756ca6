"""hybridkv's KV connector inside real vLLM (CPU build), on a tiny random
Gemma-3 (five sliding-window layers, window 32, one full-attention layer;
six KV cache groups of one layer each, blocks of 32 tokens).

A "cold" run is the same prompt on an engine with nothing cached. A run
served by the tiers computes only the prompt's tail, as a run served by
vLLM's own prefix cache does; its tokens equal the cold run's and its
logprobs match within float rounding (the tail's attention is computed in
another shape), and equal the pool-served run's exactly: the tiers give
back the very bytes the pool held.
"""

from __future__ import annotations

import glob
import os
import shutil

import pytest
from conftest import max_logprob_diff

PROMPT = [(7 * i) % 500 + 3 for i in range(200)]  # 6 whole blocks, a window of 32
CLOSE = 1e-4
# A pool of 64 blocks (about two 150-token requests across the six groups):
# what the free queue evicts next is within the connector's look-ahead.
SMALL_POOL = {"blocks": 64, "max_model_len": 256, "max_num_batched_tokens": 256}


def assert_same(run, cold, pool=None):
    assert run[0] == cold[0]
    assert max_logprob_diff(run[1], cold[1]) < CLOSE
    if pool is not None:
        assert run[0] == pool[0] and run[1] == pool[1]


def test_host_tier_serves_every_group_after_the_pool_forgot(serve, tiny_gemma3):
    vllm = serve(tiny_gemma3, {"host_memory": "64MiB"})
    cold = vllm.generate(PROMPT)
    assert cold[2] == 0
    # Stored at finish: the full group's six blocks, each sliding group's last window.
    assert [len(held) for held in vllm.tiers.held] == [1, 1, 1, 1, 1, 6]
    assert set(vllm.tiers.held[5].values()) == {"host"}
    pool = vllm.generate(PROMPT)  # vLLM's own prefix cache
    assert pool[2] == 0
    vllm.drop_pool_cache()
    tiers = vllm.generate(PROMPT)
    assert tiers[2] == 192
    assert vllm.tiers.stats["loaded_blocks"] == [1, 1, 1, 1, 1, 6]  # the window per sliding group, all full blocks
    assert_same(tiers, cold, pool)


def test_disk_tier_survives_a_restart(serve, tiny_gemma3, tmp_path):
    disk = str(tmp_path / "kv")
    vllm = serve(tiny_gemma3, {"disk_dir": disk})
    cold = vllm.generate(PROMPT)
    pool = vllm.generate(PROMPT)
    vllm.drop_pool_cache()
    assert set(vllm.tiers.held[5].values()) == {"disk"}
    from_disk = vllm.generate(PROMPT)
    assert from_disk[2] == 192
    assert_same(from_disk, cold, pool)
    # A new engine over the same directory: its first request hits.
    restarted = serve(tiny_gemma3, {"disk_dir": disk})
    assert [len(held) for held in restarted.tiers.held] == [1, 1, 1, 1, 1, 6]
    again = restarted.generate(PROMPT)
    assert again[2] == 192
    assert_same(again, cold, pool)


def test_vllm_fp8_pages_survive_a_restart_and_never_meet_another_dtype(serve, tiny_gemma3, tmp_path):
    """vLLM's fp8 KV (kv_cache_dtype "fp8": a page holds one byte of e4m3
    code per element and nothing else, the scale is one per tensor) goes to
    disk as those bytes and comes back: a restart's hit gives the cold fp8
    run's tokens and logprobs, and the pool-served run's exactly. The dtype
    is part of the identity: a vLLM with kv_cache_dtype "auto" over the same
    directory reads none of the fp8 files, nor one with "fp8_e5m2" (pages
    of the same size and spec, other codes), and the restarted fp8 vLLM
    none of theirs."""
    disk = str(tmp_path / "kv")
    files = os.path.join(disk, "*", "g*", "*.kv")
    fp8 = serve(tiny_gemma3, {"disk_dir": disk}, kv_cache_dtype="fp8")
    layout = fp8.tiers.groups.layout
    assert {g.spec.dtype for g in layout.groups} == {"uint8"}
    assert {g.spec.block_bytes(layout.block_size) for g in layout.groups} == {layout.page_size_bytes}
    cold = fp8.generate(PROMPT)
    pool = fp8.generate(PROMPT)
    fp8_files = set(glob.glob(files))
    assert len(fp8_files) == 11
    auto = serve(tiny_gemma3, {"disk_dir": disk})
    assert not any(auto.tiers.held), "fp8 files are not for a float32 KV"
    wide = auto.generate(PROMPT)
    assert wide[2] == 0
    assert max_logprob_diff(wide[1], cold[1]) > 10 * CLOSE  # the fp8 KV is another KV
    auto_files = set(glob.glob(files)) - fp8_files
    assert len(auto_files) == 11
    # One page per file: a float32 page is four times an fp8 one.
    page = layout.page_size_bytes
    assert {os.path.getsize(f) for f in auto_files} == {os.path.getsize(f) + 3 * page for f in fp8_files}
    e5m2 = serve(tiny_gemma3, {"disk_dir": disk}, kv_cache_dtype="fp8_e5m2")
    assert not any(e5m2.tiers.held), "e4m3 codes are not e5m2 codes"
    narrower = e5m2.generate(PROMPT)
    assert narrower[2] == 0 and max_logprob_diff(narrower[1], cold[1]) > 10 * CLOSE
    restarted = serve(tiny_gemma3, {"disk_dir": disk}, kv_cache_dtype="fp8")
    assert [len(held) for held in restarted.tiers.held] == [1, 1, 1, 1, 1, 6]
    again = restarted.generate(PROMPT)
    assert again[2] == 192
    assert_same(again, cold, pool)


def test_one_byte_pages_move_bit_for_bit():
    """Every one of the 256 byte values (fp8 NaNs and negative zero among
    them) leaves a layer's KV tensor and comes back unchanged, whether vLLM
    keeps its fp8 codes as uint8 (its CPU build) or as a float8 type."""
    import torch

    from hybridkv.integrations.vllm.worker import LayerBlocks

    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    for dtype in (torch.uint8, torch.float8_e4m3fn, torch.float8_e5m2):
        source = torch.stack([codes.roll(b) for b in range(4)]).view(4, 1, 256).view(dtype)
        target = torch.zeros_like(source)
        pages = LayerBlocks("source", source, 4, 256).read(torch.tensor([2, 0]))
        into = LayerBlocks("target", target, 4, 256)
        into.write(1, pages[0])
        into.write(3, pages[1])
        assert torch.equal(target.view(torch.uint8)[[1, 3]], source.view(torch.uint8)[[2, 0]]), dtype


def test_host_blocks_reach_disk_at_shutdown(serve, tiny_gemma3, tmp_path):
    """With both tiers the disk gets only what host memory pushes out, and
    the rest when vLLM shuts down: the next start hits it all."""
    disk = str(tmp_path / "kv")
    vllm = serve(tiny_gemma3, {"host_memory": "64MiB", "disk_dir": disk})
    cold = vllm.generate(PROMPT)
    assert not glob.glob(os.path.join(disk, "*", "g*", "*.kv"))
    vllm.close()
    assert len(glob.glob(os.path.join(disk, "*", "g*", "*.kv"))) == 11
    restarted = serve(tiny_gemma3, {"disk_dir": disk})
    again = restarted.generate(PROMPT)
    assert again[2] == 192
    assert_same(again, cold)


def test_the_loaded_kv_is_used(serve, tiny_gemma3):
    """Negative control: the same hit with the host tier's bytes scaled
    gives other logprobs, so the tokens above were computed from the
    loaded KV, not recomputed."""
    vllm = serve(tiny_gemma3, {"host_memory": "64MiB"})
    cold = vllm.generate(PROMPT)
    vllm.drop_pool_cache()
    slab = vllm.worker.store.host.slab
    slab.view(-1).view(dtype=__import__("torch").float32).mul_(3.0)
    scrambled = vllm.generate(PROMPT)
    assert scrambled[2] == 192
    assert max_logprob_diff(scrambled[1], cold[1]) > 100 * CLOSE


def test_damaged_and_foreign_files_are_misses(serve, tiny_gemma3, other_tiny_gemma3, tmp_path):
    """A truncated file, a flipped byte, and a file another model wrote
    under the same key (same tokens, same name) each fail their load: vLLM
    computes the request again, the output is the cold one, and the bad
    file is gone (the recomputed block is stored again in its place)."""
    disk = str(tmp_path / "kv")
    other = serve(other_tiny_gemma3, {"disk_dir": disk})
    other.generate(PROMPT)
    other_files = sorted(glob.glob(os.path.join(disk, "*", "g5", "*.kv")))
    vllm = serve(tiny_gemma3, {"disk_dir": disk})
    assert not any(vllm.tiers.held), "another model's directory is not this one's"
    cold = vllm.generate(PROMPT)
    mine = sorted(set(glob.glob(os.path.join(disk, "*", "g5", "*.kv"))) - set(other_files))
    assert len(mine) == 6 and [os.path.basename(p) for p in mine] == [os.path.basename(p) for p in other_files]
    victims = {"truncated": mine[0], "flipped": mine[2], "foreign": mine[4]}
    good = tmp_path / "good"  # (outside the tier's folders: a restart removes what is not a block file)
    for damage, path in victims.items():
        shutil.rmtree(good, ignore_errors=True)
        good.mkdir()
        for kept in mine:
            shutil.copy(kept, good / os.path.basename(kept))
        if damage == "truncated":
            os.truncate(path, os.path.getsize(path) // 2)
        elif damage == "flipped":
            with open(path, "r+b") as f:
                f.seek(200)
                byte = f.read(1)
                f.seek(200)
                f.write(bytes([byte[0] ^ 0x40]))
        else:
            shutil.copy(other_files[4], path)
        with open(path, "rb") as f:
            damaged = f.read()
        restarted = serve(tiny_gemma3, {"disk_dir": disk})
        assert len(restarted.tiers.held[5]) == 6
        again = restarted.generate(PROMPT)
        assert again[0] == cold[0] and max_logprob_diff(again[1], cold[1]) < CLOSE, damage
        assert restarted.tiers.stats["failed_loads"] >= 1, damage
        if os.path.exists(path):
            with open(path, "rb") as f:
                assert f.read() != damaged, damage
        for kept in mine:
            shutil.copy(good / os.path.basename(kept), kept)


def test_a_fine_tune_of_one_late_layer_never_reads_the_base_models_files(serve, tiny_gemma3, tmp_path):
    """A copy of the model with its last layer's projections scaled: the
    same names, shapes, sizes and first MiB of the weight file (safetensors
    keeps the header and the embedding there), other KV. Over the base
    model's disk directory it holds nothing and gives its own cold run."""
    from safetensors.torch import load_file, save_file

    tuned = str(tmp_path / "tuned")
    shutil.copytree(tiny_gemma3, tuned)
    weights = load_file(os.path.join(tiny_gemma3, "model.safetensors"))
    last = max(int(n.split(".")[2]) for n in weights if n.startswith("model.layers."))
    for name in weights:
        if name.startswith(f"model.layers.{last}.") and name.endswith("proj.weight"):
            weights[name] = weights[name] * 3.0
    save_file(weights, os.path.join(tuned, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(tiny_gemma3, "model.safetensors"), "rb") as a, \
            open(os.path.join(tuned, "model.safetensors"), "rb") as b:
        assert a.read(1 << 20) == b.read(1 << 20)

    disk = str(tmp_path / "kv")
    base = serve(tiny_gemma3, {"disk_dir": disk})
    base_run = base.generate(PROMPT)
    base.close()
    cold = serve(tuned).generate(PROMPT)
    assert cold[0] != base_run[0] or max_logprob_diff(cold[1], base_run[1]) > 100 * CLOSE
    over_base = serve(tuned, {"disk_dir": disk})
    assert not any(over_base.tiers.held), "the base model's directory is not the fine-tune's"
    run = over_base.generate(PROMPT)
    assert run[2] == 0
    assert run[0] == cold[0] and max_logprob_diff(run[1], cold[1]) < CLOSE


def test_salts_never_cross(serve, tiny_gemma3):
    vllm = serve(tiny_gemma3, {"host_memory": "64MiB"})
    cold = vllm.generate(PROMPT, salt="tenant-a")
    vllm.drop_pool_cache()
    assert vllm.generate(PROMPT, salt="tenant-b")[2] == 0
    assert vllm.generate(PROMPT)[2] == 0
    vllm.drop_pool_cache()
    again = vllm.generate(PROMPT, salt="tenant-a")
    assert again[2] == 192
    assert_same(again, cold)


def test_a_finished_request_leaves_its_prompt_window(serve, tiny_gemma3):
    """A request that generates past its window has released the window at
    its prompt's end; vLLM keeps it cached (a later request can end its hit
    there), and the connector stores that copy when the request finishes,
    beside the blocks the request still holds. A request that shares only
    the prompt then hits from the tiers."""
    vllm = serve(tiny_gemma3, {"host_memory": "64MiB"})
    prompt = PROMPT[:96]
    vllm.generate(prompt, max_tokens=80)
    stored = vllm.tiers.stats["stored_blocks"]
    assert stored[:5] == [2] * 5, stored  # the last window, and the window at the prompt's end
    vllm.drop_pool_cache()
    follow_up = prompt + [11, 12, 13]
    served = vllm.generate(follow_up)
    assert served[2] == 64  # where vLLM's own cache would end the hit of a 96-token prompt
    cold = serve(tiny_gemma3).generate(follow_up)
    assert_same(served, cold)


def test_blocks_about_to_be_evicted_are_stored(serve, tiny_gemma3):
    """Five requests decode together in a pool of 64 blocks (vLLM preempts
    some, and the tiers serve them back): the windows they release at their
    prompts' ends go to the free queue, cached, and the connector stores
    them from there (pinned until copied) before the pool reuses them. A
    block freed and reused within one scheduling pass escapes (here one
    prompt's window in three groups): that is a later miss, never wrong KV.
    Each prompt followed by new tokens is then served by the tiers where
    they hold its window, and always as a cold run computes it."""
    prompts = [[200 + d] + PROMPT[d * 5:d * 5 + 120] for d in range(5)]
    follow_ups = [p + [20 + d, 21] for d, p in enumerate(prompts)]
    plain = serve(tiny_gemma3, **SMALL_POOL)
    cold = [plain.generate(f) for f in follow_ups]
    vllm = serve(tiny_gemma3, {"host_memory": "64MiB"}, **SMALL_POOL)
    vllm.generate_many(prompts, max_tokens=100)
    assert vllm.tiers.stats["stores_evicting"] >= 5
    assert vllm.tiers.stats["hit_tokens"] > 0  # preempted requests came back from the tiers
    vllm.drop_pool_cache()
    served = [vllm.generate(follow_up) for follow_up in follow_ups]
    assert sum(s[2] == 96 for s in served) >= 4
    for run, reference in zip(served, cold):
        assert_same(run, reference)


def test_a_small_pool_overflows_into_the_tiers(serve, tiny_gemma3):
    """Ten prompts cache 90 blocks in a pool of 64, then each comes again:
    the pool's LRU has evicted each one before its turn, the host tier
    serves it (128 of its 151 tokens)."""
    vllm = serve(tiny_gemma3, {"host_memory": "64MiB"}, **SMALL_POOL)
    prompts = [[100 + d] + PROMPT[d * 7:d * 7 + 150] for d in range(10)]
    cold = [vllm.generate(p) for p in prompts]
    served = [vllm.generate(p) for p in prompts]
    assert [s[2] for s in served] == [128] * 10
    for s, c in zip(served, cold):
        assert_same(s, c)


def test_kv_events_name_the_tier(serve, tiny_gemma3):
    """With KV events on, what the tiers store is published beside the
    pool's own events, medium CPU (host memory) or STORAGE (disk)."""
    from vllm.config import KVEventsConfig
    from vllm.distributed.kv_events import BlockStored

    vllm = serve(tiny_gemma3, {"host_memory": "64MiB"},
                 kv_events_config=KVEventsConfig(enable_kv_cache_events=True, publisher="null"))
    batches = []
    vllm.scheduler.kv_event_publisher.publish = batches.append
    vllm.generate(PROMPT)
    stored = [e for b in batches for e in b.events if isinstance(e, BlockStored) and e.medium == "CPU"]
    assert {e.group_idx for e in stored} == set(range(6))
    assert sum(len(e.block_hashes) for e in stored) == 11
    assert {e.kv_cache_spec_kind for e in stored} == {"sliding_window", "full"}


def test_a_disk_that_fails_turns_the_tier_off(serve, tiny_gemma3, tmp_path):
    """Writes that fail (here: the group's folder is a file) warn once and
    stop the disk tier; serving goes on, outputs unchanged."""
    disk = tmp_path / "kv"
    vllm = serve(tiny_gemma3, {"disk_dir": str(disk)})
    root = vllm.worker.store.disk.root
    for g in range(6):
        (disk / root / f"g{g}").write_bytes(b"not a folder")
    with pytest.warns(RuntimeWarning, match="stops storing"):
        cold = vllm.generate(PROMPT)
    assert not vllm.worker.store.disk.writable and not any(vllm.tiers.held)
    vllm.drop_pool_cache()
    again = vllm.generate(PROMPT)
    assert again[2] == 0 and again[0] == cold[0]


@pytest.mark.parametrize("extra, message", [
    ({}, "needs a tier"),
    ({"host_memory": "1GiB", "disk_path": "/tmp"}, "unknown kv_connector_extra_config"),
])
def test_bad_options_are_refused_at_start(serve, tiny_gemma3, extra, message):
    with pytest.raises(Exception, match=message):
        serve(tiny_gemma3, extra)


PRODUCER = """
import sys
sys.path.insert(0, sys.argv[3])
from conftest import CONNECTOR, Served
from vllm import LLM
served = Served(LLM(model=sys.argv[1], dtype="float32", max_model_len=1024, enable_prefix_caching=True,
                    skip_tokenizer_init=True, max_num_seqs=8, seed=0, enforce_eager=True, block_size=32,
                    distributed_executor_backend="uni",
                    kv_transfer_config=dict(CONNECTOR, kv_role="kv_producer",
                                            kv_connector_extra_config={"disk_dir": sys.argv[2]})))
served.generate(eval(sys.argv[4]), max_tokens=1)
served.close()
"""


def test_a_consumer_loads_what_a_producer_in_another_process_wrote(serve, tiny_gemma3, tmp_path):
    # Prefill and decode on two vLLMs (kv_role kv_producer / kv_consumer)
    # over one directory: the consumer runs already when the producer, a
    # process of its own, computes the prompt; the consumer's request then
    # finds the producer's blocks by name and loads them.
    import subprocess
    import sys

    disk = str(tmp_path / "kv")
    consumer = serve(tiny_gemma3, {"disk_dir": disk}, kv_role="kv_consumer")
    assert not any(consumer.tiers.held)
    here = os.path.dirname(os.path.abspath(__file__))
    subprocess.run([sys.executable, "-c", PRODUCER, tiny_gemma3, disk, here, repr(PROMPT)], check=True,
                   timeout=600)
    assert glob.glob(os.path.join(disk, "*", "g*", "*.kv"))
    decoded = consumer.generate(PROMPT)
    assert decoded[2] == 192  # every whole block of the prompt, from the producer's files
    cold = serve(tiny_gemma3).generate(PROMPT)  # vLLM alone
    assert_same(decoded, cold)


@pytest.mark.parametrize("step_tokens", [None, 64])
def test_a_producer_writes_a_prompt_s_blocks_in_the_step_that_computes_them(serve, tiny_gemma3, tmp_path,
                                                                           step_tokens):
    # A consumer asked as soon as the producer answered (a proxy's next
    # request) finds every block a hit on the prompt reads: stored after the
    # forward pass that computed them, before vLLM hands the token back
    # (with 64-token steps, over four steps), not in a step after the finish.
    from vllm import SamplingParams

    disk = str(tmp_path / "kv")
    options = {} if step_tokens is None else {"max_num_batched_tokens": step_tokens}
    producer = serve(tiny_gemma3, {"disk_dir": disk}, kv_role="kv_producer", **options)
    producer.llm.generate([{"prompt_token_ids": PROMPT}], SamplingParams(temperature=0, max_tokens=1),
                          use_tqdm=False)  # (no settle: not one engine step more)
    groups, stats = producer.tiers.groups, producer.tiers.stats
    end = (len(PROMPT) - 1) // groups.block_size  # the whole blocks a hit on the prompt reads
    needed = sum(end - groups.first_needed(g, end) for g in range(len(groups.layout.groups)))
    assert stats["stores_prefilled"] == needed and stats["stores_finished"] == 0
    assert not producer.tiers.prefilling
    assert sum(len(held) for held in producer.tiers.held) == needed  # the workers reported them written
    assert len(glob.glob(os.path.join(disk, "*", "g*", "*.kv"))) == needed
    consumer = serve(tiny_gemma3, {"disk_dir": disk}, kv_role="kv_consumer")
    decoded = consumer.generate(PROMPT)
    assert decoded[2] == end * groups.block_size
    assert_same(decoded, serve(tiny_gemma3).generate(PROMPT))


def test_a_producer_or_consumer_needs_the_shared_directory(serve, tiny_gemma3):
    with pytest.raises(Exception, match="needs kv_connector_extra_config's 'disk_dir'"):
        serve(tiny_gemma3, {"host_memory": "64MiB"}, kv_role="kv_consumer")
