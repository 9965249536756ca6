"""The model runner: turns a scheduled step into tensors, runs the model over
the paged cache, and returns the logits to sample from.

Who builds what (docs/engine.md has the diagram):
* the persistent tables (tables.py) hold every running sequence's block
  table on the device, refreshed only where the manager changed them;
* the runner writes the step's facts (`StepInputs`: tokens, positions, each
  sequence's table row, the split into decodes and chunks) into device
  tensors, once; for each attention group it adds what every backend reads
  (`attention_step`: where the new K/V goes, each query's first key);
* the backend chosen at start (layers/backends/) turns them into its own
  metadata, once per KV cache group, and its ops are what the layers call;
  it prepared the model once (`prepare_report` says how) and names each
  eager step's route, which the runner counts (`routes`).

Two kinds of step. A decode step (one new token per sequence) at fixed
shapes: padded to a bucket of sequences (1, 2, 4, ... up to max_num_seqs),
its inputs in preallocated buffers, padded rows pointing at the padding
table row (sink pages) and never sampled; on CUDA each bucket's forward and
LM head is captured once as a CUDA graph and replayed. Any other step
(prefill chunks, mixed) runs eagerly with host-side metadata that reads only
the blocks each query needs. On the CPU decode steps run eagerly too (no
graph to gain, and the exact reads are cheaper than a bound), unless
`fixed_shape_decode` asks for the fixed path (the tests do).
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass, field

import numpy as np
import torch

from ..core import KVCacheManager
from ..core.layout import KVCacheLayout
from ..layers.backends import Backend
from ..layers.kv_buffers import KVBuffers
from ..layers.step import StepBatch, StepInputs, attention_step
from ..modeling.base import CausalLM
from .scheduler import Scheduled
from .tables import DeviceTables


@dataclass
class StepPlan:
    """An eager step as plain arrays: what the runner needs to run it, and
    all a tensor-parallel rank receives (it holds no manager)."""
    ids: np.ndarray  # [T] token ids, sequence after sequence
    first_positions: np.ndarray  # [S]
    counts: np.ndarray  # [S] tokens of each sequence in this step
    rows: np.ndarray  # [S] each sequence's table row
    verifying: np.ndarray | None  # [S] bool, or None: no sequence verifies drafts
    sampled: np.ndarray  # token rows whose logits are sampled
    seq_ids: list  # for keep_accepted (on a tensor-parallel worker: 0..S-1)
    copies: list = field(default_factory=list)  # (source page, destination page) to copy first
    table_changes: list = field(default_factory=list)  # DeviceTables.changes() of the driver
    accepted: dict | None = None  # the previous step's kept drafts (keep_accepted), applied first
    tier_log: list = field(default_factory=list)  # the driver's tier calls, replayed by a worker's tiers


def buckets(max_num_seqs: int) -> list[int]:
    """Decode batch sizes that get their own shapes: powers of two, and
    max_num_seqs itself."""
    out, b = [], 1
    while b < max_num_seqs:
        out.append(b)
        b *= 2
    return out + [max_num_seqs]


class ModelRunner:
    def __init__(self, model: CausalLM, layout: KVCacheLayout, kv: KVCacheManager, device: torch.device,
                 backend: Backend, max_num_seqs: int, max_model_len: int, enforce_eager: bool = False,
                 fixed_shape_decode: bool | None = None, parallel=None):
        self.model = model
        self.layout = layout
        self.kv = kv
        self.device = device
        self.backend = backend
        self.buffers = KVBuffers(layout, device)
        self.tables = DeviceTables(layout, kv, max_num_seqs, max_model_len, device, self.buffers.sink_page)
        # A tensor-parallel engine (engine/tensor_parallel.py): steps go to
        # every rank as plans, eagerly (None: this process alone).
        self.parallel = parallel
        self.use_graphs = device.type == "cuda" and not enforce_eager and backend.capturable and parallel is None
        self.fixed_shape_decode = (self.use_graphs if fixed_shape_decode is None else fixed_shape_decode) \
            and parallel is None
        self.buckets = buckets(max_num_seqs)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._graph_pool = None
        size = self.buckets[-1]
        self.decode_ids = torch.zeros(size, dtype=torch.int64, device=device)
        self.decode_positions = torch.zeros(size, dtype=torch.int64, device=device)
        self.decode_table_rows = torch.full((size,), self.tables.pad_row, dtype=torch.int64, device=device)
        self.decode_order = torch.arange(size, device=device)  # token t is sequence t's
        for name, module in model.cache_layers().items():
            view = layout.layer_views.get(name)
            if view is None:
                raise ValueError(f"layer {name} has no place in the KV cache layout")
            module.layer_name = name
            module.group = view.group
            module.column = view.column
        # The backend adapts the model once, on every rank alike
        # (tensor_parallel.py builds its runners here too).
        self.prepare_report = backend.prepare(model, layout, device)
        logging.getLogger("hybridkv.backend").info("%s", self.prepare_report)
        self.routes: Counter = Counter()  # steps per route ("cpu:decoder-layers", "triton:graph", ...)
        self.tiers = None  # the tiers below the pool (kv_tiers.TieredStore), whose copies a step makes first
        self._mamba_metadata: list = []
        self._accepted: dict | None = None  # kept drafts the tensor-parallel workers have not applied yet
        self._verified: tuple[list, list] = ([], [])  # Mamba metadata of the last step's verified sequences (keep_accepted)
        if self.use_graphs:
            self.capture_all()

    def capture_all(self) -> None:
        """Capture every bucket's decode step now, largest first (they share
        one memory pool), so that serving never pauses to capture."""
        with torch.inference_mode():
            for size in reversed(self.buckets):
                self._capture(size)

    def release(self, seq_id: str) -> None:
        """The sequence no longer runs: its table row is free."""
        self.tables.release(seq_id)

    @torch.inference_mode()
    def execute(self, steps: list[Scheduled]) -> torch.Tensor:
        """Run one step; logits [sampled rows, vocab] (float32) for the
        steps that complete their known tokens, in order. First the copies
        the scheduler decided: the tiers' stores and loads (kv_tiers.py:
        stores read pages this step may write, loads write pages it reads),
        then the copy-on-write pages of forks."""
        if self.tiers is not None:
            self.tiers.copy(self.tiers.take_copies())
        copies = [pair for pairs in self.kv.take_copies().values() for pair in pairs]
        rows = [self.tables.row(s.seq.seq_id) for s in steps]
        if self.parallel is not None:  # every rank runs the step from its plan (engine/tensor_parallel.py)
            plan = self._plan(steps, rows)
            plan.copies, plan.table_changes = copies, self.tables.changes()
            plan.accepted, self._accepted = self._accepted, None
            if self.tiers is not None:
                plan.tier_log = self.tiers.take_log()
            self.tables.flush()
            self.parallel.send_plan(plan)
            return self.run_plan(plan)
        self.buffers.copy_pages(copies)
        self.tables.flush()
        if self.fixed_shape_decode and all(s.count == 1 and s.completes for s in steps):
            self.count_route("graph" if self.use_graphs else "fixed-shape")
            return self._decode(steps, rows)
        return self.run_plan(self._plan(steps, rows))

    def count_route(self, route: str) -> None:
        self.routes[f"{self.backend.name}:{route}"] += 1

    # -- the fixed-shape decode step -------------------------------------------
    def bucket(self, n: int) -> int:
        return next(b for b in self.buckets if b >= n)

    def _decode(self, steps: list[Scheduled], rows: list[int]) -> torch.Tensor:
        n = len(steps)
        size = self.bucket(n)
        host = np.zeros((3, size), dtype=np.int64)
        host[0, :n] = [s.seq.token_ids[s.start] for s in steps]
        host[1, :n] = [s.start for s in steps]
        host[2, :n] = rows
        host[2, n:] = self.tables.pad_row
        staged = torch.from_numpy(host).to(self.device)  # one copy for the three
        if self.use_graphs and size not in self.graphs:
            self._capture(size)
        self.decode_ids[:size] = staged[0]
        self.decode_positions[:size] = staged[1]
        self.decode_table_rows[:size] = staged[2]
        if self.use_graphs:
            graph, logits = self.graphs[size]
            graph.replay()
            return logits[:n]
        return self.decode_forward(size)[:n]

    def decode_forward(self, size: int) -> torch.Tensor:
        """Forward and LM head of a decode step of `size` rows read from the
        decode buffers: no host value, no data-dependent shape (this is what
        a CUDA graph captures, and what torch.compile(fullgraph=True) takes)."""
        inputs = StepInputs.fixed(self.decode_ids[:size], self.decode_positions[:size],
                                  self.decode_table_rows[:size], self.decode_order[:size])
        return self._run(self._batch(inputs), all_rows=True)

    def _capture(self, size: int) -> None:
        """Capture the bucket's decode step, run on padding only (the sink
        pages), so that warming up and capturing change no real state."""
        self.decode_table_rows[:size] = self.tables.pad_row
        self.decode_positions[:size] = 0
        self.decode_ids[:size] = 0
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for _ in range(2):  # compile kernels, settle allocations
                self.decode_forward(size)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        if self._graph_pool is None:
            self._graph_pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._graph_pool):
            logits = self.decode_forward(size)
        self.graphs[size] = (graph, logits)

    # -- any step, eagerly -------------------------------------------------------
    def _plan(self, steps: list[Scheduled], rows: list[int]) -> "StepPlan":
        counts = np.fromiter((s.count for s in steps), dtype=np.int64, count=len(steps))
        ids = np.fromiter((t for s in steps for t in (s.seq.token_ids[s.start:s.start + s.count - len(s.drafts)]
                                                      + s.drafts)),
                          dtype=np.int64, count=int(counts.sum()))
        verifying = np.fromiter((bool(s.drafts) for s in steps), dtype=bool, count=len(steps))
        starts = np.zeros(len(steps), dtype=np.int64)
        np.cumsum(counts[:-1], out=starts[1:])
        sampled = []
        for i, s in enumerate(steps):
            if s.drafts:  # every token of a verified step gives a row: what follows it
                sampled.extend(range(int(starts[i]), int(starts[i] + counts[i])))
            elif s.completes:
                sampled.append(int(starts[i] + counts[i] - 1))
        return StepPlan(ids, np.fromiter((s.start for s in steps), dtype=np.int64, count=len(steps)), counts,
                        np.asarray(rows, dtype=np.int64), verifying if verifying.any() else None,
                        np.asarray(sampled, dtype=np.int64), [s.seq.seq_id for s in steps])

    def run_plan(self, plan: "StepPlan") -> torch.Tensor:
        """Run an eager step from its plan: on one rank, or on every rank
        of a tensor-parallel engine (whose LM head gathers the logits on the
        driver: the other ranks get none)."""
        if plan.accepted is not None:  # a worker: the driver kept these drafts after the last step
            self.keep_accepted(plan.accepted)
        if plan.tier_log and self.kv is None:  # a worker: its tiers make the driver's decisions, then copies
            self.tiers.replay(plan.tier_log)
            self.tiers.copy(self.tiers.take_copies())
        if plan.copies:
            self.buffers.copy_pages(plan.copies)
        if plan.table_changes:
            self.tables.apply(plan.table_changes)
        inputs = StepInputs.from_host(plan.ids, plan.first_positions, plan.counts, plan.rows, self.device,
                                      plan.verifying)
        batch = self._batch(inputs)
        batch.route = self.backend.route(batch)  # once per step, here
        self.count_route(batch.route)
        hidden = self._run(batch, all_rows=False)
        if plan.verifying is not None:
            self._verified = ([m for m in self._mamba_metadata if m.verifies], plan.seq_ids)
        self._mamba_metadata = []  # (its gathered states are not kept past the step)
        if not len(plan.sampled):
            return torch.empty(0, device=self.device)
        return self.model.compute_logits(hidden[torch.from_numpy(plan.sampled).to(self.device)])

    def keep_accepted(self, accepted: dict[str, int]) -> None:
        """After a step that verified drafts: for each such sequence the number
        of drafts it kept. Mamba groups then hold, in their write pages, the
        state after the last kept token (the pass left the state after the last
        draft there; the manager's contract, docs/architecture.md)."""
        metas, seq_ids = self._verified
        if self.parallel is not None and self.kv is not None and metas:
            # The workers apply it before the next step (StepPlan.accepted), keyed by the
            # sequences' places in the last plan (their seq_ids: plan_wire.py).
            self._accepted = {i: accepted[seq_id] for i, seq_id in enumerate(seq_ids) if seq_id in accepted}
        for meta in metas:
            self.backend.recurrent.keep_accepted(meta, [accepted[seq_ids[v.sequence]] for v in meta.verifies])
        self._verified = ([], [])

    def _batch(self, inputs: StepInputs) -> StepBatch:
        """Each group's metadata, built by the backend (an attention
        group's from its `attention_step`)."""
        batch = StepBatch(inputs, self.buffers)
        tables = self.tables
        backend = self.backend
        for group in self.layout.groups:
            g = group.index
            if group.recurrent:
                batch.recurrent[g] = backend.recurrent.build(inputs, self.buffers, tables.read[g], tables.write[g],
                                                             tables.zero[g], kind=group.kind)
            else:
                step = attention_step(inputs, tables.attention[g], group.spec, group.block_size)
                batch.attention[g] = backend.attention.build(step)
        return batch

    def _run(self, batch: StepBatch, all_rows: bool) -> torch.Tensor:
        """Run the model, write back the recurrent states; the logits of
        every row, or the hidden states."""
        hidden = self.model(batch)
        self._mamba_metadata = list(batch.recurrent.values())  # keep_accepted reads verified states from it
        for meta in batch.recurrent.values():
            self.backend.recurrent.finish(meta)
        return self.model.compute_logits(hidden) if all_rows else hidden
