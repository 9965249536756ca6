"""Tensor parallelism: one model split over N processes (torch.distributed:
gloo on the CPU, NCCL on CUDA), one scheduler and one KVCacheManager.

How the model is split: each rank builds the whole model's structure,
knowing its rank and the world size (layers/parallel.py), and the layers
where the split applies hold only their part (Megatron's scheme;
docs/engine.md has the table): attention by heads, the MLP and every
expert by width, Mamba layers by channels, the LM head by vocabulary rows.
A row-parallel layer all-reduces its partial sums in its forward and the
LM head gathers the logits on the driver, so the runner and the backend
run the same step, by the same route, on every rank.

So a layer costs two all-reduces of [tokens, hidden], and a step one
broadcast of its plan (engine/runner.py `StepPlan`: token ids, positions,
table rows, the block-table entries that changed, page copies) and one
gather of the sampled rows' logits. The plan travels as one int64 tensor
(plan_wire.py), never pickled: a fixed head of `HEAD_VALUES` values holds
its length, its kind and its start, and only a longer plan (a prefill of
many tokens) takes a second broadcast for the rest.

Tiers: each rank has its own host and disk tiers, holding its slices of
the blocks, and replays the driver's tier calls, which go with the plans
(kv_tiers.py). Two other messages serve them: tier calls alone (a flush
at close, or stores decided by a step that runs nothing), and a disk read
the driver is about to make: every rank reads its own file, and one
all-reduce of a flag (layers/parallel.py `every_rank`) says whether all did; if not, the
block is a miss on every rank, decided before the driver's manager counts
the hit, as a lost file is in one process.

The KV cache: every rank has a pool for its own KV heads, planned from the
per-rank specs by the same layout (same pages, same page size), so the
driver's manager, the only one, hands out block ids valid on every rank.
Ranks other than the driver keep a mirror of its block tables, fed by the
plans, and never allocate.

Ranks: the driver (rank 0) is the Engine's process; ranks 1..N-1 are
worker processes it starts (`_worker`), each loading only its slices of the
weights (modeling/loader.py reads just their bytes). A worker that fails
ends: the driver's next collective then fails instead of waiting (the
collectives have a timeout too), and the engine reports it.

Which models split, and the sizes that must divide: modeling/tensor_split.py.
"""

from __future__ import annotations

import datetime
import logging
import os
import socket
import time
import traceback

import numpy as np
import torch
import torch.distributed as dist

from ..layers.parallel import every_rank
from . import plan_wire

log = logging.getLogger("hybridkv.tensor_parallel")

TIMEOUT = datetime.timedelta(seconds=int(os.environ.get("HYBRIDKV_TP_TIMEOUT", "600")))
HEAD_VALUES = 1024  # the first broadcast of a message: its length, its kind, then its start (a decode step of 64+ fits)
PLAN, TIER_CALLS, DISK_READ = 0, 1, 2  # the kinds of message the driver sends


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class TensorParallel:
    """The driver's side: starts the workers, sends each step's plan, and
    counts what crosses between ranks."""

    def __init__(self, world: int, model_dir: str, engine_options: dict, device: torch.device):
        import torch.multiprocessing as mp

        self.world = world
        self.device = device
        self.backend = "nccl" if device.type == "cuda" else "gloo"
        self.init_method = f"tcp://127.0.0.1:{free_port()}"
        context = mp.get_context("spawn")
        self.workers = [context.Process(target=_worker, name=f"hybridkv-tp-{rank}", daemon=True,
                                        args=(rank, world, self.init_method, self.backend, model_dir,
                                              engine_options))
                        for rank in range(1, world)]
        for worker in self.workers:
            worker.start()
        if device.type == "cuda":
            torch.cuda.set_device(device.index or 0)  # rank 0's device; rank r uses cuda:r
        dist.init_process_group(self.backend, init_method=self.init_method, world_size=world, rank=0,
                                timeout=TIMEOUT)
        self.layout = engine_options["layout"]
        wire_device = torch.device("cuda", device.index or 0) if self.backend == "nccl" else torch.device("cpu")
        self.wire = PlanWire(wire_device)
        self.steps = 0
        self.bytes_sent = 0  # plans broadcast (their encoded values; the head's padding not counted)
        self.plan_seconds = 0.0  # the driver's time encoding and broadcasting plans
        self.closed = False
        self.leads = True  # for the tiers' disk reads (kv_tiers.TieredStore.agreement): the driver asks

    def check_workers(self) -> None:
        for worker in self.workers:
            if not worker.is_alive():
                raise RuntimeError(f"tensor-parallel worker {worker.name} exited (code {worker.exitcode}); "
                                   f"its error is in its log above")

    def send_plan(self, plan) -> None:
        self.check_workers()
        started = time.perf_counter()
        data = plan_wire.encode(plan, self.layout)
        self.wire.send(data)
        self.plan_seconds += time.perf_counter() - started
        self.steps += 1
        self.bytes_sent += data.nbytes

    def send_tier_calls(self, calls: list) -> None:
        """Tier calls decided outside a step (a flush, stores of a step that
        runs nothing): the workers replay them and make their copies now,
        so that every rank's tiers move in the same order."""
        if calls and not self.closed:
            self.check_workers()
            self.wire.send(plan_wire.encode_tier_calls(calls), TIER_CALLS)

    def ask(self, item: tuple) -> None:
        """Every worker is to read disk block `item` (group, key) and vote
        (`all`)."""
        self.check_workers()
        self.wire.send(plan_wire.encode_block(*item), DISK_READ)

    def all(self, ok: bool) -> bool:
        return every_rank(ok)

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        try:
            if all(w.is_alive() for w in self.workers):
                self.wire.send(None)  # the workers' signal to stop
        finally:
            for worker in self.workers:
                worker.join(30)
                if worker.is_alive():
                    worker.terminate()
            if dist.is_initialized():
                dist.destroy_process_group()


class PlanWire:
    """Messages as int64 tensors from the driver to every worker: a head of
    HEAD_VALUES values (the message's length, -1 to stop; its kind; then
    its start) and, for a longer one, a second broadcast of the rest. On
    NCCL the tensors go through the rank's device."""

    ROOM = HEAD_VALUES - 2  # the values of a message the head holds

    def __init__(self, device: torch.device):
        self.device = device
        self.head = torch.zeros(HEAD_VALUES, dtype=torch.int64, device=device)

    def send(self, data: np.ndarray | None, kind: int = PLAN) -> None:
        n = -1 if data is None else len(data)
        first = np.empty(HEAD_VALUES, dtype=np.int64)
        first[:2] = n, kind
        if n > 0:
            start = data[:self.ROOM]
            first[2:2 + len(start)] = start
        self.head.copy_(torch.from_numpy(first))
        dist.broadcast(self.head, src=0)
        if n > self.ROOM:
            dist.broadcast(torch.from_numpy(data[self.ROOM:]).to(self.device), src=0)

    def receive(self) -> tuple[int, np.ndarray] | None:
        """(kind, message), or None: stop."""
        dist.broadcast(self.head, src=0)
        head = self.head.cpu().numpy()
        n, kind = int(head[0]), int(head[1])
        if n < 0:
            return None
        if n <= self.ROOM:
            return kind, head[2:2 + n].copy()
        rest = torch.empty(n - self.ROOM, dtype=torch.int64, device=self.device)
        dist.broadcast(rest, src=0)
        return kind, np.concatenate([head[2:], rest.cpu().numpy()])


def _worker(rank: int, world: int, init_method: str, backend: str, model_dir: str, options: dict) -> None:
    """A rank other than the driver: load this rank's shard, then act on
    every message the driver broadcasts (a plan to run, tier calls to
    replay, a disk read to make and vote on) until it sends None."""
    try:
        torch.set_num_threads(options.pop("threads", torch.get_num_threads()))
        if backend == "nccl":
            torch.cuda.set_device(rank)
        dist.init_process_group(backend, init_method=init_method, world_size=world, rank=rank, timeout=TIMEOUT)
        from ..layers.backends import choose as choose_backend
        from ..modeling.loader import load_model
        from .runner import ModelRunner, StepPlan

        device = torch.device(options["device"])
        if device.type == "cuda":  # one device per rank
            device = torch.device("cuda", rank)
            torch.cuda.set_device(device)
        model, _ = load_model(model_dir, dtype=options["dtype"], device=device, progress=False,
                              tensor_parallel=(rank, world))
        layout = options["layout"]
        wire = PlanWire(device if backend == "nccl" else torch.device("cpu"))
        follower = Follower()
        runner = ModelRunner(model, layout, None, device, choose_backend(options["backend"], device),
                             options["max_num_seqs"], options["max_model_len"], parallel=follower)
        tiers = options["tiers"]
        if tiers is not None:  # this rank's tiers: the driver's decisions, its own bytes and files
            from .kv_tiers import TieredStore

            runner.tiers = TieredStore(runner.buffers.pool, layout, host_bytes=tiers["host_bytes"],
                                       disk_dir=tiers["disk_dir"], disk_bytes=tiers["disk_bytes"],
                                       identity=tiers["identities"][rank])
            runner.tiers.agreement = follower
        with torch.inference_mode():
            while True:
                message = wire.receive()
                if message is None:
                    break
                kind, data = message
                if kind == DISK_READ:
                    runner.tiers.read_agreed(plan_wire.decode_block(data))
                elif kind == TIER_CALLS:
                    runner.tiers.replay(plan_wire.decode_tier_calls(data))
                    runner.tiers.copy(runner.tiers.take_copies())
                else:
                    runner.run_plan(plan_wire.decode(data, layout, StepPlan))  # its LM head sends its logits
    except Exception:
        traceback.print_exc()
        os._exit(1)
    dist.destroy_process_group()


class Follower:
    """A worker's `parallel`: it receives plans rather than sending them;
    for its tiers' disk reads, it reads when the driver asks and votes."""

    leads = False

    def ask(self, item: tuple) -> None:
        pass  # the driver asked: this rank is already reading

    def all(self, ok: bool) -> bool:
        return every_rank(ok)
