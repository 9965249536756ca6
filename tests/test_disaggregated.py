"""Prefill and decode on different engines (EngineConfig.kv_role) over one
directory both read: the prefill engine leaves there exactly the blocks a
hit of each prompt reads (every full-attention block, the window's last
blocks, the recurrent state at the last whole block), the decode engine's
lookup finds them by name and its plan loads them; greedy tokens equal
transformers', a damaged or half-written transfer is recomputed, a salt
never crosses, and a decode engine that holds the prefix already loads
nothing."""

from __future__ import annotations

import glob
import os

import pytest

from hybridkv import Engine, SamplingParams
from oracle import check_tokens, load_reference, model_dir

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
FIRST = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)


@pytest.fixture(scope="module", params=["gemma3", "jamba", "qwen3_next", "nemotron_h"])
def family_model(request, tmp_path_factory):
    path = model_dir(tmp_path_factory, request.param)
    return request.param, path, load_reference(path)


def engine(path, directory, role, **kw):
    return Engine(path, kv_cache_memory="8MiB", block_size=4, progress=False, max_model_len=256,
                  kv_disk_cache=str(directory), kv_role=role, **kw)


def documents(n, length=45):
    return [[(13 * d + 7 * j) % 190 + 5 for j in range(length)] for d in range(n)]


def run(engine_, prompt, params, salt=None):
    """One request through `engine_` (with a salt if given); its output."""
    request_id = engine_.add_request(prompt, params, cache_salt=salt)
    while engine_.has_unfinished_requests():
        for out in engine_.step():
            if out.finished and out.request_id == request_id:
                return out
    raise AssertionError("the request did not finish")


def test_a_decode_engine_continues_what_a_prefill_engine_computed(family_model, tmp_path):
    family, path, reference = family_model
    prefill, decode = engine(path, tmp_path, "prefill"), engine(path, tmp_path, "decode")
    for doc in documents(3):
        first = run(prefill, doc, FIRST)
        out = run(decode, doc, GREEDY)
        tokens = out.outputs[0].token_ids
        check_tokens(reference, doc, tokens)
        assert tokens[0] == first.outputs[0].token_ids[0]
        assert out.metrics.num_cached_tokens == (len(doc) - 1) // 4 * 4  # the whole hit, from the transfer
        shipped, everything = first.metrics.kv_handoff_bytes, first.metrics.kv_all_layers_bytes
        assert 0 < shipped <= everything
        assert shipped == prefill.layout.hit_bytes((len(doc) - 1) // 4 * 4)  # the plan's rule, block for block
        if family == "gemma3":  # the sliding layers ship their last window only
            assert shipped < 0.8 * everything, (shipped, everything)
    assert sum(decode.stats["kv_tier_loads_by_group"]["disk"]) > 0
    assert decode.stats["kv_tier_failed_loads"] == 0
    prefill.close()
    decode.close()


def test_only_what_the_hit_reads_is_shipped(family_model, tmp_path):
    family, path, _ = family_model
    prefill = engine(path, tmp_path, "prefill")
    doc = documents(1, length=61)[0]
    run(prefill, doc, FIRST)
    hit_blocks = (len(doc) - 1) // 4
    files = {g: len(glob.glob(os.path.join(str(tmp_path), "*", f"g{g}", "*.kv")))
             for g in range(len(prefill.layout.groups))}
    for group in prefill.layout.groups:
        if group.recurrent:
            expected = 1  # the state at the last whole block
        elif group.kind == "sliding_window":
            window = group.spec.sliding_window
            expected = hit_blocks - (hit_blocks * 4 - (window - 1)) // 4
        else:
            expected = hit_blocks
        assert files[group.index] == expected, (group.kind, files)
    prefill.close()


def test_a_damaged_transfer_is_recomputed_with_the_same_tokens(family_model, tmp_path):
    family, path, reference = family_model
    prefill, decode = engine(path, tmp_path, "prefill"), engine(path, tmp_path, "decode")
    doc = documents(1)[0]
    run(prefill, doc, FIRST)
    for name in glob.glob(os.path.join(str(tmp_path), "*", "g*", "*.kv")):
        with open(name, "r+b") as f:
            f.truncate(os.path.getsize(name) // 2)
    out = run(decode, doc, GREEDY)
    check_tokens(reference, doc, out.outputs[0].token_ids)
    assert decode.stats["kv_tier_failed_loads"] > 0 and out.metrics.num_cached_tokens == 0
    assert decode.kv.num_free_pages == decode.kv.num_total_pages  # nothing left held


def test_a_prefill_engine_that_stops_partway_costs_the_decode_side_time_not_tokens(family_model, tmp_path,
                                                                                   monkeypatch):
    # A prefill engine that died while its blocks were being written: half
    # of its files are there, the rest never were, and one write was cut
    # short (its temporary file left, its writer gone). What it ships is
    # what the whole prompt's hit reads (a window's last blocks, the state
    # at the last block), so half of it is no hit at all: the decode engine
    # loads nothing, computes the prompt and gives transformers' tokens;
    # nothing is left held.
    from hybridkv.tiers.disk import DiskTier

    family, path, reference = family_model
    doc = documents(1)[0]
    whole = engine(path, tmp_path / "whole", "prefill")
    run(whole, doc, FIRST)
    whole.close()
    files = len(glob.glob(os.path.join(str(tmp_path / "whole"), "*", "g*", "*.kv")))
    written, write = [], DiskTier.write

    def dying(self, group, key, content):  # the process is gone after half of its files
        if len(written) >= files // 2:
            return []
        written.append((group, key))
        return write(self, group, key, content)

    monkeypatch.setattr(DiskTier, "write", dying)
    prefill = engine(path, tmp_path, "prefill")
    run(prefill, doc, FIRST)
    prefill.close()  # (its flush at close writes nothing more either: the process is gone)
    monkeypatch.setattr(DiskTier, "write", write)
    (a_file,) = glob.glob(os.path.join(str(tmp_path), "*", "g*", "*.kv"))[:1]
    with open(f"{a_file[:-3]}0.kv.{'0' * 12}-999999999-abcd.tmp", "wb") as f:
        f.write(b"half a block")
    decode = engine(path, tmp_path, "decode")
    out = run(decode, doc, GREEDY)
    check_tokens(reference, doc, out.outputs[0].token_ids)
    assert 0 < len(written) < files and out.metrics.num_cached_tokens == 0
    assert decode.stats["kv_tier_failed_loads"] == 0  # (no load of a block that is not there)
    assert decode.kv.num_free_pages == decode.kv.num_total_pages


def test_a_salt_never_crosses_and_a_held_prefix_loads_nothing(family_model, tmp_path):
    family, path, reference = family_model
    prefill, decode = engine(path, tmp_path, "prefill"), engine(path, tmp_path, "decode")
    doc = documents(1)[0]
    run(prefill, doc, FIRST, salt="tenant-a")
    other = run(decode, doc, GREEDY, salt="tenant-b")
    assert other.metrics.num_cached_tokens == 0
    mine = run(decode, doc, GREEDY, salt="tenant-a")
    assert mine.metrics.num_cached_tokens > 0
    loads = sum(decode.stats["kv_tier_loads_by_group"]["disk"])
    again = run(decode, doc, GREEDY, salt="tenant-a")  # the decode engine's pool holds the prefix now
    assert again.metrics.num_cached_tokens == mine.metrics.num_cached_tokens
    assert sum(decode.stats["kv_tier_loads_by_group"]["disk"]) == loads
    for out in (other, mine, again):
        check_tokens(reference, doc, out.outputs[0].token_ids)


def test_chunked_prefill_and_drafts_on_the_decode_side_keep_the_tokens(family_model, tmp_path):
    # The prefill engine computes the prompt in chunks of 16 tokens; the
    # decode engine verifies prompt-lookup drafts while it decodes.
    family, path, reference = family_model
    prefill = engine(path, tmp_path, "prefill", max_num_batched_tokens=16)
    decode = engine(path, tmp_path, "decode", speculative_method="ngram", num_speculative_tokens=3,
                    prompt_lookup_min=1, prompt_lookup_max=2)  # (a token seen before proposes what followed it)
    doc = documents(1, length=65)[0]
    run(prefill, doc, FIRST)
    out = run(decode, doc, SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True))
    check_tokens(reference, doc, out.outputs[0].token_ids)
    assert out.metrics.num_cached_tokens == (len(doc) - 1) // 4 * 4
    assert decode.stats["spec_draft_tokens"] > 0
