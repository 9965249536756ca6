"""The worker: one rank's model, backend, paged pool, device tables and
tier copies; it runs a step from its plan (step_plan.StepPlan) and
returns the logits to sample from, and the prompt logprobs the plan asks
for (`PromptLogprobs`: each asked row's logits reduced at once to a few
numbers, never kept whole). One process runs one worker in process
(executor.py); a tensor-parallel engine runs one per rank, the same class
(tensor_parallel.py).

Who builds what (docs/engine.md has the diagram):
* the device tables (tables.py) hold every running sequence's block table,
  updated from the plan's table changes;
* the worker writes the step's facts (`StepInputs`: tokens, positions, each
  sequence's table row, the split into decodes and chunks) into device
  tensors, once; for each attention group it adds what every backend reads
  (`attention_step`: where the new K/V goes, each query's first key);
* the backend chosen at start (layers/backends/) turns them into its own
  metadata, once per KV cache group, and its ops are what the layers call;
  it prepared the model once (`prepare_report` says how) and names each
  eager step's route, which the worker counts (`routes`).

Before the forward pass, in this order: the drafts the last step kept
(`keep_accepted`), the tiers' copies (tier_copies.py: stores read pages
this step may write, loads write pages it reads; their report goes back
with the logits), the copy-on-write pages of forks, the table changes.

Two kinds of step. A decode step (one new token per sequence) at fixed
shapes: padded to a bucket of sequences (1, 2, 4, ... up to max_num_seqs),
its inputs in preallocated buffers, padded rows pointing at the padding
table row (sink pages) and never sampled; on CUDA in one process each
bucket's forward and LM head is captured once as a CUDA graph and
replayed. Any other step (prefill chunks, mixed) runs eagerly with
host-side metadata that reads only the blocks each query needs. On the CPU
decode steps run eagerly too (no graph to gain, and the exact reads are
cheaper than a bound), unless `fixed_shape_decode` asks for the fixed path
(the tests do).
"""

from __future__ import annotations

import contextlib
import gc
import logging
from collections import Counter
from typing import NamedTuple

import numpy as np
import torch

from ..core.layout import KVCacheLayout
from ..core.tiers import TierPlan, TierReport
from ..layers.backends import Backend
from ..layers.kv_buffers import KVBuffers
from ..layers.step import StepBatch, StepInputs, attention_step
from ..modeling.base import CausalLM
from .key_centres import bind_key_centres
from .step_plan import StepPlan
from .tables import DeviceTables
from .tier_copies import copy_tiers


# Prompt logprobs reduce the logits of this many bytes of rows at a time
# (float32 [rows, vocab]): 32 rows of a 262,144-word vocabulary.
LOGPROB_SLICE_BYTES = 32 << 20


class PromptLogprobs(NamedTuple):
    """The plan's prompt-logprob rows, reduced (float32, on the host):
    log-softmax of each row's logits at its next prompt token, and its
    `plan.logprob_top` largest values with their token ids."""
    token: torch.Tensor  # [P]
    top: torch.Tensor  # [P, B]
    top_ids: torch.Tensor  # [P, B]


def buckets(max_num_seqs: int) -> list[int]:
    """Decode batch sizes that get their own shapes: powers of two, and
    max_num_seqs itself."""
    out, b = [], 1
    while b < max_num_seqs:
        out.append(b)
        b *= 2
    return out + [max_num_seqs]


@contextlib.contextmanager
def collector_paused():
    """Python's collector run now and not inside: around CUDA graph
    captures. A graph only the collector can free (an earlier engine's,
    held in a reference cycle) resets itself when freed, which CUDA forbids
    while a stream captures: the capture then fails with "operation not
    permitted when stream is capturing". torch.cuda.graph no longer
    collects on entry (torch.compiler.config.force_cudagraph_gc)."""
    gc.collect()
    collecting = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if collecting:
            gc.enable()


class Worker:
    def __init__(self, model: CausalLM, layout: KVCacheLayout, device: torch.device, backend: Backend,
                 max_num_seqs: int, max_model_len: int, enforce_eager: bool = False,
                 fixed_shape_decode: bool | None = None, world: int = 1, key_centre_tokens: int = 0):
        self.model = model
        self.layout = layout
        self.device = device
        self.backend = backend
        self.buffers = KVBuffers(layout, device)
        self.tables = DeviceTables(layout, max_num_seqs, max_model_len, device, self.buffers.sink_page)
        # CUDA graphs in one process only: a captured step of several ranks
        # would hold their collectives too, which nothing here checks yet.
        self.use_graphs = device.type == "cuda" and not enforce_eager and backend.capturable and world == 1
        self.world = world
        self.fixed_shape_decode = self.use_graphs if fixed_shape_decode is None else fixed_shape_decode
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
            module.columns = tuple(column for column, _, _ in view.places)
            module.piece_heads = tuple(heads for _, _, heads in view.places)  # 0: every KV head
        # Keys over int8 pages stored less their layer's centre (engine/key_centres.py),
        # bound before the backend adapts the layers (the C decoder layer reads them too).
        self.key_centres = bind_key_centres(model, layout, device) if key_centre_tokens else []
        # The backend adapts the model once, on every rank alike.
        self.prepare_report = backend.prepare(model, layout, device)
        logging.getLogger("hybridkv.backend").info("%s", self.prepare_report)
        self.routes: Counter = Counter()  # steps per route ("cpu:decoder-layers", "triton:graph", ...)
        # This rank's storage below the pool (tiers.TierStore), whose copies
        # the plans carry; None: no tiers.
        self.tiers = None
        self._recurrent_metadata: list = []
        self._verified: list = []  # (kind, recurrent metadata) of the last step's verified groups (keep_accepted)
        if self.use_graphs:
            self.capture_all()
        for centre in self.key_centres:  # over the engine's calibration prompt, its first steps
            centre.measure(key_centre_tokens)

    def capture_all(self) -> None:
        """Capture every bucket's decode step now, largest first (they share
        one memory pool), so that serving never pauses to capture."""
        with torch.inference_mode(), collector_paused():
            for size in reversed(self.buckets):
                self._capture(size)

    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> tuple[torch.Tensor, PromptLogprobs | None, TierReport | None]:
        """Run one step: logits [sampled rows, vocab] (modeling/base.py), in order, the
        prompt logprobs of the plan's `logprob_rows` (None when it has
        none), and the report of its tier copies (None when it has none).
        Under tensor parallelism the driver's rank gets the logits, the
        others an empty tensor and None; every rank the same failed loads."""
        if plan.accepted:
            self.keep_accepted(plan.accepted)
        report = self.copy_tiers(plan.tiers)
        if plan.copies:
            self.buffers.copy_pages(plan.copies)
        self.tables.apply(plan.table_changes)
        if plan.decode and self.fixed_shape_decode:
            self.count_route("graph" if self.use_graphs else "fixed-shape")
            return self._decode(plan), None, report
        return (*self._eager(plan), report)

    def copy_tiers(self, plan: TierPlan | None) -> TierReport | None:
        """A plan's tier copies, on this rank's pool and storage."""
        if plan is None or self.tiers is None:
            return None
        return copy_tiers(self.tiers, self.buffers.pool, plan, self.world)

    def count_route(self, route: str) -> None:
        self.routes[f"{self.backend.name}:{route}"] += 1

    # -- the fixed-shape decode step -------------------------------------------
    def bucket(self, n: int) -> int:
        return next(b for b in self.buckets if b >= n)

    def _decode(self, plan: StepPlan) -> torch.Tensor:
        n = len(plan.ids)
        size = self.bucket(n)
        host = np.empty((3, size), dtype=np.int64)
        host[0, :n], host[1, :n], host[2, :n] = plan.ids, plan.first_positions, plan.rows
        host[:2, n:] = 0
        host[2, n:] = self.tables.pad_row
        staged = torch.from_numpy(host).to(self.device)  # one copy for the three
        if self.use_graphs and size not in self.graphs:
            with collector_paused():
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
    def _eager(self, plan: StepPlan) -> tuple[torch.Tensor, PromptLogprobs | None]:
        inputs = StepInputs.from_host(plan.ids, plan.first_positions, plan.counts, plan.rows, self.device,
                                      plan.verifying)
        batch = self._batch(inputs, plan.checkpoint_saves)
        batch.route = self.backend.route(batch)  # once per step, here
        self.count_route(batch.route)
        hidden = self._run(batch, all_rows=False)
        self._verified = [(kind, m) for kind, m in self._recurrent_metadata if m.verifies] \
            if plan.verifying is not None else []
        self._recurrent_metadata = []  # (its gathered states are not kept past the step)
        scored = self._prompt_logprobs(hidden, plan) if len(plan.logprob_rows) else None
        if not len(plan.sampled):
            return torch.empty(0, device=self.device), scored
        return self.model.compute_logits(hidden[torch.from_numpy(plan.sampled).to(self.device)]), scored

    def _prompt_logprobs(self, hidden: torch.Tensor, plan: StepPlan) -> PromptLogprobs | None:
        """The logits of the plan's prompt-logprob rows, a slice of rows at a
        time, each slice reduced at once to what is kept: log-softmax at the
        next prompt token and at the top tokens (logits - logsumexp). On
        every rank alike (the LM head gathers the logits on the driver)."""
        rows = torch.from_numpy(plan.logprob_rows).to(self.device)
        tokens = torch.from_numpy(plan.logprob_tokens).to(self.device)
        top = plan.logprob_top
        step = max(1, LOGPROB_SLICE_BYTES // (4 * self.model.config.vocab_size))
        parts = []
        for start in range(0, len(rows), step):
            logits = self.model.compute_logits(hidden[rows[start:start + step]]).float()
            if not logits.numel():  # another rank's: the driver reduces
                continue
            norm = torch.logsumexp(logits, dim=-1, keepdim=True)
            token = logits.gather(1, tokens[start:start + step, None]) - norm
            best, ids = logits.topk(top, dim=-1) if top else (logits[:, :0], logits[:, :0].long())
            parts.append((token[:, 0], best - norm, ids))
        if not parts:
            return None
        return PromptLogprobs(*(torch.cat(column).cpu() for column in zip(*parts)))

    def keep_accepted(self, accepted: dict[int, int]) -> None:
        """After a step that verified drafts: for each such sequence (its
        index in that step's plan) the number of drafts it kept. Recurrent
        groups then hold, in their write pages, the state after the last
        kept token (the pass left the state after the last draft there; the
        manager's contract, docs/architecture.md)."""
        for kind, meta in self._verified:
            self.backend.recurrent[kind].keep_accepted(meta, [accepted[v.sequence] for v in meta.verifies])
        self._verified = []

    def _batch(self, inputs: StepInputs, checkpoint_saves: list = ()) -> StepBatch:
        """Each group's metadata, built by the backend (an attention
        group's from its `attention_step`; a recurrent group's with the
        states it saves inside prefill chunks)."""
        batch = StepBatch(inputs, self.buffers)
        tables = self.tables
        backend = self.backend
        for group in self.layout.groups:
            g = group.index
            if group.recurrent:
                saves = [(i, offset, pages) for i, offset, h, pages in checkpoint_saves if h == g]
                batch.recurrent[g] = backend.recurrent[group.kind].build(inputs, self.buffers, tables.read[g],
                                                                         tables.write[g], tables.zero[g], saves=saves)
            else:
                step = attention_step(inputs, tables.attention[g], group.spec, group.block_size)
                batch.attention[g] = backend.attention.build(step)
        return batch

    def _run(self, batch: StepBatch, all_rows: bool) -> torch.Tensor:
        """Run the model, write back the recurrent states; the logits of
        every row, or the hidden states."""
        hidden = self.model(batch)
        # (kind, metadata) of each recurrent group: keep_accepted reads verified states from it
        self._recurrent_metadata = [(self.layout.groups[g].kind, meta) for g, meta in batch.recurrent.items()]
        for kind, meta in self._recurrent_metadata:
            self.backend.recurrent[kind].finish(meta)
        return self.model.compute_logits(hidden) if all_rows else hidden
