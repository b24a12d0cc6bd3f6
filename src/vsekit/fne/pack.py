"""2-bit packing of ternary FNE features: four values in {-1, 0, 1} per byte.

Feature ``j`` lives in byte ``j // 4`` at bits ``2·(j % 4)`` and ``2·(j % 4) + 1`` (least
significant first), as a 2-bit two's-complement code: 0 → 0b00, 1 → 0b01, −1 → 0b11. An all-zero
byte is four zeros, so the store's fill value means "0" and padding at the end of a row is harmless.
``unpack`` (numpy) and ``unpack_torch`` (batches on any device) are what readers, the trainer
included, use to get the int8 array back.
"""

from __future__ import annotations

from typing import Any

import numpy as np

SHIFTS = (0, 2, 4, 6)


def packed_width(n_features: int) -> int:
    """Bytes per row for ``n_features`` ternary values."""
    return (int(n_features) + 3) // 4


def pack(values: np.ndarray) -> np.ndarray:
    """Pack int values in {-1, 0, 1} along the last axis: (..., D) → (..., ceil(D/4)) uint8."""
    v = np.asarray(values)
    if v.size and (v.min() < -1 or v.max() > 1):
        bad = np.argwhere((v < -1) | (v > 1))[0]
        raise ValueError(f"pack: value {v[tuple(bad)]} at index {tuple(int(i) for i in bad)} "
                         f"is not in {{-1, 0, 1}}")
    d = v.shape[-1]
    codes = v.astype(np.int8).view(np.uint8) & np.uint8(3)
    pad = packed_width(d) * 4 - d
    if pad:
        codes = np.concatenate([codes, np.zeros((*codes.shape[:-1], pad), np.uint8)], axis=-1)
    codes = codes.reshape(*codes.shape[:-1], -1, 4)
    return np.bitwise_or.reduce(codes << np.asarray(SHIFTS, np.uint8), axis=-1)


def _decode_table() -> np.ndarray:
    """(256, 4) int8: the four values each byte holds (2-bit two's complement: 0b11 → −1)."""
    codes = (np.arange(256, dtype=np.uint8)[:, None] >> np.asarray(SHIFTS, np.uint8)) & np.uint8(3)
    vals = codes.astype(np.int8)
    return vals - ((vals & np.int8(2)) << np.int8(1))


_TABLE = _decode_table()
_WORDS = np.ascontiguousarray(_TABLE).view(np.uint32).reshape(256)


def unpack(packed: np.ndarray, n_features: int | None = None) -> np.ndarray:
    """Inverse of :func:`pack`: (..., W) uint8 → (..., n_features) int8 (default ``4·W``)."""
    p = np.asarray(packed)
    if p.dtype != np.uint8:
        raise ValueError(f"unpack expects uint8 packed bytes, got {p.dtype}")
    n = _features("unpack", p.shape[-1], n_features)
    # gather whole 4-byte words (one per packed byte), then read them back as int8
    return _WORDS[p].view(np.int8).reshape(*p.shape[:-1], 4 * p.shape[-1])[..., :n]


def _features(who: str, width: int, n_features: int | None) -> int:
    """The features ``width`` packed bytes per row hold (``n_features``, checked; default all ``4 width``)."""
    n = 4 * width if n_features is None else int(n_features)
    if not 0 <= n <= 4 * width or (n_features is not None and packed_width(n) != width):
        raise ValueError(f"{who}: n_features={n_features} does not fit {width} packed bytes per row")
    return n


def unpack_torch(packed: Any, n_features: int | None = None, dtype: Any = None) -> Any:
    """:func:`unpack` for a torch uint8 tensor (a batch, on its own device); returns int8 or ``dtype``."""
    import torch

    if packed.dtype != torch.uint8:
        raise ValueError(f"unpack_torch expects a uint8 tensor, got {packed.dtype}")
    n = _features("unpack_torch", packed.shape[-1], n_features)
    vals = torch.as_tensor(_TABLE, device=packed.device)[packed.long()]   # (..., W, 4): each byte's values
    vals = vals.reshape(*packed.shape[:-1], 4 * packed.shape[-1])[..., :n]
    return vals if dtype is None else vals.to(dtype)


def features_of(attrs: dict, stored_width: int) -> int:
    """Number of features a set's rows hold: ``n_features`` for packed sets, else the stored width."""
    return int(attrs["n_features"]) if attrs.get("packed") else int(stored_width)
