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
its length and its start, and only a longer plan (a prefill of many
tokens) takes a second broadcast for the rest.

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

from . import plan_wire

log = logging.getLogger("hybridkv.tensor_parallel")

TIMEOUT = datetime.timedelta(seconds=int(os.environ.get("HYBRIDKV_TP_TIMEOUT", "600")))
HEAD_VALUES = 1024  # the first broadcast of a plan: its length, then its start (a decode step of 64+ fits)


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
    """Plans as int64 tensors from the driver to every worker: a head of
    HEAD_VALUES values (the plan's length, -1 to stop, then its start) and,
    for a longer plan, a second broadcast of the rest. On NCCL the tensors
    go through the rank's device."""

    def __init__(self, device: torch.device):
        self.device = device
        self.head = torch.zeros(HEAD_VALUES, dtype=torch.int64, device=device)

    def send(self, data: np.ndarray | None) -> None:
        n = -1 if data is None else len(data)
        first = np.empty(HEAD_VALUES, dtype=np.int64)
        first[0] = n
        if n > 0:
            start = data[:HEAD_VALUES - 1]
            first[1:1 + len(start)] = start
        self.head.copy_(torch.from_numpy(first))
        dist.broadcast(self.head, src=0)
        if n > HEAD_VALUES - 1:
            dist.broadcast(torch.from_numpy(data[HEAD_VALUES - 1:]).to(self.device), src=0)

    def receive(self) -> np.ndarray | None:
        dist.broadcast(self.head, src=0)
        head = self.head.cpu().numpy()
        n = int(head[0])
        if n < 0:
            return None
        if n <= HEAD_VALUES - 1:
            return head[1:1 + n].copy()
        rest = torch.empty(n - (HEAD_VALUES - 1), dtype=torch.int64, device=self.device)
        dist.broadcast(rest, src=0)
        return np.concatenate([head[1:], rest.cpu().numpy()])


def _worker(rank: int, world: int, init_method: str, backend: str, model_dir: str, options: dict) -> None:
    """A rank other than the driver: load this rank's shard, then run every
    plan the driver broadcasts until it sends None."""
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
        runner = ModelRunner(model, layout, None, device, choose_backend(options["backend"], device),
                             options["max_num_seqs"], options["max_model_len"], parallel=Follower())
        if options["host_tier_bytes"]:  # this rank's host tier: the driver's decisions, its own bytes
            from .kv_tiers import TieredStore

            runner.tiers = TieredStore(runner.buffers.pool, layout, host_bytes=options["host_tier_bytes"])
        wire = PlanWire(device if backend == "nccl" else torch.device("cpu"))
        with torch.inference_mode():
            while True:
                data = wire.receive()
                if data is None:
                    break
                runner.run_plan(plan_wire.decode(data, layout, StepPlan))  # its LM head sends its logits
    except Exception:
        traceback.print_exc()
        os._exit(1)
    dist.destroy_process_group()


class Follower:
    """A worker's `parallel`: it receives plans rather than sending them."""
