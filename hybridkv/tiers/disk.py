"""The disk tier: one file per block under
`DIR/<identity>/g<group>/<key hex>.kv`: a header (magic, format version,
group, width, page size, the identity digest, the key), the pages' bytes,
and a CRC-32 of all of it. The identity (`kv_identity`) hashes every byte
of the weights, the config and tokenizer, the dtype and the layout, so
another model (a fine-tune of one layer too) or layout never reads these
files. A file is written under a temporary name of its writer and renamed
into place, so a reader never sees half a block, and several processes may
share the directory; one that is truncated, corrupt or of another version
is a miss and is removed. A write that fails is a lost block, never an
error for a request: on a full disk the tier makes room from its own LRU
and tries again, after other errors it pauses and tries again later;
serving goes on.

Under tensor parallelism every rank has its own files (its slices of each
block) under an identity of its own (`kv_identities`).
"""

from __future__ import annotations

import errno
import glob
import hashlib
import os
import re
import secrets
import socket
import struct
import time
import warnings
import zlib
from collections import OrderedDict
from collections.abc import Iterator

import torch

from ..core.identity import kv_identity as identity_digest, weights_fingerprint
from ..core.layout import KVCacheLayout

FORMAT_VERSION = 1
_MAGIC = b"HKVC"
_HEADER = struct.Struct("<4sHHII32sB")  # magic, version, group, width, page size, identity, key length
_TRAILER = struct.Struct("<I")  # CRC-32 of header, key and pages


def kv_identity(model_dir: str, dtype: str, layout: KVCacheLayout, extra: str = "",
                progress: bool = False) -> bytes:
    """What made the KV of these files (core/identity.py): every byte of
    the weights, the config and tokenizer (`model_dir` "": none), the
    dtype, the layout, this file format's version and `extra`."""
    return identity_digest(weights_fingerprint(model_dir, progress), dtype, layout, extra,
                           format_version=FORMAT_VERSION)


def kv_identities(model_dir: str, dtype: str, layout: KVCacheLayout, world: int,
                  progress: bool = False, extra: str = "") -> list[bytes]:
    """One identity per tensor-parallel rank: each rank's disk tier holds
    its own slice of every block, so rank and world size are part of what
    made it (a restart at another size, or another rank, never reads
    these files). One process: `kv_identity` itself. `extra`: what else
    decides the bytes (the engine's key centres)."""
    if world == 1:
        return [kv_identity(model_dir, dtype, layout, extra, progress=progress)]
    weights = weights_fingerprint(model_dir, progress)
    return [identity_digest(weights, dtype, layout, f"tensor-parallel rank {rank} of {world}"
                            + (f"; {extra}" if extra else ""), format_version=FORMAT_VERSION)
            for rank in range(world)]


class DiskTier:
    """Blocks in files, an LRU by byte budget (see the module docstring).
    Usable alone: give it a directory, the identity of what made the KV
    (`kv_identity`), the page size and a byte budget; `write`, `read`,
    `remove`, `clear`; `files` (item -> bytes, oldest first), `bytes`,
    `writable` and `describe()` say what it holds and how it fares.

    Several processes may share the directory. Each writes under temporary
    names of its own (`<key>.kv.<machine>-<pid>-<random>.tmp`, the machine
    being the host, its boot and its process namespace), and a start-up
    removes a temporary file only when no live writer can still rename it:
    its owner's process is gone, or it is older than `STALE_TEMP_SECONDS`.
    Each process keeps its own LRU and budget over the files it knows of;
    a file another one removed is a miss.

    A write that fails does not end writing: on a full disk (ENOSPC,
    EDQUOT) the tier removes its own oldest files and tries again; after
    any other error (a read-only or vanished directory, an I/O error) it
    pauses and tries again after `retry_seconds`, doubling the pause at
    each failure up to `MAX_RETRY_SECONDS`; a write that succeeds resets
    it. A temporary file that another process removed loses that block
    only."""

    STALE_TEMP_SECONDS = 600.0  # a write takes milliseconds: a temporary file this old has no live writer
    MAX_RETRY_SECONDS = 300.0
    _NO_ROOM = (errno.ENOSPC, errno.EDQUOT)

    def __init__(self, directory: str, identity: bytes, page_size: int, budget_bytes: int, *,
                 retry_seconds: float = 10.0):
        self.root = os.path.join(directory, identity.hex()[:32])
        self.identity = identity
        self.page_size = page_size
        self.budget = budget_bytes
        self.files: OrderedDict[tuple, int] = OrderedDict()  # (group, key) -> bytes, oldest first
        self.bytes = 0
        self.retry_seconds = retry_seconds
        self.resume_at = 0.0  # time.monotonic() from which writing is on again
        self.pause = 0.0  # the last pause: the next one doubles it
        self.writes = 0  # blocks written
        self.write_errors = 0  # writes that failed, for any reason
        self.last_error: str | None = None
        self.swept_temps = 0  # temporary files of dead writers removed at start
        self._machine = _machine_id()
        try:
            os.makedirs(self.root, exist_ok=True)
        except OSError as e:
            self._failed(e)
        self._scan()

    @property
    def writable(self) -> bool:
        """Writing is on (False while paused after an error)."""
        return time.monotonic() >= self.resume_at

    def _path(self, group: int, key: bytes) -> str:
        return _block_path(self.root, group, key)

    def _scan(self) -> None:
        """What the directory holds: every whole block file, oldest first
        (contents are checked when read); temporary files whose writer is
        gone are removed, those a live writer may still rename are left."""
        found = []
        now = time.time()
        for path in glob.glob(os.path.join(self.root, "g*", "*")):
            name = os.path.basename(path)
            try:
                if name.endswith(".tmp"):
                    self._sweep(path, name, now)
                    continue
                if not name.endswith(".kv"):
                    continue  # not a file of this tier
                group = int(os.path.basename(os.path.dirname(path))[1:])
                key = bytes.fromhex(name[:-3])
                stat = os.stat(path)
            except (OSError, ValueError):
                continue
            found.append((stat.st_mtime_ns, group, key, stat.st_size))
        for _, group, key, size in sorted(found):
            self.files[(group, key)] = size
            self.bytes += size

    def _sweep(self, path: str, name: str, now: float) -> None:
        """Remove a temporary file if no live writer can rename it."""
        owner = _TEMP_NAME.match(name)
        dead = owner is not None and owner["machine"] == self._machine and not _alive(int(owner["pid"]))
        if dead or now - os.stat(path).st_mtime > self.STALE_TEMP_SECONDS:
            os.unlink(path)
            self.swept_temps += 1

    def write(self, group: int, key: bytes, content: torch.Tensor) -> list:
        """Store a block atomically; returns the items removed for room."""
        if (group, key) in self.files:
            self.files.move_to_end((group, key))
            return []
        if not self.writable:
            return []
        head = _HEADER.pack(_MAGIC, FORMAT_VERSION, group, content.shape[0], self.page_size, self.identity,
                            len(key)) + key
        pages = memoryview(content.numpy()).cast("B")  # written from the tensor's memory, not copied
        crc = _TRAILER.pack(zlib.crc32(pages, zlib.crc32(head)))
        size = len(head) + len(pages) + len(crc)
        if size > self.budget:
            return []  # larger than the whole tier: refused before anything is removed
        removed = self._make_room(self.budget - size)
        while True:
            try:
                self._write_file(self._path(group, key), (head, pages, crc))
                break
            except OSError as e:
                self.write_errors += 1
                self.last_error = f"{errno.errorcode.get(e.errno, e.errno)}: {e.strerror or e}"
                if e.errno not in self._NO_ROOM or not self.files:
                    if e.errno != errno.ENOENT:  # ENOENT: another process removed our temporary file
                        self._failed(e)
                    return removed
                removed += self._make_room(max(0, self.bytes - size))  # a full disk: our oldest go, then again
        self.files[(group, key)] = size
        self.bytes += size
        self.writes += 1
        self.pause = 0.0
        return removed

    def _make_room(self, limit: int) -> list:
        """Remove the oldest files until at most `limit` bytes are held."""
        removed = []
        while self.files and self.bytes > limit:
            old = next(iter(self.files))
            self.remove(old)
            removed.append(old)
        return removed

    def _write_file(self, path: str, chunks) -> None:
        """Write `chunks` to `path` atomically: into a temporary file owned
        by this process, then renamed into place."""
        tmp = f"{path}.{self._machine}-{os.getpid()}-{secrets.token_hex(4)}.tmp"
        try:
            try:
                f = open(tmp, "wb")
            except FileNotFoundError:  # the group's first block, or its directory was removed under us
                os.makedirs(os.path.dirname(path), exist_ok=True)
                f = open(tmp, "wb")
            with f:
                for chunk in chunks:
                    f.write(chunk)
            os.replace(tmp, path)
        except BaseException:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise

    def _failed(self, error: OSError) -> None:
        """Pause writing after an error other than a full disk."""
        self.pause = min(self.MAX_RETRY_SECONDS, 2 * self.pause if self.pause else self.retry_seconds)
        self.resume_at = time.monotonic() + self.pause
        warnings.warn(f"the disk KV tier at {self.root} stops storing blocks for {self.pause:g} s: {error}",
                      RuntimeWarning, stacklevel=3)

    def read(self, group: int, key: bytes) -> torch.Tensor | None:
        """The block's pages, or None (and the file removed) if it is
        missing, truncated, corrupt, or of another format or model. A file
        another process wrote since this one looked is read too, and joins
        its LRU (its bytes count from then on: the next write makes room)."""
        item = (group, key)
        try:
            with open(self._path(group, key), "rb") as f:
                data = f.read()
        except OSError:
            data = b""
        content = self._parse(data, group, key)
        if content is None:
            self.remove(item)
            return None
        if item in self.files:
            self.files.move_to_end(item)
        else:
            self.files[item] = len(data)
            self.bytes += len(data)
        return content

    def _parse(self, data: bytes, group: int, key: bytes) -> torch.Tensor | None:
        head = _HEADER.size + len(key)
        if len(data) < head + _TRAILER.size:
            return None
        magic, version, g, width, page_size, identity, key_len = _HEADER.unpack_from(data)
        if (magic, version, g, page_size, identity, key_len) != (_MAGIC, FORMAT_VERSION, group, self.page_size,
                                                                  self.identity, len(key)):
            return None
        if data[_HEADER.size:head] != key or len(data) != head + width * page_size + _TRAILER.size:
            return None
        if _TRAILER.unpack_from(data, len(data) - _TRAILER.size)[0] != zlib.crc32(data[:-_TRAILER.size]):
            return None
        pages = bytearray(data[head:head + width * page_size])
        return torch.frombuffer(pages, dtype=torch.uint8).view(width, page_size)

    def remove(self, item) -> None:
        size = self.files.pop(item, None)
        if size is None:
            return
        self.bytes -= size
        try:
            os.unlink(self._path(*item))
        except OSError:
            pass

    def clear(self) -> None:
        for item in list(self.files):
            self.remove(item)

    def describe(self) -> dict:
        """State and counters, for stats and metrics."""
        return {"blocks": len(self.files), "bytes_used": self.bytes, "budget_bytes": self.budget,
                "writable": self.writable, "writes": self.writes, "write_errors": self.write_errors,
                "last_error": self.last_error,
                "retry_in_seconds": max(0.0, self.resume_at - time.monotonic())}


_TEMP_NAME = re.compile(r"^[0-9a-f]+\.kv\.(?P<machine>[0-9a-f]{12})-(?P<pid>[0-9]+)-[0-9a-f]+\.tmp$")


def _machine_id() -> str:
    """Where a process id means one process: the host, its boot and the
    process namespace (containers on one kernel have their own pids)."""
    parts = [socket.gethostname()]
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            parts.append(f.read().strip())
        parts.append(os.readlink("/proc/self/ns/pid"))
    except OSError:
        pass
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:12]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def list_blocks(directory: str, identity: bytes) -> Iterator[tuple[int, bytes]]:
    """(group, key) of every block file of `identity` under `directory`, by
    name only (nothing is read, created or removed): what a scheduler may
    count on before a worker reads the files."""
    for path in glob.glob(os.path.join(directory, identity.hex()[:32], "g*", "*.kv")):
        try:
            yield int(os.path.basename(os.path.dirname(path))[1:]), bytes.fromhex(os.path.basename(path)[:-3])
        except ValueError:
            continue


def has_block(directory: str, identity: bytes, group: int, key: bytes) -> bool:
    """Whether a file of the block is in `directory` now, whoever wrote it
    (by name: nothing is read)."""
    return os.path.exists(_block_path(os.path.join(directory, identity.hex()[:32]), group, key))


def _block_path(root: str, group: int, key: bytes) -> str:
    return os.path.join(root, f"g{group}", key.hex() + ".kv")
