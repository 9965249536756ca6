"""Host memory for a CPU engine: keep large allocations in the heap.

Every CPU step allocates and frees tensors of megabytes (activations, the
logits of a 262,144-word vocabulary). glibc serves blocks above its mmap
threshold (128 KiB at first) with a fresh mmap and returns them with munmap,
so each of those tensors costs a page fault per 4 KiB every step. glibc
raises the threshold by itself only after a large block is freed, which is
why the same engine ran 1.3x faster on tiny-jamba in a process that had
loaded and dropped another model first. Setting the thresholds once removes
that lottery: blocks up to 1 GiB come from the heap and freed memory stays
for the next step (the process keeps what it used at its peak).
"""

from __future__ import annotations

import ctypes
import ctypes.util

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_done = False


def keep_large_allocations() -> bool:
    """Apply once per process; False where the C library is not glibc."""
    global _done
    if _done:
        return True
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    ok = mallopt(_M_MMAP_THRESHOLD, 1 << 30) == 1 and mallopt(_M_TRIM_THRESHOLD, 1 << 30) == 1
    _done = ok
    return ok
