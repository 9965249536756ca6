"""KV events over the wire (serving/kv_wire.py, serving/zmq_events.py):
vLLM's format read with vLLM's schema, real ZMQ sockets from a real engine
and from `hybridkv serve`, sequence numbers, replay, a full queue, and a
PrefixIndex fed from the stream that equals the engine's own hit."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import threading
import time
import urllib.request

import msgspec
import pytest

from hybridkv.core import KVCacheManager
from hybridkv.core.events import AllBlocksCleared, BlockRemoved, BlockStored
from hybridkv.core.prefix_index import PrefixIndex
from hybridkv.serving.kv_wire import WireFormat
from hybridkv.serving.zmq_events import KVEventPublisher, KVEventSubscriber, subscribe_to_server
from kv_shadow import MIXES, layer_specs, layout_for_requests, random_workload
from serving import free_port


# vLLM 0.32's KV event schema, declared here from its documented fields
# (vllm/distributed/kv_events.py), the way a router built for vLLM decodes.
class VllmEvent(msgspec.Struct, tag=True, omit_defaults=True):
    pass


class BlockStoredV(VllmEvent, tag="BlockStored"):
    block_hashes: list[bytes | int]
    parent_block_hash: bytes | int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None


class BlockRemovedV(VllmEvent, tag="BlockRemoved"):
    block_hashes: list[bytes | int]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksClearedV(VllmEvent, tag="AllBlocksCleared"):
    pass


class KVEventBatchV(msgspec.Struct, array_like=True, omit_defaults=True):
    ts: float
    events: list[BlockStoredV | BlockRemovedV | AllBlocksClearedV]
    data_parallel_rank: int | None = None


def test_vllms_schema_reads_every_group_kind_with_its_group_fields():
    layout = layout_for_requests(layer_specs(("full", "window", "chunked", "mamba"), window=7, chunk=10), num_requests=3, num_tokens=16)
    kv = KVCacheManager(layout, enable_kv_events=True)
    wire = WireFormat(layout, medium="CPU")
    batches = []
    random_workload(kv, random.Random(3), num_ops=300, after_op=lambda op: batches.append(kv.take_events()))
    batches = [b for b in batches if b]
    kinds = set()
    for events in batches:
        payload = wire.encode(events)
        theirs = msgspec.msgpack.decode(payload, type=KVEventBatchV)
        assert len(theirs.events) == len(events)
        for ours, their in zip(events, theirs.events):
            if type(ours) is BlockStored:
                group = layout.groups[ours.group_idx]
                kinds.add(their.kv_cache_spec_kind)
                assert (their.block_hashes, their.parent_block_hash, their.token_ids, their.block_size) == \
                    (ours.block_hashes, ours.parent_block_hash, ours.token_ids, ours.block_size)
                assert their.group_idx == ours.group_idx and their.medium == "CPU"
                assert their.kv_cache_spec_sliding_window == getattr(group.spec, "sliding_window", None)
            elif type(ours) is BlockRemoved:
                assert (type(their), their.block_hashes, their.group_idx) == \
                    (BlockRemovedV, ours.block_hashes, ours.group_idx)
            else:
                assert type(their) is AllBlocksClearedV
        assert wire.decode(payload)[1] == events  # and back
    assert kinds == {"full_attention", "sliding_window", "chunked_local_attention", "mamba"}
    # The extension is in the bytes, where vLLM's decoder skipped it.
    raw = [msgspec.msgpack.decode(wire.encode(b)) for b in batches]
    assert any(e.get("hybridkv_chunk_size") == 10 for batch in raw for e in batch[1])


def test_a_vllm_batch_without_group_fields_reads_as_full_attention():
    batch = KVEventBatchV(1.5, [BlockStoredV([b"k1", b"k2"], None, list(range(8)), 4, None, "GPU", None),
                                BlockRemovedV([b"k1"], "GPU"), AllBlocksClearedV()])
    layout = layout_for_requests(layer_specs(MIXES["full"]), num_requests=2, num_tokens=8)
    ts, events = WireFormat(layout).decode(msgspec.msgpack.encode(batch))
    assert ts == 1.5
    assert events == [BlockStored([b"k1", b"k2"], None, list(range(8)), 4, 0, "full"), BlockRemoved([b"k1"], 0),
                      AllBlocksCleared()]


def _drain(subscriber, index, source, quiet=0.3) -> int:
    """Apply what arrives until nothing has for `quiet` seconds; returns
    how many blocks were reported removed."""
    removed = 0
    while True:
        batches = subscriber.receive(timeout=quiet)
        if not batches:
            return removed
        for events in batches:
            index.apply(source, events)
            removed += sum(len(e.block_hashes) for e in events if type(e) is BlockRemoved)


def _fresh_hit(kv, prompt):
    kv.add_request("__probe__", prompt)
    try:
        return kv.get_computed_tokens("__probe__")
    finally:
        kv.free("__probe__")


@pytest.fixture(scope="module")
def engine():
    from hybridkv import Engine
    from hybridkv.tiny_models import tiny_model_dir

    # A small pool, so that the workload below evicts.
    return Engine(tiny_model_dir("tiny-gemma3"), kv_cache_memory="1MiB", enable_kv_events=True, progress=False)


def _run(engine, publisher, prompts, max_tokens=3):
    from hybridkv import SamplingParams

    for prompt in prompts:
        engine.add_request(prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
        publisher.send(engine.kv)
    if not getattr(publisher.wire, "stalled", False):
        assert publisher.flush()


def _prompts(rng, n):
    stems = [[rng.randrange(3, 200) for _ in range(rng.choice([20, 40, 70]))] for _ in range(4)]
    return [rng.choice(stems)[:rng.randrange(8, 70)] + [rng.randrange(3, 200) for _ in range(rng.randrange(1, 30))]
            for _ in range(n)]


def test_an_engines_stream_feeds_an_index_that_equals_its_hit_and_a_late_subscriber_replays(engine):
    engine.take_kv_events()
    engine.kv.reset_prefix_cache()
    wire = WireFormat(engine.kv.layout, medium="CPU")
    publisher = KVEventPublisher("tcp://127.0.0.1:0", wire, replay_endpoint="tcp://127.0.0.1:0")
    early = KVEventSubscriber(publisher.endpoint, wire, replay_endpoint=publisher.replay_endpoint)
    index = PrefixIndex(engine.kv.layout)
    rng = random.Random(7)
    try:
        removed = 0
        for round_ in range(4):
            prompts = _prompts(rng, 8)
            _run(engine, publisher, prompts)
            removed += _drain(early, index, "engine")
            for probe in prompts + _prompts(rng, 4):
                assert index.hit_tokens("engine", probe) == _fresh_hit(engine.kv, probe), round_
        assert removed > 0, "the workload should evict"  # removals went over the wire too
        assert early.last_seq == publisher.num_sent - 1 and early.num_gaps == 0 and early.synced
        # A subscriber that joins now gets everything from the replay socket.
        late = KVEventSubscriber(publisher.endpoint, wire, replay_endpoint=publisher.replay_endpoint)
        time.sleep(0.3)  # its subscription reaches the publisher
        _run(engine, publisher, _prompts(rng, 2))
        late_index = PrefixIndex(engine.kv.layout)
        _drain(late, late_index, "engine")
        _drain(early, index, "engine")
        assert late.last_seq == early.last_seq == publisher.num_sent - 1 and late.synced
        for probe in _prompts(rng, 12):
            expected = _fresh_hit(engine.kv, probe)
            assert late_index.hit_tokens("engine", probe) == index.hit_tokens("engine", probe) == expected
    finally:
        early.close()
        publisher.close()


class _StalledWire(WireFormat):
    """Encoding waits until released: the publisher thread falls behind."""

    def __init__(self, layout):
        super().__init__(layout)
        self.release = threading.Event()

    @property
    def stalled(self):
        return not self.release.is_set()

    def encode(self, events, ts=None):
        self.release.wait(30)
        return super().encode(events, ts)


def test_a_full_queue_drops_batches_then_a_snapshot_makes_the_subscriber_exact_again(engine):
    engine.take_kv_events()
    wire = _StalledWire(engine.kv.layout)
    # No replay, a queue of one batch: the third batch while the thread is
    # stuck on the first is dropped.
    publisher = KVEventPublisher("tcp://127.0.0.1:0", wire, max_queue=1, snapshot_every=0)
    subscriber = KVEventSubscriber(publisher.endpoint, wire)
    index = PrefixIndex(engine.kv.layout)
    rng = random.Random(11)
    try:
        time.sleep(0.3)
        _run(engine, publisher, _prompts(rng, 8), max_tokens=6)
        assert publisher.num_dropped > 0
        wire.release.set()
        _run(engine, publisher, _prompts(rng, 2))  # its first batch is a snapshot
        _drain(subscriber, index, "engine")
        assert subscriber.num_gaps == 0  # nothing numbered was lost: the dropped batches never got a number
        for probe in _prompts(rng, 12):
            assert index.hit_tokens("engine", probe) == _fresh_hit(engine.kv, probe)
    finally:
        wire.release.set()
        subscriber.close()
        publisher.close()


def test_a_gap_the_replay_cannot_fill_forgets_the_publisher_until_its_next_snapshot(engine):
    engine.take_kv_events()
    engine.kv.reset_prefix_cache()
    wire = WireFormat(engine.kv.layout)
    # A replay buffer of 2 batches, no snapshots for now.
    publisher = KVEventPublisher("tcp://127.0.0.1:0", wire, replay_endpoint="tcp://127.0.0.1:0", buffer_batches=2,
                                 snapshot_every=0)
    rng = random.Random(5)
    try:
        while publisher.num_sent < 4:  # more batches than the replay buffer holds
            _run(engine, publisher, _prompts(rng, 1))
        late = KVEventSubscriber(publisher.endpoint, wire, replay_endpoint=publisher.replay_endpoint)
        index = PrefixIndex(engine.kv.layout)
        time.sleep(0.3)
        while not late.num_gaps:
            _run(engine, publisher, _prompts(rng, 1), max_tokens=1)
            for events in late.receive(timeout=0.5):
                index.apply("engine", events)
        assert late.num_gaps == 1 and not late.synced
        for probe in _prompts(rng, 6):  # knows nothing, so claims nothing
            assert index.hit_tokens("engine", probe) == 0
        publisher.snapshot_every = 3
        while not late.synced:
            _run(engine, publisher, _prompts(rng, 1), max_tokens=1)
            _drain(late, index, "engine", quiet=0.2)
        for probe in _prompts(rng, 12):
            assert index.hit_tokens("engine", probe) == _fresh_hit(engine.kv, probe)
        late.close()
    finally:
        publisher.close()


def test_a_taken_port_is_a_clear_error():
    layout = layout_for_requests(layer_specs(MIXES["full"]), num_requests=2, num_tokens=8)
    wire = WireFormat(layout)
    first = KVEventPublisher("tcp://127.0.0.1:0", wire)
    try:
        with pytest.raises(ValueError, match="cannot bind the KV event publisher socket"):
            KVEventPublisher(first.endpoint, wire)
    finally:
        first.close()


def _get(url: str, body: dict | None = None, timeout: float = 60) -> dict:
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return json.loads(response.read())


def test_hybridkv_serve_publishes_events_a_router_applies_and_predicts_the_next_hit(tmp_path):
    http, events = free_port(), free_port()
    replay = free_port()
    command = [sys.executable, "-m", "hybridkv.cli", "serve", "--port", str(http), "--kv-cache-memory", "8MiB",
               "--kv-events", f"tcp://*:{events}", "--kv-events-replay", f"tcp://*:{replay}",
               "--kv-events-topic", "kv", "--log-level", "warning"]
    log = open(tmp_path / "server.log", "w")
    server = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ))
    base = f"http://127.0.0.1:{http}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert server.poll() is None, (tmp_path / "server.log").read_text()
            try:
                description = _get(base + "/kv_events")
                break
            except OSError:
                assert time.monotonic() < deadline, "the server did not start"
                time.sleep(0.3)
        assert description["endpoint"] == f"tcp://0.0.0.0:{events}"  # bound on every interface
        assert description["replay_endpoint"] == f"tcp://0.0.0.0:{replay}" and description["topic"] == "kv"
        subscriber, info = subscribe_to_server(base)
        assert (info.endpoint, info.replay_endpoint) == (f"tcp://127.0.0.1:{events}", f"tcp://127.0.0.1:{replay}")
        index = PrefixIndex(info.layout, hash_function=info.hash_function)
        rng = random.Random(2)
        stem = [rng.randrange(3, 200) for _ in range(60)]
        checked = 0
        for i in range(6):
            prompt = stem[:rng.randrange(20, 60)] + [rng.randrange(3, 200) for _ in range(rng.randrange(1, 20))]
            _drain(subscriber, index, "server", quiet=0.5)
            predicted = index.hit_tokens("server", prompt)
            out = _get(base + "/v1/completions", {"prompt": prompt, "max_tokens": 2, "temperature": 0})
            assert out["usage"]["prompt_tokens_details"]["cached_tokens"] == predicted, i
            checked += predicted > 0
        _drain(subscriber, index, "server", quiet=0.5)
        assert checked >= 3 and subscriber.last_seq >= 1 and subscriber.num_gaps == 0 and subscriber.synced
        subscriber.close()
    finally:
        server.terminate()
        server.wait(30)
        log.close()
