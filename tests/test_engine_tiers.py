"""The engine with tiers below its pool (tiers/ and core/tiers.py): host memory and
disk, checked against transformers on tiny Gemma-3 (window 8) and tiny
Jamba: outputs with hits served from the tiers equal transformers', the disk
tier survives a restart, and a corrupt, truncated or foreign file or an
unwritable directory is a miss, never wrong KV, never an error."""

from __future__ import annotations

import glob
import os
import warnings

import pytest

from disk_faults import dead_pid
from hybridkv import Engine, SamplingParams
from hybridkv.tiers.disk import _machine_id
from oracle import check_tokens, load_reference, model_dir

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module", params=["gemma3", "jamba"])
def family_model(request, tmp_path_factory):
    path = model_dir(tmp_path_factory, request.param)
    return request.param, path, load_reference(path)


def small_engine(path, **kw):
    # A pool for about two of these requests: every new document evicts the last.
    probe = Engine(path, kv_cache_memory="8MiB", block_size=4, progress=False, max_model_len=256,
                   kv_cache_dtype=kw.get("kv_cache_dtype", "auto"))
    pages = 2 * probe.layout.pages_per_request(60, chunk=64) + 3
    return Engine(path, kv_cache_memory=pages * probe.layout.page_size_bytes, block_size=4, progress=False,
                  max_model_len=256, max_num_batched_tokens=64, **kw)


def documents(n, length=44):
    return [[(11 * d + 5 * j) % 190 + 7 for j in range(length)] for d in range(n)]


def served_and_stopped(path, directory) -> list[int]:
    """An engine over a disk tier serves a 60-token document and stops
    (close(): what the pool still caches goes to disk); returns the document."""
    doc = documents(1, length=60)[0]
    first = small_engine(path, kv_disk_cache=str(directory))
    first.generate([doc], GREEDY, use_tqdm=False)
    first.close()
    return doc


def revisit(engine, reference, docs):
    """Each document once, then each again with a new question: returns the
    second round's cached tokens, every output checked by transformers."""
    for doc in docs:
        out = engine.generate([doc], GREEDY, use_tqdm=False)[0]
        check_tokens(reference, doc, out.outputs[0].token_ids)
    cached = []
    for doc in docs:
        prompt = doc + [3, 4]
        out = engine.generate([prompt], GREEDY, use_tqdm=False)[0]
        check_tokens(reference, prompt, out.outputs[0].token_ids)
        cached.append(out.metrics.num_cached_tokens)
    return cached


def test_hybrid_host_tier_serves_evicted_prefixes_with_transformers_outputs(family_model):
    family, path, reference = family_model
    docs = documents(6)
    without = revisit(small_engine(path), reference, docs)
    engine = small_engine(path, kv_host_cache_memory="4MiB")
    with_host = revisit(engine, reference, docs)
    assert sum(with_host) > sum(without) and min(with_host) >= 40, (with_host, without)
    assert sum(engine.stats["kv_tier_loads_by_group"]["host"]) > 0
    assert engine.kv.num_free_pages == engine.kv.num_total_pages


def test_hybrid_disk_tier_survives_a_restart(family_model, tmp_path):
    family, path, reference = family_model
    doc = served_and_stopped(path, tmp_path)
    second = small_engine(path, kv_disk_cache=str(tmp_path))
    prompt = doc + [9, 9]
    out = second.generate([prompt], GREEDY, use_tqdm=False)[0]
    assert out.metrics.num_cached_tokens >= 56, out.metrics
    assert sum(second.stats["kv_tier_loads_by_group"]["disk"]) > 0
    assert second.stats["kv_tier_load_seconds"] > 0  # the wait for disk hits is counted
    check_tokens(reference, prompt, out.outputs[0].token_ids)


def test_hybrid_disk_tier_with_host_tier_and_eviction_keeps_outputs(family_model, tmp_path):
    family, path, reference = family_model
    engine = small_engine(path, kv_host_cache_memory="64KiB", kv_disk_cache=str(tmp_path))
    cached = revisit(engine, reference, documents(6))
    assert sum(engine.stats["kv_tier_loads_by_group"].get("disk", [0])) > 0, engine.stats
    assert min(cached) >= 40, cached


def test_hybrid_tiers_under_preemption_keep_transformers_outputs(family_model, tmp_path):
    # Eight requests that share documents in a pool for about two: requests
    # are preempted and resumed, and resumed ones hit blocks the tiers took.
    family, path, reference = family_model
    docs = documents(4)
    prompts = [docs[i % 4] + [3 + i, 4] for i in range(8)]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    engine = small_engine(path, kv_host_cache_memory="64KiB", kv_disk_cache=str(tmp_path))
    outs = engine.generate(prompts, params, use_tqdm=False)
    assert engine.stats["preemptions"] > 0
    assert sum(sum(n) for n in engine.stats["kv_tier_loads_by_group"].values()) > 0, engine.stats
    for prompt, out in zip(prompts, outs):
        check_tokens(reference, prompt, out.outputs[0].token_ids)
    assert engine.kv.num_free_pages == engine.kv.num_total_pages


@pytest.mark.parametrize("damage", ["corrupt", "truncated", "foreign"])
def test_a_damaged_disk_block_is_a_miss_and_is_removed(family_model, tmp_path, damage):
    family, path, reference = family_model
    doc = served_and_stopped(path, tmp_path)
    files = sorted(glob.glob(os.path.join(tmp_path, "*", "g*", "*.kv")))
    assert files
    for name in files:
        data = bytearray(open(name, "rb").read())
        if damage == "corrupt":
            data[len(data) // 2] ^= 0xFF
        elif damage == "truncated":
            data = data[:len(data) // 2]
        else:  # another model's identity in the header
            data[20] ^= 0xFF
        open(name, "wb").write(bytes(data))
    second = small_engine(path, kv_disk_cache=str(tmp_path))
    prompt = doc + [9, 9]
    out = second.generate([prompt], GREEDY, use_tqdm=False)[0]
    check_tokens(reference, prompt, out.outputs[0].token_ids)
    assert out.metrics.num_cached_tokens == 0
    # A damaged file is found out when a hit reads it, and removed then.
    left = set(glob.glob(os.path.join(tmp_path, "*", "g*", "*.kv")))
    assert set(files) - left, "a damaged file that was read stays on disk"


def test_another_layout_never_reads_the_disk_tier(family_model, tmp_path):
    family, path, reference = family_model
    doc = served_and_stopped(path, tmp_path)
    other = Engine(path, kv_cache_memory="8MiB", block_size=8, progress=False, max_model_len=256,
                   kv_disk_cache=str(tmp_path))
    out = other.generate([doc + [9, 9]], GREEDY, use_tqdm=False)[0]
    assert out.metrics.num_cached_tokens == 0


def test_an_unwritable_disk_tier_warns_and_serving_goes_on(family_model, tmp_path):
    family, path, reference = family_model
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a file where the tier wants a directory")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine = small_engine(path, kv_disk_cache=str(blocker))
        cached = revisit(engine, reference, documents(4))
    assert any("stops storing" in str(w.message) for w in caught)
    assert engine.stats["kv_tier_disk_writable"] is False
    assert len(cached) == 4


def test_a_write_cut_short_by_a_killed_process_is_never_read(family_model, tmp_path):
    # A process killed between writing a block's temporary file and renaming
    # it leaves the temporary file: the next start removes it unread
    # (tests/test_faults.py kills a real writer mid-write).
    family, path, reference = family_model
    doc = served_and_stopped(path, tmp_path)
    files = sorted(glob.glob(os.path.join(tmp_path, "*", "g*", "*.kv")))
    half = f"{files[0]}.{_machine_id()}-{dead_pid()}-0badf00d.tmp"  # its writer is gone
    with open(files[0], "rb") as f:
        open(half, "wb").write(f.read()[:100])
    second = small_engine(path, kv_disk_cache=str(tmp_path))
    assert not os.path.exists(half)
    out = second.generate([doc + [9, 9]], GREEDY, use_tqdm=False)[0]
    check_tokens(reference, doc + [9, 9], out.outputs[0].token_ids)
    assert out.metrics.num_cached_tokens >= 56


def test_a_lookup_reads_no_file_and_a_load_that_fails_recomputes(family_model, tmp_path, monkeypatch):
    # A restarted engine's index holds the first run's files by name. A
    # lookup reads the index only: asked twice around the files' removal,
    # it gives the same hit and opens nothing. The step's loads then fail:
    # the request computes again, with transformers' tokens.
    from hybridkv.tiers import DiskTier

    family, path, reference = family_model
    doc = served_and_stopped(path, tmp_path)
    engine = small_engine(path, kv_disk_cache=str(tmp_path))
    reads = []
    read = DiskTier.read
    monkeypatch.setattr(DiskTier, "read", lambda self, *item: reads.append(item) or read(self, *item))
    prompt = doc + [3, 4]
    request_id = engine.add_request(prompt, GREEDY)
    seq_id = engine.requests[request_id].sequences[0].seq_id
    hit = engine.kv.get_computed_tokens(seq_id)
    for name in glob.glob(os.path.join(str(tmp_path), "*", "g*", "*.kv")):
        os.unlink(name)
    assert engine.kv.get_computed_tokens(seq_id) == hit >= 40 and reads == []
    outputs = []
    while engine.has_unfinished_requests():
        outputs += [o for o in engine.step() if o.finished]
    check_tokens(reference, prompt, outputs[0].outputs[0].token_ids)
    assert reads and engine.stats["kv_tier_failed_loads"] > 0
    assert outputs[0].metrics.num_cached_tokens < hit  # what was left of the hit: nothing on disk
    assert engine.kv.num_free_pages == engine.kv.num_total_pages


def test_a_load_that_fails_in_a_batch_leaves_the_other_requests_alone(family_model, tmp_path):
    # Two documents served and stopped; one's files are damaged. Both asked
    # again in one batch: the damaged one recomputes, the other takes its
    # hit from disk, and both give transformers' tokens.
    family, path, reference = family_model
    docs = documents(2, length=60)
    first = small_engine(path, kv_disk_cache=str(tmp_path))
    for doc in docs:
        first.generate([doc], GREEDY, use_tqdm=False)
    first.close()
    second = small_engine(path, kv_disk_cache=str(tmp_path))
    prompts = [doc + [3, 4] for doc in docs]
    probe = second.add_request(prompts[0], GREEDY)  # asked only for its block keys, then dropped
    seq_id = second.requests[probe].sequences[0].seq_id
    second.kv.get_computed_tokens(seq_id)
    keys = second.kv.block_keys(seq_id, 0, 60)
    second.abort(probe)
    files = {os.path.basename(n): n for n in glob.glob(os.path.join(str(tmp_path), "*", "g*", "*.kv"))}
    damaged = [files[k.hex() + ".kv"] for k in keys if k.hex() + ".kv" in files]
    assert damaged
    for name in damaged:
        with open(name, "r+b") as f:
            f.truncate(os.path.getsize(name) // 2)
    outs = second.generate(prompts, GREEDY, use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        check_tokens(reference, prompt, out.outputs[0].token_ids)
    assert second.stats["kv_tier_failed_loads"] > 0
    assert outs[1].metrics.num_cached_tokens >= 40  # the other document's hit stood
    second.close()


def disk_bytes(directory) -> int:
    return sum(os.path.getsize(n) for n in glob.glob(os.path.join(str(directory), "*", "g*", "*.kv")))


def test_int8_pages_go_to_the_tiers_as_they_are_and_hit_again_after_a_restart(family_model, tmp_path, monkeypatch):
    # int8 attention pages (Jamba's Mamba states beside them stay float32):
    # what a small pool evicts goes to host memory and disk and comes back
    # bit for bit, so every revisit gives the tokens of an int8 engine that
    # never evicted; the files take fewer bytes than float32 pages'; after a
    # restart the same dtype hits them, and float32 pages never do, nor
    # int8 pages whose keys were stored less other centres.
    family, path, reference = family_model
    docs = documents(6)
    roomy = Engine(path, kv_cache_memory="8MiB", block_size=4, progress=False, max_model_len=256,
                   max_num_batched_tokens=64, kv_cache_dtype="int8")
    # host memory for a few blocks, so that both tiers serve hits
    tiered = small_engine(path, kv_cache_dtype="int8", kv_host_cache_memory="16KiB" if family == "gemma3" else "64KiB",
                          kv_disk_cache=str(tmp_path / "int8"))
    for engine in (roomy, tiered):
        for doc in docs:
            engine.generate([doc], GREEDY, use_tqdm=False)
    for doc in docs:
        prompt = doc + [3, 4]
        expected = roomy.generate([prompt], GREEDY, use_tqdm=False)[0]
        got = tiered.generate([prompt], GREEDY, use_tqdm=False)[0]
        assert got.outputs[0].token_ids == expected.outputs[0].token_ids
        assert got.metrics.num_cached_tokens >= 40
    loads = tiered.stats["kv_tier_loads_by_group"]
    assert sum(loads.get("host", [0])) > 0 and sum(loads.get("disk", [0])) > 0, loads
    tiered.close()
    # the same document's blocks on disk in float32 pages take more bytes
    wide = small_engine(path, kv_disk_cache=str(tmp_path / "float32"))
    wide.generate([docs[0]], GREEDY, use_tqdm=False)
    wide.close()
    narrow = small_engine(path, kv_cache_dtype="int8", kv_disk_cache=str(tmp_path / "one"))
    narrow.generate([docs[0]], GREEDY, use_tqdm=False)
    narrow.close()
    assert disk_bytes(tmp_path / "one") < (0.5 if family == "gemma3" else 0.9) * disk_bytes(tmp_path / "float32")
    restarted = small_engine(path, kv_cache_dtype="int8", kv_disk_cache=str(tmp_path / "int8"))
    out = restarted.generate([docs[1] + [5, 6]], GREEDY, use_tqdm=False)[0]
    assert out.metrics.num_cached_tokens >= 40
    assert out.outputs[0].token_ids == roomy.generate([docs[1] + [5, 6]], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    other = small_engine(path, kv_disk_cache=str(tmp_path / "int8"))
    assert other.generate([docs[1] + [5, 6]], GREEDY, use_tqdm=False)[0].metrics.num_cached_tokens == 0
    import hybridkv.engine.engine as engine_module

    measured = engine_module.calibration_ids
    monkeypatch.setattr(engine_module, "calibration_ids", lambda *args: measured(*args)[::-1])
    centred_otherwise = small_engine(path, kv_cache_dtype="int8", kv_disk_cache=str(tmp_path / "int8"))
    assert centred_otherwise.worker.key_centres
    assert centred_otherwise.generate([docs[1] + [5, 6]], GREEDY, use_tqdm=False)[0].metrics.num_cached_tokens == 0
