"""Fused CPU kernels for evaluation-time similarities that are not matrix products.

The order-violation similarity ``S(c, i) = -||max(0, c - i)||^2`` has no matrix-product form: every
(image, caption, dimension) triple needs a subtract, a clamp and a multiply-add. Done with tensor
operations that is three passes over an ``images x captions x dim`` temporary, so the work is bound
by memory bandwidth (the temporary never fits in cache) and the broadcast needs gigabytes. The
kernel here fuses the three steps into one loop over cache-sized tiles (8 images x 64 captions, a
few hundred KB), vectorised and run on every core by numba, with no temporary beyond the output.

numba is a dependency, but everything works without it: :func:`order_violation` returns ``None``
when numba cannot be imported (say, a numpy too new for the installed numba) and callers fall back
to the blockwise tensor path. Gradients never go through here: training uses the tensor path.
"""

from __future__ import annotations

import os
import threading

import numpy as np

_lock = threading.Lock()
# numba's default (workqueue) threading layer must not be entered by two threads at once
_run_lock = threading.Lock()
_kernel = None
_failed = False

# Tile sizes: one image row (4 KB at 1,024-d) stays in L1 while it meets 64 caption rows (256 KB, L2).
_TILE_IMAGES = 8
_TILE_CAPTIONS = 64


def _build():
    """Compile (or load from numba's on-disk cache) the fused kernel; None when numba is missing."""
    global _kernel, _failed
    with _lock:
        if _kernel is not None or _failed:
            return _kernel
        if os.environ.get("VSEKIT_NO_NUMBA"):
            _failed = True
            return None
        try:
            from numba import njit, prange
        except Exception:  # ImportError, or numba refusing this numpy version
            _failed = True
            return None

        ti, tc = _TILE_IMAGES, _TILE_CAPTIONS

        @njit(parallel=True, fastmath=True, cache=True, nogil=True)
        def _order_violation(img, cap, out):  # pragma: no cover - compiled
            n, m, d = img.shape[0], cap.shape[0], img.shape[1]
            for blk in prange((n + ti - 1) // ti):
                a = blk * ti
                b = min(a + ti, n)
                for s in range(0, m, tc):
                    e = min(s + tc, m)
                    for i in range(a, b):
                        for c in range(s, e):
                            acc = np.float32(0.0)
                            for k in range(d):
                                t = cap[c, k] - img[i, k]
                                if t > 0:
                                    acc += t * t
                            out[i, c] = -acc
            return out

        _kernel = _order_violation
        return _kernel


def available() -> bool:
    """Whether the fused kernel can run here (numba importable)."""
    return _build() is not None


def order_violation(img: np.ndarray, cap: np.ndarray, threads: int | None = None) -> np.ndarray | None:
    """(n_img, n_cap) float32 ``-||max(0, cap - img)||^2``, or None when numba is unavailable.

    ``img`` is (n_img, dim) and ``cap`` (n_cap, dim); both are made C-contiguous float32.
    ``threads`` caps numba's worker threads (default: torch's intra-op thread count, so
    ``torch.set_num_threads`` governs both paths).
    """
    kernel = _build()
    if kernel is None:
        return None
    import numba
    import torch

    img = np.ascontiguousarray(img, dtype=np.float32)
    cap = np.ascontiguousarray(cap, dtype=np.float32)
    if img.ndim != 2 or cap.ndim != 2 or img.shape[1] != cap.shape[1]:
        raise ValueError(f"order_violation needs (n, d) and (m, d) arrays, got {img.shape} and {cap.shape}")
    out = np.empty((img.shape[0], cap.shape[0]), dtype=np.float32)
    if out.size == 0:
        return out
    want = threads if threads is not None else torch.get_num_threads()
    n_threads = max(1, min(int(want), numba.config.NUMBA_NUM_THREADS))
    with _run_lock:
        previous = numba.get_num_threads()
        numba.set_num_threads(n_threads)
        try:
            kernel(img, cap, out)
        finally:
            numba.set_num_threads(previous)
    return out
