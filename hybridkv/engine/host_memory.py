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

So it is applied once the model and tokenizer are loaded, after handing
back what loading freed (malloc_trim): converting a GGUF file's weights and
tokenizer frees hundreds of MiB of temporaries, which a heap that keeps
everything would have held for the life of the process (Gemma-3 270M,
building the engine and generating 64 tokens: peak RSS 2,258 MiB with the
thresholds set first, 1,993 MiB set after loading).
"""

from __future__ import annotations

import ctypes
import ctypes.util

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_done = False


def keep_large_allocations() -> bool:
    """Call after loading: gives back what loading freed, then sets the
    thresholds (once per process). False where the C library is not glibc."""
    global _done
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    trim = getattr(libc, "malloc_trim", None)
    if trim is not None:  # every time: a second engine's loading frees as much
        trim(0)
    if _done:
        return True
    ok = mallopt(_M_MMAP_THRESHOLD, 1 << 30) == 1 and mallopt(_M_TRIM_THRESHOLD, 1 << 30) == 1
    _done = ok
    return ok
