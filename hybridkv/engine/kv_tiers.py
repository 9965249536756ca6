"""Tiers below the device pool: host memory and disk (core/tiers.py says
what the manager asks of them and the rules they follow).

A block the pool reuses is copied out (`put`) into host memory; what host
memory pushes out goes to disk; with no host tier, straight to disk. A hit
reads the content back (`fetch`) and the manager loads it into fresh pool
pages (`load`).

Decisions and copies are apart. The manager decides, inside the
scheduler: `put` and `load` only record what to copy (`TierCopy`), in the
order decided; `fetch` reads a disk or host hit's content then, so a block
the tier lost (a missing, short or corrupt file) is a miss the manager
recomputes. The worker copies: `take_copies()` hands the step's list over
with its plan and `copy(copies)` carries it out, in order, before the
forward pass (worker.py): each block the pool is about to reuse is read
out before any page is written, each hit is written into its fresh pages
before the step reads them. A block evicted and hit again in one step is
loaded from the copy its store made.

On disk (`DiskTier`), one file per block under
`DIR/<identity>/g<group>/<key hex>.kv`: a header (magic, format version,
group, width, page size, the identity digest, the key), the pages' bytes,
and a CRC-32 of all of it. The identity (`kv_identity`) hashes every byte
of the weights, the config and tokenizer, the dtype and the layout, so
another model (a fine-tune of one layer too) or layout never reads these
files. A file is written under a temporary name of its writer
and renamed into place, so a reader never sees half a block, and several
processes may share the directory; one that is truncated, corrupt or of
another version is a miss and is removed. A write that fails is a lost
block, never an error for a request: on a full disk the tier makes room
from its own LRU and tries again, after other errors it pauses and tries
again later (`DiskTier`); serving goes on.

Tensor parallelism: every rank keeps its own store, with its own slice of
each block (its own files: `kv_identities`), and replays the driver's
calls (`log`, `replay`). Host memory behaves alike on every rank, but a
disk read can fail on one rank only, so a disk read is made by every rank
at once (`read_agreed`) and counts only if every rank's did; otherwise
every rank drops the block and the driver's `fetch` returns None, the
miss one process gives for a lost file.
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

import torch

from ..core.identity import kv_identity as identity_digest, weights_fingerprint
from ..core.layout import KVCacheLayout
from ..core.tiers import TierRef

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
                  progress: bool = False) -> list[bytes]:
    """One identity per tensor-parallel rank: each rank's disk tier holds
    its own slice of every block, so rank and world size are part of what
    made it (a restart at another size, or another rank, never reads
    these files). One process: `kv_identity` itself."""
    if world == 1:
        return [kv_identity(model_dir, dtype, layout, progress=progress)]
    weights = weights_fingerprint(model_dir, progress)
    return [identity_digest(weights, dtype, layout, f"tensor-parallel rank {rank} of {world}",
                            format_version=FORMAT_VERSION) for rank in range(world)]


class HostTier:
    """Blocks in host memory: one slab of pages (pinned when the pool is on
    a GPU, so copies go by DMA), an LRU of blocks, a free list of pages."""

    def __init__(self, num_pages: int, page_size: int, pin: bool):
        self.slab = torch.empty(num_pages, page_size, dtype=torch.uint8, pin_memory=pin)
        self.free = list(range(num_pages - 1, -1, -1))
        self.blocks: OrderedDict[tuple, list[int]] = OrderedDict()  # (group, key) -> slab pages

    def __contains__(self, item) -> bool:
        return item in self.blocks

    def add(self, item, content: torch.Tensor) -> list:
        """Keep `content` ([width, page size]); returns the blocks pushed
        out to make room, as (item, content)."""
        width = content.shape[0]
        if width > self.slab.shape[0]:
            return [(item, content)]  # larger than the whole tier
        pushed = []
        while len(self.free) < width:
            old, pages = self.blocks.popitem(last=False)
            pushed.append((old, self.slab[pages].clone()))
            self.free.extend(pages)
        pages = [self.free.pop() for _ in range(width)]
        self.slab[pages] = content
        self.blocks[item] = pages
        return pushed

    def get(self, item) -> torch.Tensor | None:
        pages = self.blocks.get(item)
        if pages is None:
            return None
        self.blocks.move_to_end(item)
        return self.slab[pages].clone()

    def touch(self, item) -> None:
        self.blocks.move_to_end(item)

    def clear(self) -> None:
        for pages in self.blocks.values():
            self.free.extend(pages)
        self.blocks.clear()


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
        return os.path.join(self.root, f"g{group}", key.hex() + ".kv")

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
        missing, truncated, corrupt, or of another format or model."""
        if (group, key) not in self.files:
            return None
        try:
            with open(self._path(group, key), "rb") as f:
                data = f.read()
        except OSError:
            data = b""
        content = self._parse(data, group, key)
        if content is None:
            self.remove((group, key))
            return None
        self.files.move_to_end((group, key))
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


class TierCopy:
    """One copy a step's worker makes: a store (`pages` -> the tiers, as
    block `item`) or a load (`content` -> `pages`; `content` may be a
    store of the same step, whose snapshot it then reads)."""

    __slots__ = ("item", "pages", "content", "keep")

    def __init__(self, item, pages, content=None):
        self.item = item  # (group, key) of a store; None for a load
        self.pages = pages
        self.content = content  # a store: its snapshot once made; a load: what to write
        self.keep = True  # a store: False once the tiers were cleared (only a load of this step reads it)

    @property
    def is_store(self) -> bool:
        return self.item is not None


class TieredStore:
    """The tiers below one engine's pool, as the manager sees them
    (core/tiers.py's KVTier): host memory, then disk; either may be off."""

    def __init__(self, pool: torch.Tensor | None, layout: KVCacheLayout, *, host_bytes: int = 0,
                 disk_dir: str | None = None, disk_bytes: int = 0, identity: bytes | None = None,
                 pin: bool | None = None):
        # `pool`: the engine's pages, which put / load / flush copy from and
        # to. None for an owner that copies pages itself and hands the store
        # their content (keep, fetch): another engine's worker. `pin`: pin
        # the host slab (DMA copies); by default, when the pool is on a GPU.
        self.pool = pool
        page = layout.page_size_bytes
        if pin is None:
            pin = pool is not None and pool.device.type == "cuda"
        self.host = HostTier(host_bytes // page, page, pin) if host_bytes >= page else None
        self.disk = DiskTier(disk_dir, identity, page, disk_bytes) if disk_dir else None
        self.index: list[dict] = [{} for _ in layout.groups]
        self.changed = lambda: None  # set by the manager
        # Called with ((group, key), TierRef or None) whenever an index entry
        # is set again (the tier that holds the block now, or gone): for an
        # owner that mirrors the index elsewhere (another engine's scheduler).
        self.moved = None
        self.counters = {"stores": 0, "loads": 0, "store_bytes": 0, "load_bytes": 0, "evictions": 0}
        self.store_bytes_by_group = [0] * len(layout.groups)  # what each layer type costs the tiers
        self.load_seconds = 0.0  # reading hits back and copying them into the pool
        self.copies: list[TierCopy] = []  # decided, not yet made (take_copies)
        self.storing: dict[tuple, TierCopy] = {}  # (group, key) -> its store not yet made
        # Tensor parallelism: the manager's calls, in order, for the workers' stores to replay
        # (replay: each rank's host tier then holds the same blocks in the same slab pages).
        self.log: list | None = None
        self._logged: dict[int, int] = {}  # id(fetched content) -> its fetch's place in the log
        # Tensor parallelism with a disk: the ranks' vote on each disk read
        # (tensor_parallel.py: `leads` on the driver, which asks the workers
        # to read; `all(ok)` is every rank's answer), and on a worker the
        # reads agreed on, which the replay of the driver's fetch then takes.
        self.agreement = None
        self.agreed: dict[tuple, torch.Tensor] = {}
        if self.disk is not None:
            for group, key in self.disk.files:
                if group < len(self.index):
                    self.index[group][key] = TierRef(group, key, "disk")

    # -- the manager's side ------------------------------------------------------
    def put(self, group: int, key: bytes, pages) -> None:
        """Decide to keep the block in `pages` (the worker copies it out
        before the step writes them): the index holds it from now on."""
        if self.log is not None:
            self.log.append(("put", group, key, list(pages)))
        store = TierCopy((group, key), list(pages))
        self.copies.append(store)
        self.storing[(group, key)] = store
        if key not in self.index[group]:
            self.index[group][key] = TierRef(group, key, "host" if self.host is not None else "disk")

    def keep(self, group: int, key: bytes, content: torch.Tensor) -> None:
        """Store a block's content ([width, page size] bytes, on the host):
        host memory, else disk."""
        self.counters["stores"] += 1
        self.counters["store_bytes"] += content.numel()
        self.store_bytes_by_group[group] += content.numel()
        if self.host is not None:
            if (group, key) in self.host:
                self.host.touch((group, key))
                return
            for item, pushed in self.host.add((group, key), content):
                self._to_disk(item, pushed)
            self._reindex((group, key))
        else:
            self._to_disk((group, key), content)

    def _to_disk(self, item, content: torch.Tensor) -> None:
        """A block leaving host memory (or, with none, the pool) goes to disk
        if there is one."""
        if self.disk is not None:
            for old in self.disk.write(*item, content):
                self._reindex(old)
        self._reindex(item)

    def _reindex(self, item) -> None:
        """The index entry of `item` after a tier took, dropped or moved it:
        the tier that holds it, or none (the key leaves the index)."""
        group, key = item
        if self.host is not None and item in self.host:
            self.index[group][key] = TierRef(group, key, "host")
        elif self.disk is not None and item in self.disk.files:
            self.index[group][key] = TierRef(group, key, "disk")
        elif self.index[group].pop(key, None) is not None:
            self.counters["evictions"] += 1
            self.changed()
        if self.moved is not None:
            self.moved(item, self.index[group].get(key))

    def fetch(self, ref: TierRef):
        started = time.perf_counter()
        try:
            content = self._fetch(ref)
        finally:
            self.load_seconds += time.perf_counter() - started
        if self.log is not None:
            self._logged[id(content)] = len(self.log)
            self.log.append(("fetch", ref.group, ref.key, ref.tier, content is not None))
        return content

    def _fetch(self, ref: TierRef):
        item = (ref.group, ref.key)
        store = self.storing.get(item)
        if store is not None:  # evicted in this very step: its load reads the store's snapshot
            return store
        content = self.host.get(item) if self.host is not None else None
        if content is None and self.disk is not None:
            content = self._read_disk(item)
        if content is None:
            self._reindex(item)
            return None
        self.counters["loads"] += 1
        self.counters["load_bytes"] += content.numel()
        return content

    def _read_disk(self, item) -> torch.Tensor | None:
        if self.agreement is None:
            return self.disk.read(*item)
        if self.agreement.leads:
            return self.read_agreed(item)
        # A worker replaying the driver's fetch: it read the block when the
        # driver asked; nothing here means the ranks did not all read it.
        return self.agreed.get(item)

    def read_agreed(self, item) -> torch.Tensor | None:
        """A disk read under tensor parallelism, made on every rank at once
        (the driver asks the workers, then reads its own file): the content
        if every rank read its slice, else None on every rank, each having
        removed its own file, so no rank keeps a block the index dropped."""
        self.agreement.ask(item)
        content = self.disk.read(*item)
        if not self.agreement.all(content is not None):
            self.disk.remove(item)
            self.agreed.pop(item, None)
            return None
        if not self.agreement.leads:
            self.agreed[item] = content
        return content

    def load(self, pages, content) -> None:
        """Decide to write a fetched block into fresh pool pages (the worker
        does, before the step reads them)."""
        if self.log is not None:
            self.log.append(("load", self._logged[id(content)], list(pages)))
        self.copies.append(TierCopy(None, list(pages), content))

    def take_log(self) -> list:
        """The calls logged since the last take (tensor parallelism: they go
        with the step's plan)."""
        log, self.log = self.log, []
        self._logged.clear()
        return log

    def replay(self, log: list) -> None:
        """A tensor-parallel worker's store: make the driver's calls, in
        order, on this rank's pool and host tier (then `copy`)."""
        fetched = {}
        for at, entry in enumerate(log):
            kind = entry[0]
            if kind == "put":
                self.put(*entry[1:])
            elif kind == "fetch":
                fetched[at] = self.fetch(TierRef(*entry[1:4]))
                if fetched[at] is None and entry[4]:
                    raise RuntimeError(f"the tiers of the ranks differ: this rank lacks block {entry[1:3]}")
            elif kind == "load":
                self.load(entry[2], fetched[entry[1]])
            elif kind == "write":
                self.copy(self.take_copies())  # as the driver's flush: what was decided before, first
                self.write_through(*entry[1:])
            else:
                self.clear()
        self.agreed.clear()  # every read agreed on before this log was fetched in it

    # -- the worker's side -------------------------------------------------------
    def take_copies(self) -> list[TierCopy]:
        """The copies decided since the last call, in order: the step's plan
        carries them to the worker."""
        copies, self.copies = self.copies, []
        return copies

    def copy(self, copies: list[TierCopy]) -> None:
        """Make the copies, in the order decided: stores read the pool pages
        (then keep the content: host memory, else disk), loads write them."""
        for c in copies:
            if c.is_store:
                c.content = self.pool[c.pages].cpu()
                if self.storing.get(c.item) is c:
                    del self.storing[c.item]
                if c.keep:
                    self.keep(*c.item, c.content)
                continue
            started = time.perf_counter()
            content = c.content.content if isinstance(c.content, TierCopy) else c.content
            if isinstance(c.content, TierCopy):
                self.counters["loads"] += 1
                self.counters["load_bytes"] += content.numel()
            self.pool[c.pages] = content.to(self.pool.device, non_blocking=True)
            self.load_seconds += time.perf_counter() - started

    def clear(self) -> None:
        if self.log is not None:
            self.log.append(("clear",))
        for store in self.storing.values():  # decided before: not kept now
            store.keep = False
        self.storing.clear()
        if self.host is not None:
            self.host.clear()
        if self.disk is not None:
            self.disk.clear()
        for index in self.index:
            index.clear()
        self.changed()

    # -- the engine's side -------------------------------------------------------
    def flush(self, kv) -> int:
        """Write every block the pool still caches to disk (a server about to
        stop: the next start hits them). Returns the blocks written."""
        self.copy(self.take_copies())
        if self.disk is None or not self.disk.writable:
            return 0
        written = 0
        for g in range(len(self.index)):
            for key, pages in kv.cached_pages(g):
                if (g, key) not in self.disk.files:
                    written += self.write_through(g, key, pages)
        return written

    def write_through(self, group: int, key: bytes, pages) -> bool:
        """Write a block the pool caches to disk now (`flush`; a worker
        replays it on its own pages). True if the disk holds it then."""
        item = (group, key)
        if self.log is not None:
            self.log.append(("write", group, key, list(pages)))
        if item in self.disk.files:
            return False
        self._to_disk(item, self.pool[list(pages)].cpu())
        return item in self.disk.files

    def describe(self) -> dict:
        """Sizes and counters, for stats and metrics."""
        out = dict(self.counters)
        out["store_bytes_by_group"] = list(self.store_bytes_by_group)
        out["load_seconds"] = self.load_seconds
        if self.host is not None:
            out["host_blocks"] = len(self.host.blocks)
            out["host_bytes_used"] = (self.host.slab.shape[0] - len(self.host.free)) * self.host.slab.shape[1]
            out["host_capacity_bytes"] = self.host.slab.numel()
        if self.disk is not None:
            out.update({f"disk_{k}": v for k, v in self.disk.describe().items()})
        return out
