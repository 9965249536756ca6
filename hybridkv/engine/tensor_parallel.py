"""Tensor parallelism: one model split over N processes (torch.distributed:
gloo on the CPU, NCCL on CUDA), one scheduler and one KVCacheManager; the
executor (executor.py's contract) that runs each step on every rank's
worker (worker.py: the same class on every rank, by the same route).

How the model is split: each rank builds the whole model's structure,
knowing its rank and the world size (layers/parallel.py), and the layers
where the split applies hold only their part (Megatron's scheme;
docs/engine.md has the table): attention by heads, the MLP and every
expert by width, Mamba layers by channels, the LM head by vocabulary rows.
A row-parallel layer all-reduces its partial sums in its forward and the
LM head gathers the logits on the driver, so every rank's worker and
backend run the same step, by the same route.

So a layer costs two all-reduces of [tokens, hidden], and a step one
message of its plan (step_plan.py: token ids, positions, table rows, the
block-table entries that changed, page copies) and one gather of the
sampled rows' logits (and of prompt-logprob rows, a slice at a time). The
plan travels as one int64 array (plan_wire.py), never pickled, written
into a pipe to each worker (`PlanWire`: the ranks share a host; a
collective would cost the driver ~200 us a step).

Tiers: each rank has its own host and disk storage, holding its slices of
the blocks; the tier copies go with the plans (core/tiers.py TierPlan) and
every rank makes them on its own pool. In a step with loads one all-reduce
of the failures (tier_copies.py) makes a load that failed on any rank fail
on every rank, before the forward pass, and the driver's worker reports it
with the step's logits. One other message serves them: tier copies alone
(a flush at close, a reset, or stores decided by a step that runs nothing).

The KV cache: every rank has a pool for its own KV heads, planned from the
per-rank specs by the same layout (same pages, same page size), so the
driver's manager, the only one, hands out block ids valid on every rank.
Every rank's worker holds the device tables, fed by the plans' table
changes (tables.py), and none allocates.

Ranks: the driver (rank 0) is the Engine's process; ranks 1..N-1 are
worker processes it starts (`_worker`), each loading only its slices of the
weights (modeling/loader.py reads just their bytes). A worker that fails
ends: the driver's next collective then fails instead of waiting (the
collectives have a timeout too), and the engine reports it. Start-up is
watched the same way: the ranks meet through a store the driver holds, and
each worker says there when it has joined and when its shard is loaded;
the driver waits for both while checking that every worker still runs, so a
worker that dies while starting (an import that fails, a shard that does
not load) fails the engine at once rather than after the group's timeout.

Once loaded, the workers are watched while they serve: each beats (a
counter in memory shared with the driver, from a thread of its own, every
fraction of a second), and a thread in the driver (`_watch`) checks the
beats and that each worker still runs. A worker that exits, or goes
silent past `heartbeat_timeout` (stopped, or hung: a stopped process's
threads all stop), fails the engine within seconds, idle or not, instead
of the next step failing or waiting out the collectives' timeout: the
driver kills every worker (a collective blocked on one then fails at
once) and tells who listens (`watch`: the server's engine loop, which
fails the requests in flight and answers /health with 503).

Which models split, and the sizes that must divide: modeling/tensor_split.py.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import os
import socket
import struct
import threading
import time
import traceback

import numpy as np
import torch
import torch.distributed as dist

from ..layers.parallel import use_host_reduce
from .host_reduce import create_segment, open_host_reduce, segment_path
from .plan_wire import decode, decode_tiers, encode, encode_tiers

log = logging.getLogger("hybridkv.tensor_parallel")

PLAN, TIER_COPIES = 0, 1  # the kinds of message the driver sends


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class TensorParallelExecutor:
    """The driver's side: starts the workers, sends each step's plan, runs
    rank 0's worker (this process's: `worker`, set once the group is up),
    and counts what crosses between ranks."""

    def __init__(self, world: int, model_dir: str, worker_options: dict, device: torch.device,
                 timeout: float = 600.0, heartbeat_timeout: float = 5.0):
        import torch.multiprocessing as mp

        self.world = world
        self.device = device
        self.backend = "nccl" if device.type == "cuda" else "gloo"
        self.timeout = datetime.timedelta(seconds=timeout)  # the store's and the collectives'
        self.heartbeat_timeout = heartbeat_timeout
        self.beat = min(0.5, heartbeat_timeout / 4)  # seconds between beats and between looks: several to a timeout
        self.failure: str | None = None  # why the watchdog stopped the workers, once it has
        self._listeners: list = []  # watch()'s callbacks
        # The ranks' meeting point; the driver serves it and need not wait
        # for the workers to connect (it watches them while they start).
        port = free_port()
        self.store = dist.TCPStore("127.0.0.1", port, world, is_master=True, timeout=self.timeout,
                                   wait_for_workers=False)
        context = mp.get_context("spawn")
        pipes = [context.Pipe(duplex=False) for _ in range(1, world)]  # (the worker's end, the driver's)
        self.beats = context.RawArray("q", world)  # rank r's heartbeats, counted by rank r (rank 0's unused)
        # On the CPU the ranks' all-reduces go through one shared-memory segment (engine/host_reduce.py).
        self.segment = None
        if self.backend == "gloo":
            self.segment = segment_path()
            create_segment(self.segment, world)
        self.host_reduce = None
        self.workers = [context.Process(target=_worker, name=f"hybridkv-tp-{rank}", daemon=True,
                                        args=(rank, world, port, self.backend, model_dir, worker_options,
                                              pipes[rank - 1][0], timeout, self.beats, self.beat, self.segment))
                        for rank in range(1, world)]
        for worker in self.workers:
            worker.start()
        if device.type == "cuda":
            torch.cuda.set_device(device.index or 0)  # rank 0's device; rank r uses cuda:r
        try:
            self._wait_for("joined")
            dist.init_process_group(self.backend, store=self.store, world_size=world, rank=0, timeout=self.timeout)
            if self.segment is not None:
                self.host_reduce = open_host_reduce(self.segment, 0, world, timeout)
                use_host_reduce(self.host_reduce)
        except BaseException:
            self._stop_workers()
            self._drop_segment()
            raise
        self.wire = PlanWire([driver_end for _, driver_end in pipes])
        for worker_end, _ in pipes:
            worker_end.close()  # the workers hold theirs
        self.worker = None  # rank 0's Worker (engine.py builds it once the group is up)
        self._accepted: dict | None = None  # kept drafts the other ranks apply with the next plan
        self.steps = 0
        self.bytes_sent = 0  # plans sent (their encoded values, to each worker)
        self.plan_seconds = 0.0  # the driver's time encoding and sending plans
        self.closed = False

    def check_workers(self, while_doing: str = "") -> None:
        if self.failure is not None:
            raise RuntimeError(self.failure)
        for worker in self.workers:
            if not worker.is_alive():
                raise RuntimeError(f"tensor-parallel worker {worker.name} exited (code {worker.exitcode})"
                                   f"{while_doing}; its error is in its log above")

    def _wait_for(self, stage: str) -> None:
        """Until every worker has said `stage` in the store ("joined": it is
        about to join the group; "loaded": its shard and worker are built),
        checking meanwhile that each still runs."""
        keys = [f"{stage}/{rank}" for rank in range(1, self.world)]
        deadline = time.monotonic() + self.timeout.total_seconds()
        while not self.store.check(keys):
            self.check_workers(f" while starting (before it had {stage})")
            if time.monotonic() > deadline:
                raise RuntimeError(f"tensor-parallel workers not {stage} after {self.timeout.total_seconds():.0f} s "
                                   f"(tensor_parallel_timeout)")
            time.sleep(0.02)

    def wait_until_loaded(self) -> None:
        """Return once every worker has loaded its shard and built its
        worker (the engine calls it after building rank 0's, so the ranks
        load side by side); a worker that died on the way fails it at once."""
        try:
            self._wait_for("loaded")
        except BaseException:
            self.closed = True
            self._stop_workers()  # (the others wait for a plan that will not come)
            if dist.is_initialized():
                dist.destroy_process_group()
            raise
        finally:
            self._drop_segment()  # every rank has mapped it (or is gone): its name can go
        threading.Thread(target=self._watch, name="hybridkv-tp-watchdog", daemon=True).start()

    def watch(self, on_failure) -> None:
        """Call `on_failure(message)` (on the watchdog's thread) once a
        worker has exited or hung; at once if one already has."""
        self._listeners.append(on_failure)
        if self.failure is not None:
            on_failure(self.failure)

    def _watch(self) -> None:
        """The watchdog: every fraction of a second, has each worker beaten
        since, and does it still run? Silence is timed only while this
        thread itself ran on time: were the driver held up, or the whole
        machine, it could not tell who was silent."""
        seen = list(self.beats)
        heard = [time.monotonic()] * self.world  # when each rank's count last changed
        last_tick = heard[0]
        while not self.closed:
            time.sleep(self.beat)
            now = time.monotonic()
            if now - last_tick > self.heartbeat_timeout / 2:  # this thread was held up: time anew
                heard = [now] * self.world
            last_tick = now
            for rank, worker in enumerate(self.workers, 1):
                beats = self.beats[rank]
                if beats != seen[rank]:
                    seen[rank], heard[rank] = beats, now
                if not worker.is_alive():
                    problem = f"exited (code {worker.exitcode})"
                elif now - heard[rank] > self.heartbeat_timeout:
                    problem = (f"stopped answering: no heartbeat for {now - heard[rank]:.1f} s "
                               f"(hung, or stopped by a signal)")
                else:
                    continue
                if not self.closed:  # (close() stops them on purpose)
                    self._lost(f"tensor-parallel worker {worker.name} {problem}; every worker is stopped")
                return

    def _lost(self, message: str) -> None:
        """A worker is gone or hung: the group can never run a step again.
        Kill every worker (SIGKILL ends a stopped process too), so that a
        collective the driver is blocked in fails now rather than after the
        timeout, then tell the listeners."""
        self.failure = message
        log.error("%s", message)
        if self.host_reduce is not None:
            self.host_reduce.abort()  # a rank waiting in an all-reduce gives up now
        for worker in self.workers:
            worker.kill()
        for on_failure in self._listeners:
            on_failure(message)

    def _stop_workers(self) -> None:
        for worker in self.workers:
            if worker.is_alive():
                worker.terminate()
            worker.join(30)

    def execute(self, plan) -> tuple:
        """Send the plan, then run rank 0's part of it (the others run
        theirs meanwhile; the layers' all-reduces keep them in step)."""
        self.check_workers()
        try:
            # The other ranks' copy carries the kept drafts rank 0 applied when they were judged.
            self._send(dataclasses.replace(plan, accepted=self._accepted))
            self._accepted = None
            return self.worker.execute(plan)
        except Exception as e:
            if self.failure is not None:  # the watchdog killed the workers under this step: say why
                raise RuntimeError(self.failure) from e
            raise

    def _send(self, plan) -> None:
        started = time.perf_counter()
        data = encode(plan)
        self.wire.send(data)
        self.plan_seconds += time.perf_counter() - started
        self.steps += 1
        self.bytes_sent += data.nbytes

    def keep_accepted(self, accepted: dict[int, int]) -> None:
        """Rank 0 keeps the drafts now; the other ranks before the next plan
        (they run it before anything reads the states)."""
        self.worker.keep_accepted(accepted)
        self._accepted = accepted

    def copy_tiers(self, plan):
        """Tier copies decided outside a step (a flush, a reset, stores of a
        step that runs nothing): every rank makes them now. Returns rank
        0's report."""
        if not self.closed and self.failure is None:  # (failed: no worker is left to copy)
            self.check_workers()
            self.wire.send(encode_tiers(plan), TIER_COPIES)
        return self.worker.copy_tiers(plan)

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        try:
            if self.failure is None and all(w.is_alive() for w in self.workers):
                self.wire.send(None)  # the workers' signal to stop
        finally:
            for worker in self.workers:
                worker.join(30)
                if worker.is_alive():
                    worker.terminate()
            if dist.is_initialized():
                dist.destroy_process_group()
            self.store = None
            if self.host_reduce is not None:
                use_host_reduce(None)
            self._drop_segment()

    def _drop_segment(self) -> None:
        if self.segment is not None:
            try:
                os.unlink(self.segment)
            except FileNotFoundError:
                pass
            self.segment = None


class PlanWire:
    """Messages from the driver to every worker, as int64 arrays over one
    pipe per worker (the ranks share a host): a length (-1: stop), a kind,
    then the values. Writing a step's plan into a pipe costs the driver a
    few microseconds, where a gloo broadcast cost it ~200 (one thread
    handing the message to another, then waiting for the socket); the
    worker, blocked on its read, wakes to it and runs the step, its first
    all-reduce waiting for the driver's."""

    HEAD = struct.Struct("<qq")  # length, kind

    def __init__(self, connections: list):
        self.connections = connections  # the driver's ends; a worker holds its one

    def send(self, data: np.ndarray | None, kind: int = PLAN) -> None:
        n = -1 if data is None else len(data)
        message = self.HEAD.pack(n, kind) + (b"" if data is None else data.astype(np.int64, copy=False).tobytes())
        for connection in self.connections:
            connection.send_bytes(message)

    def receive(self) -> tuple[int, np.ndarray] | None:
        """(kind, message), or None: stop (or the driver is gone)."""
        try:
            message = self.connections[0].recv_bytes()
        except EOFError:
            return None
        n, kind = self.HEAD.unpack_from(message)
        if n < 0:
            return None
        return kind, np.frombuffer(message, dtype=np.int64, offset=self.HEAD.size).copy()


def _worker(rank: int, world: int, port: int, backend: str, model_dir: str, options: dict,
            connection, timeout: float, beats, beat: float, segment: str | None) -> None:
    """A rank other than the driver: load this rank's shard, then beat
    (`_beat`) and act on every message the driver sends (a plan to run,
    tier copies to make) until it sends None."""
    try:
        torch.set_num_threads(options.pop("threads", torch.get_num_threads()))
        if backend == "nccl":
            torch.cuda.set_device(rank)
        seconds, timeout = timeout, datetime.timedelta(seconds=timeout)
        store = dist.TCPStore("127.0.0.1", port, world, is_master=False, timeout=timeout)
        store.set(f"joined/{rank}", "1")
        dist.init_process_group(backend, store=store, world_size=world, rank=rank, timeout=timeout)
        if segment is not None:
            use_host_reduce(open_host_reduce(segment, rank, world, seconds))
        from ..layers.backends import choose as choose_backend
        from ..modeling.loader import load_model
        from .worker import Worker

        device = torch.device(options["device"])
        if device.type == "cuda":  # one device per rank
            device = torch.device("cuda", rank)
            torch.cuda.set_device(device)
        model, _ = load_model(model_dir, dtype=options["dtype"], device=device, progress=False,
                              tensor_parallel=(rank, world))
        layout = options["layout"]
        wire = PlanWire([connection])
        worker = Worker(model, layout, device, choose_backend(options["backend"], device), **options["worker"])
        tiers = options["tiers"]
        if tiers is not None:  # this rank's storage: its own bytes and files
            from ..tiers import TierStore

            worker.tiers = TierStore(layout.page_size_bytes, len(layout.groups), host_bytes=tiers["host_bytes"],
                                     disk_dir=tiers["disk_dir"], disk_bytes=tiers["disk_bytes"],
                                     identity=tiers["identities"][rank], pin=tiers["pin"])
        threading.Thread(target=_beat, args=(beats, rank, beat), name="hybridkv-tp-heartbeat", daemon=True).start()
        store.set(f"loaded/{rank}", "1")
        with torch.inference_mode():
            while True:
                message = wire.receive()
                if message is None:
                    break
                kind, data = message
                if kind == TIER_COPIES:
                    worker.copy_tiers(decode_tiers(data))
                else:
                    worker.execute(decode(data, layout))  # its LM head sends its logits
    except Exception:
        traceback.print_exc()
        os._exit(1)
    dist.destroy_process_group()


def _beat(beats, rank: int, interval: float) -> None:
    """A worker's heartbeat, for the driver's watchdog: a thread of its
    own, so that it goes on through long steps (torch's ops and the
    collectives leave the GIL) and stops only with the process."""
    while True:
        beats[rank] += 1
        time.sleep(interval)
