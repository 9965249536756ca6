"""Load a local Hugging Face folder: config (transformers' config classes),
weights (`*.safetensors`, sharded index included) into hybridkv's own model
code, and the tokenizer when the folder has one. A GGUF file is first
converted into such a folder (gguf.py)."""

from __future__ import annotations

import contextlib
import json
import os

import torch

from ..core.hf_config import ENGINE_ARCHITECTURES
from ..layers.dtypes import choose_dtype
from ..layers.parallel import Ranks, building
from .base import CausalLM
from .tensor_split import rank_config


def _model_classes():
    """model_type -> (model class, checkpoint name prefixes to rename), for
    the model types whose architectures the engine runs (hf_config's
    MODEL_TYPES, which names the architectures)."""
    from .bamba import BambaForCausalLM
    from .falcon_h1 import FalconH1ForCausalLM
    from .gemma3 import Gemma2ForCausalLM, GemmaForCausalLM
    from .granite_hybrid import GraniteMoeHybridForCausalLM
    from .gpt_oss import GptOssForCausalLM
    from .jamba import JambaForCausalLM
    from .lfm2 import Lfm2ForCausalLM
    from .llama import LlamaForCausalLM
    from .nemotron_h import NemotronHForCausalLM
    from .qwen3_next import Qwen3_5ForCausalLM, Qwen3NextForCausalLM

    return {
        "gemma3_text": (GemmaForCausalLM, {}),
        "gemma3": (GemmaForCausalLM, {
            # transformers 5 and older layouts of the multimodal checkpoint
            "model.language_model.": "model.", "language_model.model.": "model.",
            "language_model.lm_head.": "lm_head."}),
        "gemma2": (Gemma2ForCausalLM, {}),
        "jamba": (JambaForCausalLM, {}),
        "llama": (LlamaForCausalLM, {}),
        "mistral": (LlamaForCausalLM, {}),
        "ministral": (LlamaForCausalLM, {}),
        "nemotron_h": (NemotronHForCausalLM, {"backbone.": "model."}),
        "granitemoehybrid": (GraniteMoeHybridForCausalLM, {}),
        "bamba": (BambaForCausalLM, {}),
        "falcon_h1": (FalconH1ForCausalLM, {}),
        "lfm2": (Lfm2ForCausalLM, {}),
        "gpt_oss": (GptOssForCausalLM, {}),
        "qwen3_next": (Qwen3NextForCausalLM, {}),
        "qwen3_5_text": (Qwen3_5ForCausalLM, {}),
        "qwen3_5_moe_text": (Qwen3_5ForCausalLM, {}),
        # the multimodal checkpoints' language model (vision tower and MTP weights are skipped)
        "qwen3_5": (Qwen3_5ForCausalLM, {"model.language_model.": "model."}),
        "qwen3_5_moe": (Qwen3_5ForCausalLM, {"model.language_model.": "model."}),
    }


def resolve_model_dir(path: str, progress: bool = True) -> str:
    """The Hugging Face folder to load for `path`: itself, or for a GGUF
    file (or a folder holding one) its converted folder (modeling/gguf.py)."""
    from .gguf import find_gguf, gguf_model_dir

    if not isinstance(path, (str, os.PathLike)):
        raise ValueError(f"a model is a folder or a .gguf file path, got {type(path).__name__}")
    path = os.fspath(path)
    gguf = find_gguf(path)
    return path if gguf is None else gguf_model_dir(gguf, progress=progress)


def read_config(model_dir: str):
    """(full config, text config) through transformers' config classes."""
    if not os.path.isdir(model_dir):
        raise ValueError(f"model folder {model_dir!r} does not exist")
    if not os.path.isfile(os.path.join(model_dir, "config.json")):
        raise ValueError(f"{model_dir!r} has no config.json")
    from transformers import AutoConfig

    with open(os.path.join(model_dir, "config.json")) as f:
        raw = json.load(f)
    architecture = (raw.get("architectures") or [None])[0]
    if architecture not in ENGINE_ARCHITECTURES:
        raise ValueError(f"unsupported architecture {architecture!r} in {model_dir}; "
                         f"supported: {', '.join(ENGINE_ARCHITECTURES)}")
    config = AutoConfig.from_pretrained(model_dir)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    if text is not config and hasattr(config, "tie_word_embeddings"):
        # A multimodal model's own flag ties its language model's head (transformers reads it there).
        text.tie_word_embeddings = config.tie_word_embeddings
    return config, text, architecture


def checkpoint_dtype(text_config):
    """The dtype the checkpoint's config names (a torch dtype, a name or None)."""
    return getattr(text_config, "dtype", None) or getattr(text_config, "torch_dtype", None)


def checkpoint_files(model_dir: str) -> list[str]:
    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            shards = sorted(set(json.load(f)["weight_map"].values()))
        return [os.path.join(model_dir, s) for s in shards]
    files = sorted(f for f in os.listdir(model_dir) if f.endswith(".safetensors"))
    if not files:
        raise ValueError(f"{model_dir!r} has no *.safetensors weights")
    return [os.path.join(model_dir, f) for f in files]


SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                      "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
                      "U8": torch.uint8, "BOOL": torch.bool}


def read_safetensors(path: str, wanted=lambda name: True, index=None):
    """(name, CPU tensor) for the tensors of a .safetensors file whose name
    is `wanted`, each read straight into its own memory. `index(name,
    ndim)`: a slice of the tensor to read instead of all of it (or None),
    read as the rows of it only (a tensor-parallel rank's part).

    Why not `safetensors.safe_open`: it maps the file, and every page a
    weight is read from stays in the process's resident memory for as long
    as any tensor of the file lives (a tied embedding keeps it all), beside
    the model's own copy: twice the model at load. Plain reads leave one copy.
    The format is an 8-byte header length, a JSON header of name -> dtype,
    shape, data offsets, then the bytes (little-endian)."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        header, base = _read_header(f, path, size)
        for name, info in header.items():
            if name == "__metadata__" or not wanted(name):
                continue
            dtype = SAFETENSORS_DTYPES.get(info.get("dtype"))
            begin, end = info.get("data_offsets", (0, -1))
            tensor = torch.empty(info.get("shape", ()), dtype=dtype or torch.uint8)
            nbytes = tensor.numel() * tensor.element_size()
            if dtype is None or end - begin != nbytes or base + end > size:
                raise ValueError(f"{path}: tensor {name!r} has a bad entry ({info}) or the file is truncated")
            part = index(name, tensor.dim()) if index is not None else None
            if part is not None:
                yield name, _read_part(f, base + begin, tensor, part)
                continue
            f.seek(base + begin)
            if nbytes and f.readinto(memoryview(tensor.reshape(-1).view(torch.uint8).numpy())) != nbytes:
                raise ValueError(f"{path}: tensor {name!r} is cut short")
            yield name, tensor


def _read_header(f, path: str, size: int) -> tuple[dict, int]:
    """A safetensors file's header (name -> entry) and where its data begins."""
    import struct

    try:
        (length,) = struct.unpack("<Q", f.read(8))
        if not 0 < length <= size - 8:
            raise ValueError(f"header length {length}")
        header = json.loads(f.read(length))
    except (struct.error, ValueError, UnicodeDecodeError) as e:
        raise ValueError(f"{path} is not a readable safetensors file ({e})") from None
    return header, 8 + length


def tensor_names(paths: list[str]) -> list[str]:
    """The names of the tensors the .safetensors files hold (their headers only)."""
    names = []
    for path in paths:
        with open(path, "rb") as f:
            names += [n for n in _read_header(f, path, os.path.getsize(path))[0] if n != "__metadata__"]
    return names


def _read_part(f, offset: int, like: torch.Tensor, part: tuple) -> torch.Tensor:
    """`like[part]` of the tensor stored at `offset` (shape and dtype of
    `like`), reading only its bytes. `part` holds one slice per leading
    dimension, or a list of slices (several ranges, one after the other);
    a run of whole trailing dimensions is one read per range: a slice of
    rows is one read, a slice of a matrix's columns one read per row, a
    slice of stacked experts' columns one read per expert row."""
    first, rest = part[0], part[1:]
    if isinstance(first, list):
        return torch.cat([_read_part(f, offset, like, (rows, *rest)) for rows in first])
    size = like.element_size()
    r0, r1, _ = first.indices(like.shape[0])
    row_bytes = like[0].numel() * size if like.dim() > 1 else size
    if all(p == slice(None) for p in rest):
        out = torch.empty((r1 - r0, *like.shape[1:]), dtype=like.dtype)
        f.seek(offset + r0 * row_bytes)
        if f.readinto(memoryview(out.reshape(-1).view(torch.uint8).numpy())) != out.numel() * size:
            raise ValueError("a tensor is cut short")
        return out
    return torch.stack([_read_part(f, offset + r * row_bytes, like[0], rest) for r in range(r0, r1)])


# torch.nn.init's in-place initialisers, which modules' reset_parameters call
INITIALISERS = ("uniform_", "normal_", "trunc_normal_", "constant_", "ones_", "zeros_", "eye_", "dirac_",
                "xavier_uniform_", "xavier_normal_", "kaiming_uniform_", "kaiming_normal_", "orthogonal_", "sparse_")


@contextlib.contextmanager
def initialisers_skipped():
    """Modules built inside skip their random initialisation. On the meta
    device it computes nothing, but its first op there imports
    torch._dynamo (~1 s of every process that builds a model, torch 2.13),
    and every parameter is loaded from the checkpoint after."""
    from torch.nn import init

    saved = {name: getattr(init, name) for name in INITIALISERS}
    for name in INITIALISERS:
        setattr(init, name, lambda tensor, *args, **kwargs: tensor)
    try:
        yield
    finally:
        for name, function in saved.items():
            setattr(init, name, function)


def load_model(model_dir: str, dtype="auto", device="cpu", progress: bool = True,
               tensor_parallel: tuple[int, int] | None = None):
    """(model, text config) with every parameter loaded from the checkpoint.

    The model is built on the meta device and each checkpoint tensor, read
    into its own memory, becomes its parameter: already in the right dtype
    on the CPU it is not copied again (peak memory: one model); other dtypes
    or devices get one converted copy, one tensor at a time.

    `dtype`: a torch dtype, a name, "auto" or None (layers/dtypes.py
    `choose_dtype`: on the CPU, bfloat16 where it is native).

    `tensor_parallel=(rank, world)`: this rank's part of the model
    (engine/tensor_parallel.py). The model is built from the whole config
    with the rank's place among the ranks (layers/parallel.py): the layers where the split
    applies hold their part, and each checkpoint tensor is read only as the
    module holding it asks (`checkpoint_part`). The config returned is the
    rank's view of it (modeling/tensor_split.py), which the cache reads."""
    from tqdm.auto import tqdm

    config, text, architecture = read_config(model_dir)
    model_class, renames = _model_classes()[ENGINE_ARCHITECTURES[architecture]]
    device = torch.device(device)
    torch_dtype, _ = choose_dtype(dtype, device, checkpoint_dtype(text))
    ranks = Ranks(*tensor_parallel) if tensor_parallel is not None else Ranks()
    rank_text = rank_config(text, ranks.world)  # refuses what cannot be split, before building
    with torch.device("meta"), building(ranks), initialisers_skipped():
        model: CausalLM = model_class(text)
    params = dict(model.named_parameters(remove_duplicate=False))
    loaded: set[str] = set()

    def renamed(name: str) -> str:
        for old, new in renames.items():
            if name.startswith(old):
                return new + name[len(old):]
        return name

    def parameter(name: str) -> str | None:
        """The model parameter a checkpoint tensor fills (None: not ours)."""
        name = model.weight_name(renamed(name))
        return name if name in params else None  # vision tower, rotary buffers, another rank's bias ...

    def part(name: str, ndim: int):
        """The part of checkpoint tensor `name` this rank holds (None: all
        of it), as the nearest module on its path that splits says."""
        path = parameter(name).split(".")
        for depth in range(len(path) - 1, 0, -1):
            ask = getattr(model.get_submodule(".".join(path[:depth])), "checkpoint_part", None)
            if ask is not None:
                return ask(".".join(path[depth:]), ndim)
        return None

    files = checkpoint_files(model_dir)
    if ranks.rank == 0:  # (its model has every parameter of the ranks': a row-parallel bias only there)
        # Weights of another architecture under this config.json load without the tensors it has
        # no parameter for and generate nonsense: refused, naming them. Those the families' released
        # checkpoints carry beside the language model are read past (CausalLM.unused_weights).
        unused = [n for n in tensor_names(files)
                  if parameter(n) is None and not renamed(n).startswith(model.unused_weights)
                  and not n.endswith(".rotary_emb.inv_freq")]  # rotary buffers, in older checkpoints
        if unused:
            raise ValueError(f"{model_dir}: the checkpoint holds {len(unused)} tensors that {architecture} (the "
                             f"architecture in its config.json) has no parameter for, e.g. {unused[:4]}: the "
                             f"weights of another architecture?")
    for path in tqdm(files, desc="loading weights", unit="shard", disable=not progress or len(files) < 2):
        for name, tensor in read_safetensors(path, lambda n: parameter(n) is not None,
                                             part if ranks.world > 1 else None):
            target = parameter(name)
            if tuple(tensor.shape) != tuple(params[target].shape):
                raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)} != model "
                                 f"{tuple(params[target].shape)}")
            owner, _, leaf = target.rpartition(".")
            value = tensor.to(device=device, dtype=torch_dtype)
            model.get_submodule(owner)._parameters[leaf] = torch.nn.Parameter(value, requires_grad=False)
            loaded.add(target)
    model.tie_weights()  # a tied LM head: the loaded embedding's weight (this rank's rows of it)
    if "lm_head.weight" not in loaded and getattr(text, "tie_word_embeddings", False):
        loaded.add("lm_head.weight")
    missing = sorted(set(params) - loaded)
    if missing:
        raise ValueError(f"{model_dir}: checkpoint lacks {len(missing)} weights, e.g. {missing[:3]}")
    model.fuse_projections()
    model.eval()
    return model, rank_text


def load_tokenizer(model_dir: str):
    """The folder's tokenizer, or None (prompts must then be token ids)."""
    names = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")
    if not any(os.path.isfile(os.path.join(model_dir, n)) for n in names):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)
