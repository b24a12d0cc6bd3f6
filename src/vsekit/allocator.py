"""Allocator tuning for the numeric work of one vsekit process.

Scoring and training make many short-lived tensors of a few hundred kB to a few MB, which glibc
serves above its mmap threshold with a fresh ``mmap`` (faulted in and zeroed page by page) and
returns with ``munmap``. :func:`tune_allocator` keeps blocks up to 32 MiB on the heap and lets up to
512 MiB of free heap stay mapped, so freed blocks are reused (a quarter of pairwise scoring's time on
the 2-core VM of ``bench/pairwise.py``); peak memory is unchanged. The ``vsekit`` command calls it
once at start; it does nothing off glibc, and ``VSEKIT_MALLOC_TUNING=0`` turns it off (docs/train.md).
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
