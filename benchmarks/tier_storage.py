"""The disk tier's storage: one file per block (what hybridkv uses) against
an embedded key-value store made for this (LMDB), on the same blocks.

A block is stored when the pool (or host memory) evicts it and read back on
a hit, one at a time, so each is measured per block: a write (files: write
to a temporary name and rename; LMDB: one write transaction per block, the
same durability: what a killed process had committed survives, no fsync;
the value carries a CRC-32 checked on read, as the files do), a read in
random order into a tensor, and, for files, a restart's scan of the directory
(LMDB opens its map instead). Both stores keep the block's bytes as
written; the files also carry the tier's header and CRC (they are
DiskTier's own files). Rounds alternate which store goes first.

    python -m benchmarks.tier_storage                 # 2000 blocks of 96 KiB (a Gemma-3 270M block)
    python -m benchmarks.tier_storage --blocks 500 --block-kib 512
    python -m benchmarks.tier_storage --quick         # CI
"""

from __future__ import annotations

import random
import shutil
import statistics
import tempfile
import time

from benchmarks import harness


def run_files(root: str, blocks: list[tuple[bytes, "torch.Tensor"]], page_size: int, order: list[int]) -> dict:
    from hybridkv.tiers import DiskTier

    identity = bytes(32)
    tier = DiskTier(root, identity, page_size, 1 << 40)
    t0 = time.perf_counter()
    for key, content in blocks:
        tier.write(1, key, content)
    write = time.perf_counter() - t0
    t0 = time.perf_counter()
    for i in order:
        assert tier.read(1, blocks[i][0]) is not None
    read = time.perf_counter() - t0
    t0 = time.perf_counter()
    again = DiskTier(root, identity, page_size, 1 << 40)  # a restart lists what is there
    scan = time.perf_counter() - t0
    assert len(again.files) == len(blocks)
    return {"write_us": 1e6 * write / len(blocks), "read_us": 1e6 * read / len(blocks),
            "restart_ms": 1e3 * scan}


def run_lmdb(root: str, blocks: list[tuple[bytes, "torch.Tensor"]], order: list[int]) -> dict:
    import torch
    import zlib

    import lmdb

    size = sum(c.numel() for _, c in blocks) * 2 + (64 << 20)
    env = lmdb.open(root, map_size=size, sync=False, metasync=False, readahead=False)
    t0 = time.perf_counter()
    for key, content in blocks:
        with env.begin(write=True) as txn:
            data = content.numpy().tobytes()  # with a CRC, as the files have: the same checks on read
            txn.put(key, data + zlib.crc32(data).to_bytes(4, "little"))
    write = time.perf_counter() - t0
    t0 = time.perf_counter()
    with env.begin() as txn:
        for i in order:
            value = txn.get(blocks[i][0])
            assert zlib.crc32(value[:-4]) == int.from_bytes(value[-4:], "little")
            torch.frombuffer(bytearray(value[:-4]), dtype=torch.uint8)
    read = time.perf_counter() - t0
    env.close()
    t0 = time.perf_counter()
    env = lmdb.open(root, map_size=size, sync=False, readahead=False)
    with env.begin() as txn:
        assert txn.stat()["entries"] == len(blocks)
    scan = time.perf_counter() - t0
    env.close()
    return {"write_us": 1e6 * write / len(blocks), "read_us": 1e6 * read / len(blocks),
            "restart_ms": 1e3 * scan}


def arguments(parser) -> None:
    parser.add_argument("--blocks", type=int, default=2000, help="(--quick: 50 of 16 KiB)")
    parser.add_argument("--block-kib", type=int, default=96, help="bytes per block, in KiB (default 96)")
    parser.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")


def run(args) -> dict:
    """`--repeat` rounds, the stores taking turns."""
    if args.quick:
        args.blocks, args.block_kib = 50, 16

    import torch

    try:
        import lmdb  # noqa: F401
        stores = ["files", "lmdb"]
    except ImportError:
        print("lmdb is not installed (pip install lmdb): measuring the files only")
        stores = ["files"]
    page_size = args.block_kib * 1024
    rng = random.Random(0)
    blocks = [(rng.randbytes(32), torch.randint(0, 255, (1, page_size), dtype=torch.uint8))
              for _ in range(args.blocks)]
    order = list(range(args.blocks))
    rng.shuffle(order)
    base = tempfile.mkdtemp(prefix="hybridkv-storage-", dir=args.dir)

    def measure(store: str) -> dict:
        root = tempfile.mkdtemp(prefix=store, dir=base)
        try:
            return run_files(root, blocks, page_size, order) if store == "files" else run_lmdb(root, blocks, order)
        finally:
            shutil.rmtree(root)

    try:
        runs = harness.interleaved({store: lambda store=store: measure(store) for store in stores}, args.repeat)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    print(f"{args.blocks} blocks of {args.block_kib} KiB, {args.repeat} rounds (median)\n")
    print(f"{'store':<6} {'write us/block':>15} {'read us/block':>14} {'restart ms':>11}")
    rows = []
    for store in stores:
        row = {"store": store, "blocks": args.blocks, "block_bytes": page_size,
               **{k: statistics.median(run[k] for run in runs[store]) for k in runs[store][0]}}
        rows.append(row)
        print(f"{store:<6} {row['write_us']:>15.0f} {row['read_us']:>14.0f} {row['restart_ms']:>11.1f}")
    return {"stores": rows}


if __name__ == "__main__":
    harness.main(run, arguments, repeat=3)
