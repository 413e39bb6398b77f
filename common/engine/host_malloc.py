"""glibc malloc for a CPU engine: keep freed step buffers in the heap.

A CPU step allocates and frees tensors of several MB per layer (the decode attention's
gathered K/V, SDPA's work space). By default glibc serves each from a fresh ``mmap`` and
gives it back on free, then trims the heap top, so every layer pays page faults and the
kernel zeroing those pages again. Measured on the embedded model (2 cores, batch 16, 30
layers of decode attention): 90 ms with glibc's defaults, 44 ms with large blocks kept in
the heap (``M_MMAP_THRESHOLD`` 32 MiB, the most glibc takes) and the heap trimmed only
past 256 MiB; either setting alone does not help (198 and 90 ms). And one arena for every
thread (``M_ARENA_MAX`` 1): the services step their engine in a thread of its own, which
glibc gives an arena of 64 MiB heaps that cannot hold a step's buffers, so they were
mmap'd and unmapped again every step whatever the thresholds (a 2,048-token prefill on the
embedded model: ~50k page faults and 1.25-1.5 s a step in a thread, 0 and 1.0 s with one
arena; in the main thread it is 1.0 s either way). Set once per process,
before the model loads; ``MALLOC_MMAP_THRESHOLD_`` / ``MALLOC_TRIM_THRESHOLD_`` in the
environment win, and other allocators (musl, an LD_PRELOADed tcmalloc) are left alone.
"""

from __future__ import annotations

import ctypes
import os
import sys

M_TRIM_THRESHOLD = -1  # glibc's mallopt parameter numbers (malloc.h)
M_MMAP_THRESHOLD = -3
M_ARENA_MAX = -8
MMAP_THRESHOLD = 32 << 20
TRIM_THRESHOLD = 256 << 20
_done: bool | None = None


def keep_freed_buffers() -> bool:
    """Apply the settings above once; True when glibc took them."""
    global _done
    if _done is not None:
        return _done
    _done = False
    env = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")
    if not sys.platform.startswith("linux") or any(name in os.environ for name in env):
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    _done = (
        bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD))
        and bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))
        and bool(mallopt(M_ARENA_MAX, 1))
    )
    return _done
