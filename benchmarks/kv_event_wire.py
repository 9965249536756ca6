"""KV events on the wire: what vLLM's format costs, and whether vLLM reads it.

A manager over the Gemma-3-27B layout (and Jamba-1.5-Mini's) replays
manager_overhead.py's trace with KV events on, taking the events after
every admission and decode step as the server does. The batches are then

* encoded in vLLM's KV event format (kv_events/wire.py): µs per batch and
  bytes per stored block;
* sent through a real ZMQ publisher to a subscriber on loopback
  (kv_events/zmq_stream.py): batches per second end to end, all arriving in
  order;
* with `--python-vllm PATH`: decoded in that interpreter by vLLM's own
  `KVEventBatch` decoder, and every field compared with ours.

    python -m benchmarks.kv_event_wire
    python -m benchmarks.kv_event_wire --python-vllm ~/.cache/hybridkv-peers/vllm/bin/python
    python -m benchmarks.kv_event_wire --quick
"""

from __future__ import annotations

import os
import pickle
import subprocess
import tempfile
import time

from benchmarks import harness
from benchmarks.manager_overhead import replay
from benchmarks.replay_trace import CONFIGS, MODELS_DIR, make_trace
from hybridkv.core import KVCacheManager, plan_layout
from hybridkv.core.events import BlockStored
from hybridkv.core.hf_config import load_config, specs_from_config
from hybridkv.kv_events.wire import VLLM_KIND, WireFormat
from hybridkv.kv_events.zmq_stream import KVEventPublisher, KVEventSubscriber

MODELS = ("Gemma-3-27B", "Jamba-1.5-Mini")

# Run in the vLLM interpreter: decode with vLLM's classes, print what each
# event holds in plain Python, for the comparison on our side.
VLLM_DECODE = r"""
import pickle, sys, msgspec
from vllm.distributed.kv_events import KVEventBatch
payloads = pickle.load(open(sys.argv[1], "rb"))
decoder = msgspec.msgpack.Decoder(KVEventBatch)
out = []
for payload in payloads:
    batch = decoder.decode(payload)
    out.append([(type(e).__name__, list(getattr(e, "block_hashes", [])), getattr(e, "parent_block_hash", None),
                 list(getattr(e, "token_ids", [])), getattr(e, "group_idx", None),
                 getattr(e, "kv_cache_spec_kind", None)) for e in batch.events])
pickle.dump(out, open(sys.argv[2], "wb"))
"""


class Recorder:
    """A manager whose events are kept per step, as a server hands them over."""

    def __init__(self, kv):
        self.kv, self.batches = kv, []
        self._take = kv.take_events
        kv.take_events = self.take

    def take(self):
        events = self._take()
        if events:
            self.batches.append(events)
        return events


def ours_plain(events) -> list:
    """Our events as the tuples VLLM_DECODE prints for vLLM's."""
    out = []
    for e in events:
        name = type(e).__name__
        if name == "BlockStored":
            out.append((name, list(e.block_hashes), e.parent_block_hash, list(e.token_ids), e.group_idx,
                        VLLM_KIND[e.kind]))
        elif name == "BlockRemoved":
            out.append((name, list(e.block_hashes), None, [], e.group_idx, None))
        else:
            out.append((name, [], None, [], None, None))
    return out


def through_zmq(wire: WireFormat, batches: list) -> tuple[float, int]:
    publisher = KVEventPublisher("tcp://127.0.0.1:0", wire, max_queue=len(batches) + 1, snapshot_every=0)
    subscriber = KVEventSubscriber(publisher.endpoint, wire)
    time.sleep(0.3)  # the subscription reaches the publisher

    class Handed:  # send() reads a manager; hand it the recorded batches one by one
        def __init__(self):
            self.next = None

        def take_events(self):
            events, self.next = self.next, None
            return events or []

    handed = Handed()
    received = 0
    t0 = time.perf_counter()
    for events in batches:
        handed.next = events
        publisher.send(handed)
    while received < len(batches):
        got = subscriber.receive(timeout=5.0)
        if not got:
            break
        received += len(got)
    seconds = time.perf_counter() - t0
    ok = received == len(batches) and subscriber.num_gaps == 0
    subscriber.close()
    publisher.close()
    return seconds, received if ok else -1


def arguments(parser) -> None:
    parser.add_argument("--requests", type=int, default=400, help="(--quick: 40)")
    parser.add_argument("--memory", default="8GiB", help="KV budget (small enough that the trace evicts)")
    parser.add_argument("--python-vllm", default=None, metavar="PATH", help="a Python with vLLM installed")


def run(args) -> dict:
    trace = make_trace(40 if args.quick else args.requests)
    memory = "1GiB" if args.quick else args.memory
    rows = []
    print(f"{'model':<16} {'batches':>8} {'events':>8} {'blocks stored':>14} {'removed':>8} {'us/batch encode':>16} "
          f"{'B/stored block':>15} {'batches/s over ZMQ':>19} {'vLLM decoder':>14}")
    for label in MODELS:
        path = os.path.join(MODELS_DIR, CONFIGS[label])
        layout = plan_layout(specs_from_config(load_config(path)), memory, block_size=16)  # its recorded runs
        recorder = Recorder(KVCacheManager(layout, enable_kv_events=True))
        replay(recorder.kv, trace, take_events=True)
        batches = recorder.batches
        wire = WireFormat(layout, medium="GPU")
        t0 = time.perf_counter()
        payloads = [wire.encode(events) for events in batches]
        encode_us = 1e6 * (time.perf_counter() - t0) / len(batches)
        stored = sum(len(e.block_hashes) for b in batches for e in b if type(e) is BlockStored)
        removed = sum(len(e.block_hashes) for b in batches for e in b if type(e).__name__ == "BlockRemoved")
        stored_bytes = sum(len(wire.encode([e])) for b in batches[:200] for e in b if type(e) is BlockStored)
        stored_blocks = sum(len(e.block_hashes) for b in batches[:200] for e in b if type(e) is BlockStored)
        seconds, received = through_zmq(wire, batches)
        rate = f"{received / seconds:,.0f}" if received > 0 else "LOST"
        verdict = "-"
        if args.python_vllm:
            verdict = vllm_check(args.python_vllm, payloads, batches)
        row = {"model": label, "batches": len(batches), "events": sum(map(len, batches)), "blocks_stored": stored,
               "blocks_removed": removed, "us_per_batch_encode": encode_us,
               "bytes_per_stored_block": stored_bytes / max(1, stored_blocks),
               "zmq_batches_per_s": received / seconds if received > 0 else None, "vllm_decoder": verdict}
        rows.append(row)
        print(f"{label:<16} {len(batches):>8,} {row['events']:>8,} {stored:>14,} {removed:>8,} "
              f"{encode_us:>16.1f} {row['bytes_per_stored_block']:>15.0f} {rate:>19} {verdict:>14}")
    print("B/stored block: a BlockStored's bytes over its blocks (a 32-byte key and 16 token ids each, plus the "
          "event's fields), first 200 batches")
    return {"models": rows}


def vllm_check(python: str, payloads: list, batches: list) -> str:
    with tempfile.TemporaryDirectory() as tmp:
        src, dst = os.path.join(tmp, "payloads.pkl"), os.path.join(tmp, "decoded.pkl")
        with open(src, "wb") as f:
            pickle.dump(payloads, f)
        done = subprocess.run([python, "-c", VLLM_DECODE, src, dst], capture_output=True, text=True)
        if done.returncode:
            return "FAILED: " + done.stderr.strip().splitlines()[-1]
        with open(dst, "rb") as f:
            theirs = pickle.load(f)
    if len(theirs) != len(batches):
        return "MISSING"
    same = all(their == ours_plain(events) for their, events in zip(theirs, batches))
    return "all equal" if same else "MISMATCH"


if __name__ == "__main__":
    harness.main(run, arguments)
