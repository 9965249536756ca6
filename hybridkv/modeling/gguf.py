"""GGUF checkpoints (llama.cpp's single-file format): converted once into a
Hugging Face folder, then loaded like any other.

    Engine("gemma-3-270m-q4_k_m.gguf")   # or a folder holding one .gguf file

Nothing here parses GGUF or knows an architecture's quirks: transformers
does both (its GGUF config and tokenizer readers, and `load_gguf_checkpoint`,
which dequantizes every tensor and applies the per-architecture fix-ups such
as Gemma's norm offset and llama's q/k permutation), on the `gguf` package.
What this module adds is the cache: the first load writes config, tokenizer
and float32 safetensors into `<cache>/gguf/<name>-<sha256 prefix>/`, keyed by
the file's content, built in a temporary folder and renamed into place only
when complete; later loads read that folder (~0.2 s to hash the 250 MB file,
then an ordinary safetensors load) instead of dequantizing again.

Why float32 on disk: dequantized GGUF weights are float32 products of half
scales and small integers; bfloat16 or float16 would round them, and the
oracle (transformers' own GGUF path) computes in float32. The engine casts
to its dtype at load.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import tempfile
import time

from ..core.hf_config import MODEL_TYPES
from ..files import cache_root

# GGUF `general.architecture` -> what the engine runs it as. Mistral files
# say "llama"; transformers tells them apart by name (config model_type).
SUPPORTED_ARCHITECTURES = ("gemma3", "gemma2", "llama")
_TOKENIZERS = {  # transformers config model_type -> its tokenizer class (the architecture: MODEL_TYPES)
    "gemma3_text": "GemmaTokenizer",
    "gemma2": "GemmaTokenizer",
    "llama": "LlamaTokenizer",
    "mistral": "LlamaTokenizer",
}
# Tensor types gguf's dequantizer (what transformers calls) turns into floats
# and that llama.cpp's usual quantizations write; the dequantizer decides, this
# list is what an error names.
SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0",
                   "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")
# Bump when the converted folder's contents change. 2: the tokenizer keeps the
# file's BOS rule whatever transformers release converted it.
FORMAT_VERSION = 2
MARKER = "hybridkv-gguf.json"


def find_gguf(path: str) -> str | None:
    """The GGUF file `path` names: itself, or the one .gguf in a folder that
    has no config.json; None for anything else (an ordinary model folder)."""
    if os.path.isfile(path):
        if path.endswith(".gguf"):
            return path
        raise ValueError(f"{path!r} is a file but not a .gguf checkpoint; give a .gguf file or a model folder")
    if not os.path.isdir(path) or os.path.isfile(os.path.join(path, "config.json")):
        return None
    found = sorted(f for f in os.listdir(path) if f.endswith(".gguf"))
    if len(found) > 1:
        raise ValueError(f"{path!r} holds {len(found)} .gguf files ({', '.join(found)}); give the path of one")
    return os.path.join(path, found[0]) if found else None


def file_sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 24), b""):
            digest.update(chunk)
    return digest.hexdigest()


def read_metadata(path: str) -> dict:
    """The file's metadata, read from its header alone (no tensor data),
    after checking that hybridkv serves its `general.architecture`."""
    try:
        from transformers.integrations.gguf import read_gguf_metadata
    except ImportError as e:
        raise ValueError(f"loading {path!r} needs transformers >= 5.23 ({e})") from None
    try:
        metadata, _ = read_gguf_metadata(path)
    except Exception as e:  # noqa: BLE001 - struct, unicode, index errors on a damaged header
        raise ValueError(f"{path!r} is not a readable GGUF file: {e}") from None
    architecture = metadata["general.architecture"]
    if architecture not in SUPPORTED_ARCHITECTURES:
        raise ValueError(f"{path!r}: GGUF architecture {architecture!r} is not supported; "
                         f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
    return metadata


def gguf_model_dir(path: str, progress: bool = True) -> str:
    """The converted Hugging Face folder of GGUF file `path`, converting it
    on first use."""
    metadata = read_metadata(path)
    architecture = metadata["general.architecture"]
    add_bos = bool(metadata.get("tokenizer.ggml.add_bos_token", False))
    digest = file_sha256(path)
    stem = os.path.splitext(os.path.basename(path))[0]
    root = os.path.join(cache_root(), "gguf")
    target = os.path.join(root, f"{stem}-{digest[:16]}-v{FORMAT_VERSION}")
    if os.path.isfile(os.path.join(target, MARKER)):
        return target
    os.makedirs(root, exist_ok=True)
    work = tempfile.mkdtemp(prefix=".converting-", dir=root)
    try:
        _convert(path, architecture, add_bos, digest, work, target, progress)
        try:
            os.replace(work, target)
        except OSError:
            if not os.path.isfile(os.path.join(target, MARKER)):  # not a finished twin from a racing process
                raise
    except NotImplementedError as e:  # gguf's dequantizer meets a type it does not know
        raise ValueError(f"could not convert {path!r}: {e}; hybridkv reads GGUF files of the types "
                         f"{', '.join(SUPPORTED_TYPES)}") from e
    except ImportError as e:
        raise ValueError(f"loading {path!r} needs the gguf package: pip install 'hybridkv[gemma]' ({e})") from e
    except Exception as e:  # noqa: BLE001 - whatever broke, the user gets one clear error
        raise ValueError(f"could not convert {path!r} (is the file truncated or damaged?): "
                         f"{type(e).__name__}: {e}") from e
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return target


def _convert(path: str, gguf_architecture: str, add_bos: bool, digest: str, out: str, target: str,
             progress: bool) -> None:
    """Write the converted folder's files into `out` (renamed to `target` by the caller)."""
    import torch
    import transformers
    from safetensors.torch import save_file
    from tqdm.auto import tqdm
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    start = time.perf_counter()
    if progress:
        print(f"hybridkv: converting {os.path.basename(path)} ({gguf_architecture}) once into {target} "
              f"(about a minute; later loads read the converted folder)", file=sys.stderr)
    folder, name = os.path.split(os.path.abspath(path))
    with tqdm(total=4, desc="converting GGUF", unit="stage", disable=not progress) as bar:
        bar.set_postfix_str("config")
        config = AutoConfig.from_pretrained(folder, gguf_file=name)
        if config.model_type not in _TOKENIZERS:
            raise ValueError(f"transformers reads it as {config.model_type!r}, which hybridkv does not serve")
        architecture, tokenizer_class = MODEL_TYPES[config.model_type][0], _TOKENIZERS[config.model_type]
        bar.update()
        bar.set_postfix_str("tokenizer")
        # The tokenizer class directly: AutoTokenizer would parse the whole file again to find it.
        tokenizer = getattr(transformers, tokenizer_class).from_pretrained(folder, gguf_file=name)
        bar.update()
        bar.set_postfix_str("weights")
        with torch.device("meta"):
            skeleton = AutoModelForCausalLM.from_config(config)  # only its parameter names are read
        tensors = load_gguf_checkpoint(path, return_tensors=True, model_to_load=skeleton,
                                       torch_dtype=torch.float32)["tensors"]
        expected = {n for n, _ in skeleton.named_parameters()}
        if getattr(config, "tie_word_embeddings", False):
            expected.discard("lm_head.weight")
        missing = sorted(expected - set(tensors))
        if missing:
            raise ValueError(f"the file lacks {len(missing)} weights, e.g. {missing[:3]}")
        bar.update()
        bar.set_postfix_str("writing")
        save_file({k: v.contiguous() for k, v in tensors.items()}, os.path.join(out, "model.safetensors"),
                  metadata={"format": "pt"})
        del tensors
        config.architectures = [architecture]
        config.dtype = torch.float32
        config.save_pretrained(out)
        tokenizer.save_pretrained(out)
        _keep_bos_rule(out, add_bos, tokenizer.bos_token, tokenizer.bos_token_id)
        with open(os.path.join(out, MARKER), "w") as f:
            json.dump({"source": os.path.abspath(path), "sha256": digest, "architecture": gguf_architecture,
                       "format_version": FORMAT_VERSION, "transformers": transformers.__version__,
                       "seconds": round(time.perf_counter() - start, 1)}, f, indent=2)
        bar.update()


def _keep_bos_rule(out: str, add_bos: bool, bos: str | None, bos_id: int | None) -> None:
    """Make the saved tokenizer start a text with BOS exactly when the file
    says so (`add_bos`: its `tokenizer.ggml.add_bos_token`), checked by
    loading it as the engine does. Some transformers releases (5.19) read a GGUF tokenizer
    without the file's BOS: a prompt then reaches the model without it,
    and such a folder in a cache shared by two environments served every
    later one that way."""
    import transformers
    from tokenizers import Tokenizer, processors

    if add_bos and (bos is None or bos_id is None):
        raise ValueError("the file asks for a BOS token but its tokenizer names none")

    def starts_with_bos() -> bool:
        ids = transformers.AutoTokenizer.from_pretrained(out).encode("a")
        return bool(ids) and ids[0] == bos_id

    if starts_with_bos() == add_bos:
        return
    file = os.path.join(out, "tokenizer.json")
    fast = Tokenizer.from_file(file)
    if add_bos:
        fast.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos}:1 $B:1", special_tokens=[(bos, bos_id)])
    else:
        fast.post_processor = processors.TemplateProcessing(single="$A", pair="$A $B:1")
    fast.save(file)
    config_file = os.path.join(out, "tokenizer_config.json")
    with open(config_file) as f:
        config = json.load(f)
    config["add_bos_token"] = add_bos
    with open(config_file, "w") as f:
        json.dump(config, f, indent=2)
    if starts_with_bos() != add_bos:
        raise ValueError(f"transformers {transformers.__version__} reads this file's tokenizer "
                         f"{'without' if add_bos else 'with'} the BOS token the file asks "
                         f"{'for' if add_bos else 'to leave out'}, and hybridkv could not correct it")
