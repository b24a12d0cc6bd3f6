"""Per-feature mean and population standard deviation, merged across row blocks stably.

Implements the z-standardisation statistics of the Full-Network Embedding (Garcia-Gasulla et al.,
"An out-of-the-box full-network embedding for convolutional neural networks", 2018, §3: "feature
standardization", z = (x − μ) / σ with μ, σ over the training images; used by Vilalta et al. in the
multimodal pipeline). Each block is summarised by (n, mean, M2) computed with two passes in float64;
blocks are combined with the parallel update of Chan, Golub & LeVeque (1979):

    n = n_a + n_b,  δ = mean_b − mean_a,  mean = mean_a + δ·n_b/n,  M2 = M2_a + M2_b + δ²·n_a·n_b/n

so no E[x²] − E[x]² cancellation occurs. σ = sqrt(M2 / n) (population, ddof = 0).

A block state is a (4, D) float64 array: rows n, mean, M2 and the number of non-finite values per
column among the rows that are checked (so NaN/inf refusal costs no extra pass over the data).
"""

from __future__ import annotations

import numpy as np

#: Bits of the per-row code array that the state function reads.
CHECK, USE = 1, 2
N, MEAN, M2, BAD = 0, 1, 2, 3
STATE_ROWS = 4
#: Rows processed at a time inside a block, so float64 temporaries stay in the CPU cache.
SUB_ROWS = 32


def block_state(x: np.ndarray, codes: np.ndarray) -> np.ndarray:
    """The (4, D) state of one row block ``x`` (rows, D).

    ``codes`` (rows,) or (rows, 1) uint8: bit ``USE`` marks rows that enter the statistics, bit
    ``CHECK`` rows whose values must be finite.
    """
    x = np.asarray(x)
    codes = np.asarray(codes).reshape(-1)
    state = np.zeros((STATE_ROWS, x.shape[1]), dtype=np.float64)
    if x.shape[0] == 0:
        return state
    check = (codes & CHECK).astype(bool)
    if check.any():
        bad = ~np.isfinite(x if check.all() else x[check])
        if bad.any():
            state[BAD] = bad.sum(axis=0)
    use = (codes & USE).astype(bool)
    n = int(use.sum())
    if n:
        xs = x if n == len(use) else x[use]
        mean = xs.mean(axis=0, dtype=np.float64)
        m2 = np.zeros(x.shape[1], np.float64)
        # second pass a few rows at a time, so the float64 deviations stay in cache
        buf = np.empty((min(SUB_ROWS, n), x.shape[1]), np.float64)
        for i in range(0, n, SUB_ROWS):
            b = buf[:len(xs[i:i + SUB_ROWS])]
            np.subtract(xs[i:i + SUB_ROWS], mean, out=b)
            np.square(b, out=b)
            m2 += b.sum(axis=0)
        state[N] = n
        state[MEAN] = mean
        state[M2] = m2
    return state


def merge(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Chan et al.'s pairwise combination of two block states."""
    na, nb = a[N], b[N]
    n = na + nb
    out = np.empty_like(a)
    out[N] = n
    out[BAD] = a[BAD] + b[BAD]
    with np.errstate(invalid="ignore", divide="ignore"):
        delta = b[MEAN] - a[MEAN]
        frac = np.where(n > 0, nb / np.where(n > 0, n, 1), 0.0)
        out[MEAN] = a[MEAN] + delta * frac
        out[M2] = a[M2] + b[M2] + np.square(delta) * na * frac
    return out


def merge_stacked(states: np.ndarray, axis=None, keepdims=None) -> np.ndarray:
    """Fold a (4k, D) stack of states, left to right (a fixed order, so results are reproducible).

    Signature fits ``dask.array.reduction``'s ``combine``/``aggregate``.
    """
    states = np.asarray(states, dtype=np.float64)
    if states.size == 0:  # dask's meta inference
        return np.zeros((STATE_ROWS, states.shape[-1] if states.ndim == 2 else 0))
    parts = states.reshape(-1, STATE_ROWS, states.shape[-1])
    acc = parts[0]
    for part in parts[1:]:
        acc = merge(acc, part)
    return acc


def finalize(state: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(mean, std, count)`` from a merged state: population std, float64."""
    count = state[N].astype(np.int64)
    mean = state[MEAN].copy()
    std = np.sqrt(np.maximum(state[M2], 0.0) / np.maximum(count, 1))
    return mean, std, count


#: Bytes of float64 per statistics block (tests lower it to exercise many-block merges).
CANONICAL_BYTES = 8 << 20


def canonical_rows(width: int, target_bytes: int | None = None) -> int:
    """Rows per statistics block, a function of the width only.

    The reduction always runs over blocks of this many rows, whatever the store's chunking, so the
    merge tree and therefore the floating-point result are identical for every chunking.
    """
    target = CANONICAL_BYTES if target_bytes is None else target_bytes
    return int(min(4096, max(1, target // max(1, 8 * width))))
