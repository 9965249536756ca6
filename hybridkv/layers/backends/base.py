"""The contract every backend implements: what a step's cache ops are, what
a backend declares it can run, and how it prepares a loaded model.

A backend is one implementation of a step's cache and layer ops (the torch
reference, C kernels for the CPU, Triton kernels, FlashInfer with
mamba-ssm), one package each under `backends/`. It has two sides:

* `AttentionOps`: `build` the step's metadata for one attention group (once
  per group per step, from the `AttentionStep` every backend shares),
  `store` a layer's new K/V, `attend` its queries (with the layer's
  soft-cap and attention sinks, where it has them);
* recurrent ops, one class per mixer kind (`MambaOps` for Mamba-1,
  `Mamba2Ops` for Mamba-2 / SSD, `GatedDeltaOps`, `ShortConvOps`), each
  building its own kind's metadata (layers/recurrent_state.py) and adding
  its own `step` (one token for each decode) and `prefill` (chunks side
  by side) to what every kind shares (`RecurrentOps`: `build` a group's
  metadata, where each sequence's state is read and written;
  `save_states`, a layer's states at a checkpoint inside a chunk, copied
  aside between the passes of its prefill ops; `finish`, the states to
  their write pages: the copy that makes a checkpoint; `keep_accepted`,
  speculative rollback). The three kinds that open with a causal conv
  add `conv_step` / `conv_prefill` (`CausalConvOps`). A backend binds one
  instance for each kind (`Backend.recurrent[kind]`);

and declares, rather than lets callers probe, what it runs: devices, cache
dtypes, attention kinds, soft-capping, attention sinks, whether its
fixed-shape decode step can be captured as a CUDA graph, the recurrent
kinds it steps its own way (every other kind's layers run the reference's
ops on gathered states, and `prepare` says so) (`Capabilities`).

`Backend.prepare(model)` adapts a loaded model once, by swapping modules
(a norm for its C-backed twin, a decoder layer for a one-call C layer, a
Linear for one over packed weights) and returns a `PrepareReport` of what
it did and what it declined, and why. Model files and the shared layers
call the ops they are bound to and never ask which backend runs them.

`Backend.route(batch)` names how one step runs (e.g. "cpu:decoder-layers"
or "cpu:modules"); the worker asks once per step and counts the answers
(`engine.stats["backend"]["routes"]`).
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from dataclasses import dataclass, field

import torch

from ...core.specs import RECURRENT_KINDS
from ..recurrent_state import (GatedDeltaMetadata, Mamba2Metadata, MambaMetadata, RecurrentMetadata,
                               ShortConvMetadata)

log = logging.getLogger("hybridkv.backend")

ATTENTION_KINDS = frozenset({"full", "sliding_window", "chunked_local"})


@dataclass(frozen=True)
class Capabilities:
    """What a backend runs, declared."""

    devices: frozenset = frozenset({"cpu", "cuda"})
    dtypes: frozenset = frozenset({"float32", "bfloat16", "float16"})  # cache dtypes its attention reads
    attention_kinds: frozenset = ATTENTION_KINDS
    softcap: bool = True  # attention logit soft-capping
    sinks: bool = True  # attention sinks: a learned logit per query head in each softmax's denominator
    capturable: bool = True  # its fixed-shape decode step can be captured as a CUDA graph
    # Its attention loads only the keys a query may see; False: it gathers
    # whole blocks and masks them (the reference), so the slots it masks
    # must hold finite values, which the stores keep so (reference attention.store).
    reads_only_visible_keys: bool = False
    # The recurrent kinds whose states it steps its own way; its layers of
    # any other kind run the reference's ops on gathered states, which
    # prepare reports.
    recurrent_kinds: frozenset = frozenset(RECURRENT_KINDS)
    # Its recurrent ops save the state at a checkpoint inside a prefill
    # chunk (`RecurrentOps.build(saves=...)`, `save_states`), so the
    # scheduler need not end chunks there; False: every chunk ends at the
    # next checkpoint (an engine step more per checkpoint), and prepare says so.
    checkpoints_inside_chunks: bool = True


class AttentionOps(ABC):
    """The attention side of a backend. A layer's cache is the view
    `[pages, 2, block_size, kv_heads, head_dim]` of the pool."""

    name: str = "?"

    @abstractmethod
    def build(self, step):
        """This backend's metadata for one attention group's step (the
        `AttentionStep` of layers/step.py), shared by the group's layers."""

    @abstractmethod
    def store(self, cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta, column: int) -> None:
        """Write the step's new K/V rows `[tokens, kv_heads, head_dim]` at their slots."""

    @abstractmethod
    def attend(self, q: torch.Tensor, cache: torch.Tensor, meta, column: int, scale: float,
               softcap: float | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
        """q `[tokens, q_heads, head_dim]` -> the same shape; each query reads
        the keys its layer's read rule lets it see (spec.first_visible .. its
        position). The step's K/V is stored before.

        Scores are `q.k * scale`, then `softcap * tanh(s / softcap)` where
        `softcap` is given. `sinks` (`[q_heads]`, any float dtype; gpt-oss's
        attention sinks): query head h's softmax has one more logit,
        `sinks[h]`, in its denominator only, a key that is never stored and
        has no value: weights `exp(s_j) / (sum_i exp(s_i) + exp(sinks[h]))`,
        in float32. They cost no cache."""


class RecurrentOps(ABC):
    """What the ops of every recurrent kind share; each kind's class below
    adds its own (one token, chunks). A request's state lives in the pool;
    `build` says where each sequence's is read and written. The prefill
    ops run the step's chunks side by side on the states `build` gathered
    (rows `rows` of `meta.states`), padded to the longest (chunk r's tokens
    first `lengths[r]`, longest first). Every op of a layer moves that
    layer's state on; with `keep` (the step's verified chunks, all of them
    in one call, in `meta.verifies` order) a prefill op also keeps what
    `keep_accepted` needs to go back to any of their tokens.

    A chunk with checkpoints inside (`build`'s `saves`) runs in pieces cut
    at them, one pass of the layer's prefill ops per piece (the first pieces
    of every chunk side by side, then the second ones, ...: `meta.passes`);
    after a pass, `save_states` copies the layer's state of each chunk cut
    there to the checkpoint's rows, which `finish` writes to its pages. A
    piece is the computation a chunk ending there would run, so the saved
    state is the one it would leave.

    A new recurrent kind adds its class here (its metadata in
    layers/recurrent_state.py), one per implementation package (the
    reference's on gathered states in backends/reference/recurrent.py),
    and its name to core/specs.py's RECURRENT_KINDS."""

    kind: str = "?"  # one of core/specs.py's RECURRENT_KINDS
    metadata_type: type = RecurrentMetadata  # what `build` returns
    name: str = "?"  # whose ops these are (an implementation's name)

    @abstractmethod
    def build(self, inputs, buffers, read, write, zero, saves=()) -> RecurrentMetadata:
        """The metadata of one recurrent group of this kind for one step
        (layers/recurrent_state.py). `saves`: (sequence index in the step,
        tokens of its chunk before the checkpoint, pages) of each state to
        save inside a prefill chunk (a backend that declares
        `checkpoints_inside_chunks` False never gets any)."""

    @abstractmethod
    def save_states(self, meta, layer_name: str, saves) -> None:
        """After a pass of the layer's prefill ops (`meta.passes`): its
        state parts of rows `saves[0]` copied to rows `saves[1]`."""

    @abstractmethod
    def finish(self, meta) -> None:
        """After the forward: the updated states to their write pages (the
        copy that leaves a checkpoint where the manager asked for one)."""

    @abstractmethod
    def keep_accepted(self, meta, accepted: list[int]) -> None:
        """After a step that verified drafts: the state after each
        sequence's last kept token goes to its write pages."""


class CausalConvOps(RecurrentOps):
    """A kind whose mixer opens with a depthwise causal conv, SiLU applied
    (state part 0: the K-1 inputs before the next token)."""

    @abstractmethod
    def conv_step(self, meta, layer_name: str, x, weight, bias) -> torch.Tensor:
        """One token's conv for each decode row; the window moves on by one."""

    @abstractmethod
    def conv_prefill(self, meta, layer_name: str, rows, x, lengths, weight, bias, keep: bool = False):
        """Chunks `x [R, L, I]` from the windows of `rows`: the SiLU'd conv outputs."""


class MambaOps(CausalConvOps):
    """Mamba-1 (Jamba): a selective scan per channel (state part 1: [I, N])."""

    kind = "mamba"
    metadata_type = MambaMetadata

    @abstractmethod
    def step(self, meta, layer_name: str, x, dt, A, B, C, D, gate) -> torch.Tensor:
        """One token's selective-state update for each decode row:
        float32 `(C . h + D x) * silu(gate)`; the SSM state moves on."""

    @abstractmethod
    def prefill(self, meta, layer_name: str, rows, x, dt, A, B, C, lengths, keep: bool = False) -> torch.Tensor:
        """The selective scan of chunks from the SSM states of `rows`:
        y [R, L, I] float32 (`C . h`; the layer adds D x and the gate)."""


class Mamba2Ops(CausalConvOps):
    """Mamba-2 / SSD (Nemotron-H, Granite-4.0-H, Bamba, Falcon-H1): a
    scalar decay per head (state part 1: [H, P, N]; layers/ssd_ops.py)."""

    kind = "mamba2"
    metadata_type = Mamba2Metadata

    @abstractmethod
    def step(self, meta, layer_name: str, x, dt, A, B, C, D) -> torch.Tensor:
        """One token for each decode row: x [R, H, P], dt [R, H] (after
        softplus and clamp), A [H], B and C [R, G, N], D [H]; float32
        `h C + D x` [R, H, P]; the state moves on."""

    @abstractmethod
    def prefill(self, meta, layer_name: str, rows, x, dt, A, B, C, D, lengths, keep: bool = False) -> torch.Tensor:
        """The chunked SSD scan of chunks from the states of `rows`: x [R,
        L, H, P], dt [R, L, H], B and C [R, L, G, N]; y [R, L, H, P]
        float32 (`h C + D x`)."""


class GatedDeltaOps(CausalConvOps):
    """Gated DeltaNet (Qwen3-Next, Qwen3.5): the gated delta rule per value
    head (state part 1: [Hv, K, V]; layers/gated_delta_ops.py)."""

    kind = "gated_delta"
    metadata_type = GatedDeltaMetadata

    @abstractmethod
    def step(self, meta, layer_name: str, q, k, v, g, beta) -> torch.Tensor:
        """One token for each decode row: q and k [R, Hk, K] L2-normalised
        (q also times K ** -0.5), v [R, Hv, V], g [R, Hv] (the log decay,
        <= 0) and beta [R, Hv]; float32 o [R, Hv, V]; the state moves on."""

    @abstractmethod
    def prefill(self, meta, layer_name: str, rows, q, k, v, g, beta, lengths, keep: bool = False) -> torch.Tensor:
        """The chunked gated delta rule of chunks from the states of `rows`:
        q, k [R, L, Hk, K], v [R, L, Hv, V], g and beta [R, L, Hv]; o [R, L,
        Hv, V] float32."""


class ShortConvOps(RecurrentOps):
    """The gated short convolution (LFM2): its state is the conv window
    (part 0) alone, and the conv has no activation."""

    kind = "short_conv"
    metadata_type = ShortConvMetadata

    @abstractmethod
    def step(self, meta, layer_name: str, b, c, x, weight, bias) -> torch.Tensor:
        """One token for each decode row: `c * conv(b * x)`, the window
        moving on by `b * x`."""

    @abstractmethod
    def prefill(self, meta, layer_name: str, rows, b, c, x, lengths, weight, bias,
                keep: bool = False) -> torch.Tensor:
        """Chunks `[R, L, D]` from the windows of `rows`: `c * conv(b * x)`."""


# Each recurrent kind's contract: a backend binds one instance of each.
RECURRENT_OPS = {ops.kind: ops for ops in (MambaOps, Mamba2Ops, ShortConvOps, GatedDeltaOps)}


@dataclass
class PrepareReport:
    """What `Backend.prepare` did to a model and what it declined (why)."""

    backend: str
    done: list[str] = field(default_factory=list)
    declined: list[str] = field(default_factory=list)

    def as_dict(self) -> dict:
        return {"name": self.backend, "prepared": list(self.done), "declined": list(self.declined)}

    def __str__(self) -> str:
        lines = [f"backend {self.backend}"]
        lines += [f"  did: {d}" for d in self.done]
        lines += [f"  declined: {d}" for d in self.declined]
        return "\n".join(lines)


def sink_layers(model: torch.nn.Module) -> list[str]:
    """The names of `model`'s cache layers that have attention sinks."""
    return [name for name, layer in model.cache_layers().items() if getattr(layer, "sinks", None) is not None]


class Backend:
    """One implementation of a step's ops: its attention ops and its ops for
    each recurrent kind, what it declares, how it prepares a model and
    names a step's route."""

    name = "?"
    capabilities = Capabilities()

    def __init__(self, attention: AttentionOps, recurrent: dict[str, RecurrentOps]):
        self.attention = attention
        self.recurrent = recurrent  # kind -> the ops its layers call, one for each of RECURRENT_KINDS
        for kind, contract in RECURRENT_OPS.items():
            if not isinstance(recurrent.get(kind), contract):
                raise TypeError(f"backend {self.name!r}: its {kind} ops are not a {contract.__name__}")

    @property
    def capturable(self) -> bool:
        return self.capabilities.capturable

    def refusal(self, spec, device: torch.device, sinks: bool = False) -> str | None:
        """Why this backend cannot run layers of `spec` on `device` (with
        attention sinks where `sinks`), or None."""
        caps = self.capabilities
        if device.type not in caps.devices:
            return f"runs on {', '.join(sorted(caps.devices))}, not {device.type}"
        if spec.kind in ATTENTION_KINDS:
            if spec.kind not in caps.attention_kinds:
                return f"no {spec.kind.replace('_', ' ')} attention"
            if spec.dtype not in caps.dtypes:
                return f"no {spec.dtype} attention cache"
            if sinks and not caps.sinks:
                return "no attention sinks"
        return None

    def check_layout(self, layout, device: torch.device | str = "cpu", model: torch.nn.Module | None = None) -> None:
        """ValueError naming each group this backend cannot run (with
        `model`, also what its layers ask beyond the cache: attention sinks)."""
        device = torch.device(device)
        with_sinks = set() if model is None else set(sink_layers(model))
        refused = [f"group {g.index} ({g.spec.kind}): {why}" for g in layout.groups
                   if (why := self.refusal(g.spec, device, bool(with_sinks & set(g.layer_names)))) is not None]
        if refused:
            raise ValueError(f"backend {self.name!r} cannot run this model: " + "; ".join(refused))

    def prepare(self, model: torch.nn.Module, layout, device: torch.device) -> PrepareReport:
        """Adapt a loaded model once (its cache layers already bound to
        their groups by the worker): bind the ops to its cache layers, swap
        what this backend runs its own way. The base binds only."""
        report = PrepareReport(self.name)
        self.bind_ops(model, layout, report)
        return report

    def bind_ops(self, model, layout, report: PrepareReport) -> None:
        """Every cache layer gets the ops it calls (`ops`): an attention
        layer the attention side, a recurrent layer its kind's ops.
        Recurrent layers of a kind this backend has no kernels for are
        reported: they run the reference's ops on gathered states."""
        counts = {}  # (kind of layer, whose ops) -> layers
        for name, layer in model.cache_layers().items():
            group = layout.groups[layout.layer_views[name].group]
            layer.ops = self.recurrent[group.kind] if group.recurrent else self.attention
            key = group.kind if group.recurrent else "attention", layer.ops.name
            counts[key] = counts.get(key, 0) + 1
        for (kind, ops), n in counts.items():
            report.done.append(f"{n} {kind} layers call {ops}")
        if not self.capabilities.checkpoints_inside_chunks and any(g.recurrent for g in layout.groups):
            report.declined.append("recurrent states at checkpoints inside prefill chunks: every prefill chunk "
                                   "ends at the next checkpoint (an engine step more for each)")
        for kind in sorted({g.kind for g in layout.groups if g.recurrent} - self.capabilities.recurrent_kinds):
            report.declined.append(f"{self.name} kernels for {kind} layers (it has none): their states "
                                   f"are gathered and stepped by the reference's ops")

    def route(self, batch) -> str:
        """How this step runs, named; the worker counts it. Backends that
        run some steps another way (the cpu backend's one-call decoder
        layers) decide it here, once per step, and leave what that way
        reads in `batch.route_state`."""
        return "fixed-shape" if batch.inputs.fixed_shape else "eager"

    def row_max(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(values, indices) of each row's largest logit, the first column
        of a tie, as torch's max over the last dimension gives them (a row
        with a NaN: a NaN value). The sampler's greedy pick; backends that
        read a vocabulary-wide row faster than torch do it their way."""
        return logits.max(dim=-1)

    def __repr__(self) -> str:
        return f"Backend({self.name!r})"
