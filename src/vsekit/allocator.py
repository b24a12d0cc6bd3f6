"""Allocator tuning for the numeric work of one vsekit process.

Scoring and training make many short-lived tensors of a few hundred kB to a few MB. glibc serves
every block above its mmap threshold (128 kB at start, raised only as large blocks are freed) with
a fresh ``mmap`` and returns it with ``munmap``, and it trims the heap top whenever 128 kB lie free:
so the next block of the same size is faulted in again, page by page, and zeroed by the kernel. On
the 2-core VM of ``bench/pairwise.py`` that costs pairwise scoring at demo dims about a quarter of
its time. :func:`tune_allocator` keeps blocks up to 32 MiB on the heap and lets up to 512 MiB of
free heap stay mapped, so freed blocks are reused; peak memory is unchanged (it is what was in use),
only the release to the OS of memory freed *after* the peak is deferred.

The ``vsekit`` command calls it once at start. Library users may call it themselves; it does
nothing off glibc, and ``VSEKIT_MALLOC_TUNING=0`` turns it off.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 << 20     # glibc's upper limit for M_MMAP_THRESHOLD on 64-bit systems
TRIM_THRESHOLD = 512 << 20

_done: bool | None = None


def tune_allocator() -> bool:
    """Raise glibc's mmap and trim thresholds once per process; True if they are now in effect."""
    global _done
    if _done is not None:
        return _done
    _done = False
    if os.environ.get("VSEKIT_MALLOC_TUNING", "1").strip() == "0" or not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):     # not glibc (musl has no mallopt): leave the allocator alone
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    _done = mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1 and mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1
    return _done
