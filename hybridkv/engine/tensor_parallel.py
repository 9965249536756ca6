"""Tensor parallelism: one model split over N processes (torch.distributed:
gloo on the CPU, NCCL on CUDA), one scheduler and one KVCacheManager.

How the model is split (Megatron's scheme; docs/engine.md has the picture):

* attention: the query heads into N equal parts, rank r computing heads
  [r H/N, (r+1) H/N); the KV heads likewise when there are at least N of
  them, else each rank holds the one KV head its query heads read (Gemma-3
  270M's single KV head is on every rank). The output projection takes
  the rank's heads' columns; its partial sums are all-reduced.
* MLP: gate and up by rows of the intermediate dimension, down by its
  columns; one all-reduce of the output.
* LM head: by rows of the vocabulary (ceil(V / N) per rank, the last
  rank's padded); each rank computes its slice of the logits and the
  driver gathers them. Embeddings and norms are whole on
  every rank.

So a layer costs two all-reduces of [tokens, hidden], and a step one
broadcast of its plan (engine/runner.py `StepPlan`: token ids, positions,
table rows, the block-table entries that changed, page copies) and one
gather of the sampled rows' logits.

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

Mamba layers (Jamba) split by channels: in_proj's x and gate rows, the
conv, dt_proj, A and D of the rank's channels, so each rank keeps the conv
and SSM states of its channels; x_proj and out_proj take those channels'
columns and their partial sums are all-reduced (x_proj's, dt and B and C,
is small). A mixture of experts splits every expert's MLP by its width and
all-reduces once after summing its experts. Other architectures are
refused with the reason.
"""

from __future__ import annotations

import copy
import datetime
import logging
import os
import socket
import traceback

import torch
import torch.distributed as dist

log = logging.getLogger("hybridkv.tensor_parallel")

TIMEOUT = datetime.timedelta(seconds=int(os.environ.get("HYBRIDKV_TP_TIMEOUT", "600")))


def rank_config(text, world: int):
    """The model config as one rank sees it: its share of the query heads,
    KV heads and MLP width. Raises ValueError, naming the size that does not
    divide, or the layers that cannot be split yet."""
    if world == 1:
        return text
    model_type = getattr(text, "model_type", "")
    if model_type not in ("gemma3_text", "gemma2", "gemma3", "llama", "mistral", "jamba"):
        raise ValueError(f"tensor parallelism splits Gemma-3, Gemma-2, Llama, Mistral and Jamba; "
                         f"{model_type or '?'} has layers it does not split yet")
    heads, kv_heads = text.num_attention_heads, text.num_key_value_heads
    sizes = [("num_attention_heads", heads), ("intermediate_size", text.intermediate_size)]
    if model_type == "jamba":
        sizes.append(("Mamba channels (mamba_expand x hidden_size)", text.mamba_expand * text.hidden_size))
    for what, n in sizes:
        if n % world:
            raise ValueError(f"tensor_parallel_size={world} does not divide {what}={n}")
    if kv_heads >= world and kv_heads % world:
        raise ValueError(f"tensor_parallel_size={world} does not divide num_key_value_heads={kv_heads}")
    if kv_heads < world and world % kv_heads:
        raise ValueError(f"num_key_value_heads={kv_heads} does not divide tensor_parallel_size={world}")
    out = copy.deepcopy(text)
    out.head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads  # before heads change
    out.num_attention_heads = heads // world
    out.num_key_value_heads = max(1, kv_heads // world)
    out.intermediate_size = text.intermediate_size // world
    if model_type == "jamba":
        out.mamba_inner = text.mamba_expand * text.hidden_size // world
    return out


def vocab_part(vocab: int, world: int) -> int:
    """Rows of the LM head per rank (the last rank may hold fewer: its
    logits are padded to this width for the gather)."""
    return -(-vocab // world)


class Shard:
    """Which slice of each checkpoint tensor rank `rank` of `world` holds
    (modeling/loader.py reads just those bytes)."""

    def __init__(self, rank: int, world: int, full_config):
        self.rank, self.world = rank, world
        heads, kv_heads = full_config.num_attention_heads, full_config.num_key_value_heads
        self.head_dim = getattr(full_config, "head_dim", None) or full_config.hidden_size // heads
        self.q_rows = self._range(heads // world * self.head_dim)
        if kv_heads >= world:
            self.kv_rows = self._range(kv_heads // world * self.head_dim)
        else:  # the one KV head this rank's query heads read
            kv = rank * heads // world // (heads // kv_heads)
            self.kv_rows = slice(kv * self.head_dim, (kv + 1) * self.head_dim)
        self.mlp_rows = self._range(full_config.intermediate_size // world)
        part = vocab_part(full_config.vocab_size, world)
        self.vocab_rows = slice(rank * part, min(full_config.vocab_size, (rank + 1) * part))
        self.vocab_size = self.vocab_rows.stop - self.vocab_rows.start
        self.tied = bool(getattr(full_config, "tie_word_embeddings", False))
        inner = getattr(full_config, "mamba_expand", 0) * full_config.hidden_size
        self.channels = self._range(inner // world)  # a Mamba layer's channels here
        # in_proj's rows are x's channels, then the gate's: this rank's of each.
        self.in_proj_rows = [self.channels, slice(inner + self.channels.start, inner + self.channels.stop)]

    def _range(self, size: int) -> slice:
        return slice(self.rank * size, (self.rank + 1) * size)

    def slices(self, name: str, ndim: int):
        """The index of parameter `name`'s slice here, or None: whole. Its
        first entry may be a list of row slices, read one after the other."""
        leaf = name.rsplit(".", 2)
        module, kind = (leaf[-2], leaf[-1]) if len(leaf) >= 2 else ("", leaf[-1])
        if kind in ("A_log", "D"):  # a Mamba layer's per-channel parameters
            return (self.channels,) if ndim == 1 else (self.channels, slice(None))
        rows = {"q_proj": self.q_rows, "k_proj": self.kv_rows, "v_proj": self.kv_rows,
                "gate_proj": self.mlp_rows, "up_proj": self.mlp_rows, "lm_head": self.vocab_rows,
                "in_proj": self.in_proj_rows, "conv1d": self.channels, "dt_proj": self.channels}.get(module)
        if rows is not None and ndim == 3:  # conv1d's weight [channels, 1, width]
            return (rows, slice(None), slice(None))
        if rows is not None:
            return (rows,) if kind == "bias" or ndim == 1 else (rows, slice(None))
        columns = {"o_proj": self.q_rows, "down_proj": self.mlp_rows, "x_proj": self.channels,
                   "out_proj": self.channels}.get(module)
        if columns is not None and kind == "weight":
            return (slice(None), columns)
        return None

    def bias_here(self, name: str) -> bool:
        """A row-parallel output's bias is added once: on rank 0."""
        return not (name.endswith(("o_proj.bias", "down_proj.bias", "out_proj.bias")) and self.rank)

    def finish(self, model) -> None:
        """After loading: a tied LM head is this rank's rows of the embedding
        (a view, no copy); outputs of split products are all-reduced."""
        if self.tied:
            model.lm_head.weight = torch.nn.Parameter(model.model.embed_tokens.weight[self.vocab_rows],
                                                      requires_grad=False)
        for module in model.modules():
            if hasattr(module, "reduce"):
                module.reduce = all_reduce
        for module in model.modules():  # a mixture of experts sums its experts' partial outputs once
            for expert in getattr(module, "experts", ()):
                expert.reduce = None


# What this process's all-reduces moved (benchmarks/tensor_parallel.py reads them).
REDUCED = {"calls": 0, "bytes": 0}


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    dist.all_reduce(x)
    REDUCED["calls"] += 1
    REDUCED["bytes"] += x.numel() * x.element_size()
    return x


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class TensorParallel:
    """The driver's side: starts the workers, sends each step's plan,
    gathers the logits, and counts what crosses between ranks."""

    def __init__(self, world: int, model_dir: str, engine_options: dict, device: torch.device, vocab_size: int):
        import torch.multiprocessing as mp

        self.world = world
        self.vocab_size = vocab_size
        self.vocab_part = vocab_part(vocab_size, world)
        engine_options = dict(engine_options, vocab_part=self.vocab_part)
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
        self.steps = 0
        self.bytes_sent = 0  # plans broadcast, pickled
        self.closed = False

    def check_workers(self) -> None:
        for worker in self.workers:
            if not worker.is_alive():
                raise RuntimeError(f"tensor-parallel worker {worker.name} exited (code {worker.exitcode}); "
                                   f"its error is in its log above")

    def send_plan(self, plan) -> None:
        self.check_workers()
        payload = [plan]
        dist.broadcast_object_list(payload, src=0)
        self.steps += 1
        self.bytes_sent += _pickled_size(plan)

    def gather_logits(self, shard: torch.Tensor) -> torch.Tensor:
        """[rows, this rank's vocabulary rows] here and on every rank ->
        [rows, vocab] here."""
        padded = pad_vocab(shard, self.vocab_part)
        parts = [torch.empty_like(padded) for _ in range(self.world)]
        dist.gather(padded, parts, dst=0)
        return torch.cat(parts, dim=-1)[..., :self.vocab_size]

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        try:
            if all(w.is_alive() for w in self.workers):
                dist.broadcast_object_list([None], src=0)  # the workers' signal to stop
        finally:
            for worker in self.workers:
                worker.join(30)
                if worker.is_alive():
                    worker.terminate()
            if dist.is_initialized():
                dist.destroy_process_group()


def pad_vocab(logits: torch.Tensor, width: int) -> torch.Tensor:
    """Logits [rows, n <= width] padded with -inf to `width` columns (the
    gather takes equal shapes; a step that samples nothing has none)."""
    if logits.dim() < 2:
        return logits.contiguous()
    if logits.shape[-1] == width:
        return logits.contiguous()
    return torch.nn.functional.pad(logits, (0, width - logits.shape[-1]), value=float("-inf"))


def _pickled_size(plan) -> int:
    import pickle

    return len(pickle.dumps(plan, protocol=pickle.HIGHEST_PROTOCOL))


def _worker(rank: int, world: int, init_method: str, backend: str, model_dir: str, options: dict) -> None:
    """A rank other than the driver: load this rank's shard, then run every
    plan the driver broadcasts until it sends None."""
    try:
        torch.set_num_threads(options.pop("threads", torch.get_num_threads()))
        if backend == "nccl":
            torch.cuda.set_device(rank)
        dist.init_process_group(backend, init_method=init_method, world_size=world, rank=rank, timeout=TIMEOUT)
        from ..layers.backend import choose as choose_backend
        from ..layers.linear import configure as configure_linears
        from ..modeling.loader import load_model
        from .runner import ModelRunner

        device = torch.device(options["device"])
        if device.type == "cuda":  # one device per rank
            device = torch.device("cuda", rank)
            torch.cuda.set_device(device)
        model, _ = load_model(model_dir, dtype=options["dtype"], device=device, progress=False,
                              tensor_parallel=(rank, world))
        configure_linears(model, device)
        layout = options["layout"]
        runner = ModelRunner(model, layout, None, device, choose_backend(options["backend"], device),
                             options["max_num_seqs"], options["max_model_len"], parallel=Follower())
        with torch.inference_mode():
            while True:
                payload = [None]
                dist.broadcast_object_list(payload, src=0)
                plan = payload[0]
                if plan is None:
                    break
                dist.gather(pad_vocab(runner.run_plan(plan), options["vocab_part"]), dst=0)
    except Exception:
        traceback.print_exc()
        os._exit(1)
    dist.destroy_process_group()


class Follower:
    """A worker's `parallel`: it receives plans rather than sending them."""
