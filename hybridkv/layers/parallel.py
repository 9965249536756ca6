"""Tensor parallelism inside the layers (Megatron's scheme): a model is
built once per rank, and the layers where the split applies hold only
their rank's part, read only that part from the checkpoint, and add up
the ranks' partial results themselves.

* `ColumnParallelLinear`: rows of the weight (output features), e.g. a
  rank's query heads or its share of the MLP's width. Its output stays
  split; nothing crosses between ranks.
* `RowParallelLinear`: the matching columns (input features), so its
  product is a partial sum, all-reduced in its forward (unless the module
  around it sums several first: a mixture of experts). Its bias is added
  on rank 0 only, so that the sum has it once.
* `VocabParallelHead`: the LM head by rows of the vocabulary, ceil(V / N)
  per rank; its forward gathers the logits on rank 0, the only rank that
  samples.

Each knows its `Ranks` (rank, world size), given when the model is built
(`building`): the loader builds a rank's model inside `building(ranks)`,
and every layer built there takes it (so the family files need no extra
argument threaded through). A module whose parameters are split says which
part of each checkpoint tensor it holds (`checkpoint_part`); the loader
reads only those bytes. With a world of one every layer here is the plain
layer: the full weight, no collective.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .linear import Linear

# What this process's all-reduces moved (benchmarks/tensor_parallel.py reads them).
REDUCED = {"calls": 0, "bytes": 0}
# The process's all-reduce through shared memory, where its ranks share a
# host (engine/host_reduce.py, installed by the tensor-parallel executor):
# `reduce(x)` sums x in place and says True, or says False and gloo does.
_host_reduce = [None]


def use_host_reduce(reduce) -> None:
    """All-reduces of this process through `reduce` (None: torch.distributed's)."""
    _host_reduce[0] = reduce


@dataclass(frozen=True)
class Ranks:
    """One process's place among the tensor-parallel ranks (their
    collectives go through torch.distributed's default process group,
    which engine/tensor_parallel.py starts)."""

    rank: int = 0
    world: int = 1

    def share(self, size: int) -> slice:
        """This rank's equal part of `size` (rows, heads, channels); the
        sizes that do not divide are refused before building
        (modeling/tensor_split.py)."""
        part = size // self.world
        return slice(self.rank * part, (self.rank + 1) * part)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """x summed over the ranks, in place."""
        if self.world == 1:
            return x
        reduce = _host_reduce[0]
        if reduce is None or not reduce(x):
            dist.all_reduce(x)
        REDUCED["calls"] += 1
        REDUCED["bytes"] += x.numel() * x.element_size()
        return x

    def agree(self, yes: bool) -> bool:
        """True where every rank says yes: for a choice that must be the
        same on every rank but rests on something one rank sees (its free
        memory)."""
        return yes if self.world == 1 else every_rank(yes)


def every_rank(yes: bool) -> bool:
    """Whether `yes` holds on every rank of the default process group (each
    rank calls it at the same point): one all-reduce of a flag, its minimum.
    On NCCL the flag goes through the rank's current CUDA device."""
    flag = torch.tensor([int(yes)], device="cuda" if dist.get_backend() == "nccl" else "cpu")
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


ONE_PROCESS = Ranks()
_building: list[Ranks] = [ONE_PROCESS]


@contextlib.contextmanager
def building(ranks: Ranks):
    """Layers constructed inside belong to `ranks`."""
    _building.append(ranks)
    try:
        yield ranks
    finally:
        _building.pop()


def current_ranks() -> Ranks:
    """The ranks of the model being built (one process alone: ONE_PROCESS)."""
    return _building[-1]


def leading_part(rows, ndim: int) -> tuple:
    """The checkpoint index of `rows` (a slice, or a list of slices read one
    after the other) of a tensor with `ndim` dimensions."""
    return (rows,) + (slice(None),) * (ndim - 1)


class ColumnParallelLinear(Linear):
    """out_features of the whole layer, of which this rank holds `rows`
    (default: its equal share; a list of slices: several ranges, side by
    side, as Mamba's in_proj holds its channels of x and of the gate)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, rows=None):
        ranks = current_ranks()
        rows = ranks.share(out_features) if rows is None else rows
        local = sum(len(range(*r.indices(out_features))) for r in (rows if isinstance(rows, list) else [rows]))
        super().__init__(in_features, local, bias=bias)
        self.ranks, self.rows = ranks, rows

    def checkpoint_part(self, name: str, ndim: int):
        """The part of checkpoint tensor `name` (weight, bias) held here;
        None: all of it."""
        return None if self.ranks.world == 1 else leading_part(self.rows, ndim)


class RowParallelLinear(Linear):
    """in_features of the whole layer, of which this rank holds its equal
    share of columns; its forward all-reduces the partial products unless
    `reduce` is False (then the caller sums, once, what several such
    products gave)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, reduce: bool = True):
        ranks = current_ranks()
        # The bias once in the sum: on rank 0 (elsewhere the checkpoint's is not read).
        super().__init__(in_features // ranks.world, out_features, bias=bias and ranks.rank == 0)
        self.ranks, self.columns, self.reduce = ranks, ranks.share(in_features), reduce

    def checkpoint_part(self, name: str, ndim: int):
        if self.ranks.world == 1 or name != "weight":
            return None
        return (slice(None), self.columns)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.product(x)
        return self.ranks.all_reduce(out) if self.reduce else out


class VocabParallelHead(Linear):
    """The LM head: [hidden] -> [vocab] logits, its rows split over the
    ranks (ceil(V / N) each, the last rank's fewer). Its forward returns
    the whole logits on rank 0 and none ([rows, 0]) on the others: only
    rank 0 samples."""

    def __init__(self, hidden: int, vocab: int):
        ranks = current_ranks()
        part = -(-vocab // ranks.world)
        rows = slice(ranks.rank * part, min(vocab, (ranks.rank + 1) * part))
        super().__init__(hidden, rows.stop - rows.start, bias=False)
        self.ranks, self.vocab, self.part, self.rows = ranks, vocab, part, rows

    def checkpoint_part(self, name: str, ndim: int):
        return None if self.ranks.world == 1 else leading_part(self.rows, ndim)

    def tie(self, embedding: torch.nn.Embedding) -> None:
        """Share the embedding's weight (this rank's rows of it: a view)."""
        if self.ranks.world == 1:
            self.weight = embedding.weight
        else:
            self.weight = torch.nn.Parameter(embedding.weight[self.rows], requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.product(x)
        if self.ranks.world == 1:
            return logits
        # gather takes equal shapes: the last rank's fewer rows padded with -inf
        padded = torch.nn.functional.pad(logits, (0, self.part - logits.shape[-1]), value=float("-inf"))
        if self.ranks.rank != 0:
            dist.gather(padded.contiguous(), dst=0)
            return logits[..., :0]
        parts = [torch.empty_like(padded) for _ in range(self.ranks.world)]
        dist.gather(padded.contiguous(), parts, dst=0)
        return torch.cat(parts, dim=-1)[..., :self.vocab]
