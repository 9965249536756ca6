"""Stand-ins for the filesystem faults a disk tier meets, wrapped around one
DiskTier's `_write_file` (the only place it writes): a disk with little
room, one that refuses writes (read-only, I/O errors) until told otherwise,
and a slow one that holds each write between its temporary file and the
rename."""

from __future__ import annotations

import errno
import os
import threading
import time


def dead_pid() -> int:
    """A process id that belongs to no process now (a child that exited)."""
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)
    return pid


def used_bytes(directory: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(directory) for f in files)


class SmallDisk:
    """A filesystem of `capacity` bytes under `directory` (every file there
    counts, the tier's and anyone else's): a write that would pass it fails
    with ENOSPC, as a full disk does."""

    def __init__(self, tier, directory: str, capacity: int):
        self.directory, self.capacity = directory, capacity
        self.refused = 0
        real = tier._write_file

        def write_file(path, chunks):
            size = sum(len(c) for c in chunks)
            if used_bytes(self.directory) + size > self.capacity:
                self.refused += 1
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)
            real(path, chunks)

        tier._write_file = write_file


class BrokenDisk:
    """Every write fails with `error` (EROFS: a read-only remount) while
    `broken` is set."""

    def __init__(self, tier, error: int = errno.EROFS):
        self.broken = True
        real = tier._write_file

        def write_file(path, chunks):
            if self.broken:
                raise OSError(error, os.strerror(error), path)
            real(path, chunks)

        tier._write_file = write_file


class SlowDisk:
    """Each write waits `delay` seconds after writing its temporary file's
    bytes, before the rename (a slow or network filesystem): another
    process's start-up scan then meets the temporary file. With `gate`, the
    write waits for the gate instead, and `entered` is set while it waits."""

    def __init__(self, tier, delay: float = 0.0, gate: threading.Event | None = None):
        self.delay, self.gate = delay, gate
        self.entered = threading.Event()
        real = tier._write_file

        def slow(chunks):
            yield from chunks
            self.entered.set()  # the bytes are in the temporary file; the rename comes after this
            if self.gate is not None:
                self.gate.wait(30)
            else:
                time.sleep(self.delay)

        tier._write_file = lambda path, chunks: real(path, slow(chunks))
