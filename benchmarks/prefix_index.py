"""The prefix index a router holds (core/prefix_index.py): memory per
indexed block and time to rank the replicas for one request.

Replicas hold chains of blocks of a Gemma-3-27B layout (two groups): each
replica's events store a number of conversations, prompts sharing a few
system prompts, so keys repeat across replicas as they would. Then `best`
ranks every replica for requests that extend stored prompts.

    python -m benchmarks.prefix_index               # 10^6 blocks over 64 replicas
    python -m benchmarks.prefix_index --quick
"""

from __future__ import annotations

import os
import random
import time
import tracemalloc

from benchmarks import harness
from hybridkv.core import plan_layout
from hybridkv.core.events import BlockStored
from hybridkv.core.hf_config import load_config, specs_from_config
from hybridkv.core.prefix_index import PrefixIndex

MODELS = os.path.join(harness.ROOT, "models")


def arguments(parser) -> None:
    parser.add_argument("--blocks", type=int, default=10**6, help="blocks indexed, over all replicas and groups")
    parser.add_argument("--replicas", type=int, default=64)


def run(args) -> dict:
    if args.quick:
        args.blocks, args.replicas = 20_000, 8
    layout = plan_layout(specs_from_config(load_config(os.path.join(MODELS, "gemma-3-27b.json"))), "80GiB")
    bs = layout.block_size
    index = PrefixIndex(layout)
    rng = random.Random(0)
    systems = [[rng.randrange(1, 32000) for _ in range(rng.randrange(200, 800))] for _ in range(8)]
    groups = len(layout.groups)
    def conversation(seed: int) -> list[int]:
        # Made again from its seed when needed: keeping every prompt's
        # tokens would weigh more than the index being measured.
        own = random.Random(seed)
        return own.choice(systems) + [own.randrange(1, 32000) for _ in range(own.randrange(100, 1500))]

    seeds = []
    tracemalloc.start()
    stored = 0
    t0 = time.perf_counter()
    while stored < args.blocks:
        replica = rng.randrange(args.replicas)
        seed = rng.randrange(1 << 62)
        keys, _ = index.block_keys(conversation(seed) + [0], None, None)
        events = [BlockStored(keys, None, [], bs, g, m.kind) for g, m in enumerate(index.managers)]
        index.apply(replica, events)
        stored += len(keys) * groups
        seeds.append(seed)
    build = time.perf_counter() - t0
    memory = tracemalloc.get_traced_memory()[0]  # the index (and the seeds: 8 B per conversation)
    tracemalloc.stop()
    probes = [conversation(rng.choice(seeds)) + [rng.randrange(1, 32000) for _ in range(20)] for _ in range(200)]
    t0 = time.perf_counter()
    for probe in probes:
        index.best(probe)
    rank = (time.perf_counter() - t0) / len(probes)
    ranked = [len(index.best(probe)) for probe in probes]
    probe_tokens = sum(map(len, probes)) / len(probes)
    hashed = time.perf_counter()
    for probe in probes:
        index.block_keys(probe, None, None)
    hashing = (time.perf_counter() - hashed) / len(probes)
    row = {"blocks_stored": stored, "keys_indexed": index.num_keys, "replicas": args.replicas,
           "bytes_per_block": memory / stored, "bytes_per_key": memory / index.num_keys,
           "us_per_best": 1e6 * rank, "us_hashing_per_request": 1e6 * hashing, "probe_tokens": probe_tokens,
           "build_s": build, "replicas_with_a_hit": sum(ranked) / len(ranked)}
    print(f"{'blocks':>10} {'keys':>10} {'replicas':>8} {'B/block':>8} {'B/key':>6} {'us/best':>8} "
          f"{'(hashing)':>10} {'tokens/probe':>13} {'replicas hit':>13}")
    print(f"{stored:>10,} {index.num_keys:>10,} {args.replicas:>8} {row['bytes_per_block']:>8.0f} "
          f"{row['bytes_per_key']:>6.0f} {row['us_per_best']:>8.0f} {row['us_hashing_per_request']:>10.0f} "
          f"{probe_tokens:>13.0f} {row['replicas_with_a_hit']:>13.1f}")
    return {"index": [row]}


if __name__ == "__main__":
    harness.main(run, arguments)
