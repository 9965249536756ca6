"""The tensor-parallel ranks' all-reduces through shared memory, when they
share a host (the CPU: every rank is a process the driver started here).

gloo's all-reduce goes through loopback sockets and a thread handoff per
call: about 1.3 ms for a decode step's 64 KiB on this project's 2-core
machine, where a step makes 6-36 of them. Here each rank copies its part
into its slot of one segment the ranks map (a file under /dev/shm), waits
for the others' (spinning, yielding the core), and sums the slots in rank
order, so every rank gets the same bits (kernels.c `host_all_reduce`).
The layers call it through `layers/parallel.py`'s hook; tensors it does not
take (not on the CPU, not float32 or bfloat16) go through gloo as before,
and so do the rare collectives of other kinds (the logits' gather, a vote).

A rank that dies leaves the others waiting: the driver's watchdog sets the
segment's abort word as it stops the workers, and a wait gives up after
the group's timeout, either way with an error instead of a hang.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
import secrets
import tempfile

import torch

log = logging.getLogger("hybridkv.tensor_parallel")

SLOT_BYTES = 4 << 20  # a rank's part of one exchange (larger tensors go in several)
HEADER_BYTES = 4096  # the ranks' counters and the abort word (kernels.c SHM_SLOTS)
_LINE = 64


def segment_path() -> str:
    """A new segment's path: shared memory where there is /dev/shm."""
    folder = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
    return os.path.join(folder, f"hybridkv-tp-{os.getpid()}-{secrets.token_hex(4)}")


def create_segment(path: str, world: int) -> None:
    """The segment's file, zeroed, for `world` ranks (the driver makes it
    before starting the workers; every rank maps it)."""
    with open(path, "wb") as f:
        f.truncate(HEADER_BYTES + world * SLOT_BYTES)


class HostReduce:
    """This rank's view of the segment: `__call__(x)` sums x over the ranks
    in place and says True, or says False for a tensor it does not take."""

    CODES = {torch.float32: 0, torch.bfloat16: 1}  # kernels.c's storage types

    def __init__(self, path: str, rank: int, world: int, timeout_s: float, lib):
        self.rank, self.world, self.timeout_s, self.lib = rank, world, timeout_s, lib
        fd = os.open(path, os.O_RDWR)
        try:
            self.map = mmap.mmap(fd, HEADER_BYTES + world * SLOT_BYTES)
        finally:
            os.close(fd)
        self.base = ctypes.addressof(ctypes.c_char.from_buffer(self.map))
        self.parts = 0  # parts exchanged so far, the same count on every rank

    def __call__(self, x: torch.Tensor) -> bool:
        code = self.CODES.get(x.dtype)
        if code is None or x.device.type != "cpu" or not x.is_contiguous():
            return False
        used = self.lib.host_all_reduce(x.data_ptr(), code, x.numel(), self.base, SLOT_BYTES, self.rank, self.world,
                                        self.parts + 1, self.timeout_s)
        if used < 0:
            why = "a rank stopped (the group was aborted)" if used == -1 else f"no answer in {self.timeout_s:.0f} s"
            raise RuntimeError(f"tensor-parallel all-reduce through shared memory: {why}")
        self.parts += used
        return True

    def abort(self) -> None:
        """Make every rank's wait give up (the watchdog, as it stops the workers)."""
        ctypes.c_int64.from_address(self.base + 2 * self.world * _LINE).value = 1


def open_host_reduce(path: str, rank: int, world: int, timeout_s: float) -> HostReduce | None:
    """This rank's HostReduce, or None (logged) where the C kernels are not
    there: gloo carries the all-reduces then."""
    from ..layers.backends.cpu import Unavailable, kernels

    try:
        lib = kernels()
    except Unavailable as error:
        log.warning("tensor-parallel all-reduces go through gloo, not shared memory (%s)", error)
        return None
    return HostReduce(path, rank, world, timeout_s, lib)
