"""The identity of a cache's KV: one digest of everything that decides the
bytes of a block, so that blocks made by other weights, another dtype or
another layout are never served (a tier's files live under their
identity's name, and a file whose header names another identity is a
miss).

What goes in:
- every byte of every weight file of the model folder (a fine-tune that
  changes one late layer is another model: hashing only the files' heads,
  where safetensors keeps its header and the first tensors by name, let a
  merged LoRA read its base model's blocks), the config, and the
  tokenizer's files (they decide which ids a text becomes);
- the weights' dtype, the layout (page size, block size, groups), the
  format and hybridkv's version (its model code computes the KV);
- `extra`: whatever else the caller's engine adds (another engine's name,
  version and cache options; a tensor-parallel rank).

A weight file is hashed once (SHA-256, ~2 GB/s a core with SHA
instructions) and its digest remembered under the cache folder, keyed by
the file's real path, size, inode, modification and change times: a file
rewritten in place changes its change time, which no tool can set back,
so a remembered digest is never of other bytes. A second start of the
same model reads no weight byte for this.
"""

from __future__ import annotations

import hashlib
import json
import os

from .layout import KVCacheLayout
from .native import cache_root
from .version import VERSION

# The files of a model folder whose bytes decide its KV: weights in every
# format the loaders read, and the config and tokenizer files. Other files
# (a README, images, a disk tier placed inside the folder) do not count.
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".ckpt", ".npz", ".h5", ".msgpack")
CONFIG_AND_TOKENIZER_FILES = frozenset((
    "config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
    "tokenizer.model", "vocab.json", "vocab.txt", "merges.txt"))

_CHUNK = 8 << 20
_SHOW_PROGRESS_FROM = 1 << 30  # bytes to hash before a progress bar is worth showing


def model_files(model_dir: str) -> list[str]:
    """The files of `model_dir` that decide its KV (see above), sorted."""
    names = sorted(n for n in os.listdir(model_dir)
                   if n.endswith(WEIGHT_SUFFIXES) or n in CONFIG_AND_TOKENIZER_FILES or n.endswith(".tiktoken"))
    return [p for p in (os.path.join(model_dir, n) for n in names) if os.path.isfile(p)]


def file_digest(path: str, progress=None) -> str:
    """SHA-256 of every byte of `path` (hex), remembered by the file's
    identity on disk (see above). `progress`: a tqdm bar to advance by the
    bytes read, or None."""
    real = os.path.realpath(path)
    st = os.stat(real)
    key = hashlib.sha256(f"{real}\0{st.st_size}\0{st.st_ino}\0{st.st_dev}\0{st.st_mtime_ns}\0{st.st_ctime_ns}"
                         .encode()).hexdigest()
    remembered = os.path.join(cache_root(), "file-digests", key[:2], key)
    try:
        with open(remembered) as f:
            digest = f.read().strip()
        if len(digest) == 64:
            if progress is not None:
                progress.update(st.st_size)
            return digest
    except OSError:
        pass
    h = hashlib.sha256()
    with open(real, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
            if progress is not None:
                progress.update(len(chunk))
    digest = h.hexdigest()
    try:  # written whole under a name of its own, then renamed: a reader never sees half a digest
        os.makedirs(os.path.dirname(remembered), exist_ok=True)
        temporary = f"{remembered}.{os.getpid()}.tmp"
        with open(temporary, "w") as f:
            f.write(digest)
        os.replace(temporary, remembered)
    except OSError:
        pass  # a read-only cache folder: the digest is computed again next time
    return digest


def weights_fingerprint(model_dir: str, progress: bool = False) -> list[tuple[str, int, str]]:
    """(name, size, SHA-256) of each file of `model_dir` that decides its
    KV; a progress bar while more than 1 GiB of it is not yet remembered
    and `progress` is set. `model_dir` "": no files (a caller whose
    weights are named by its `extra` alone: a hub id the machine holds no
    copy of)."""
    paths = model_files(model_dir) if model_dir else []
    total = sum(os.path.getsize(p) for p in paths)
    bar = None
    if progress and total >= _SHOW_PROGRESS_FROM:
        from tqdm import tqdm

        bar = tqdm(total=total, unit="B", unit_scale=True, desc="hashing the weights (once per file)", leave=False)
    try:
        return [(os.path.basename(p), os.path.getsize(p), file_digest(p, bar)) for p in paths]
    finally:
        if bar is not None:
            bar.close()


def kv_identity(weights: list, dtype: str, layout: KVCacheLayout, extra: str = "", *,
                format_version: int = 1) -> bytes:
    """What made the KV (see above), from the `weights_fingerprint` of its
    model: a 32-byte digest."""
    h = hashlib.sha256(f"hybridkv-kv-v{format_version}".encode())
    groups = [(repr(g.spec), g.layer_names, g.block_size, g.pages_per_block,
               *(("heads_per_page", g.heads_per_page) if g.heads_per_page else ()),
               *(("scales_apart",) if g.scales_apart else ()))
              for g in layout.groups]
    h.update(json.dumps([VERSION, weights, dtype, layout.page_size_bytes, layout.block_size, repr(groups)])
             .encode())
    if extra:
        h.update(extra.encode())
    return h.digest()
