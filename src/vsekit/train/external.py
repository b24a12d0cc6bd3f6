"""Score a similarity matrix made elsewhere (CLIP, SGRAF's own code...) under vsekit's protocols.

The matrix is a ``.npy`` of shape (images, captions) of one split: row i is the split's i-th image
and column j its j-th caption, both in store order (the order ``vsekit embed`` writes its ids in,
and the order of ``vsekit evaluate``'s own ``sims_<split>.npy`` when every image has features). The
ranks, ties (counted against the query), images with any number of captions, the five sequential
1K folds and the metrics are exactly those of ``train/evaluation.py``, which does the work; the
matrix is memory-mapped and scored block by block. Scores are compared in float32, as for vsekit's
own models; float64 input is rounded to float32 first.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch

from ..storage.store import FeatureStore, StoreError
from .data import EvalSet
from .evaluation import format_table


def load_sims(path: str | Path, n_images: int, n_captions: int, split: str) -> np.ndarray:
    """The memory-mapped matrix, checked against the split's shape; errors say what was expected."""
    path = Path(path)
    if not path.is_file():
        raise StoreError(f"{path}: no such file")
    try:
        sims = np.load(path, mmap_mode="r", allow_pickle=False)
    except (ValueError, OSError) as exc:
        raise StoreError(f"{path}: not a .npy array ({exc})") from None
    want = (n_images, n_captions)
    if sims.ndim != 2 or sims.dtype.kind not in "fiu":
        raise StoreError(f"{path}: expected a 2-D numeric (images x captions) matrix, got shape {sims.shape} "
                         f"dtype {sims.dtype}")
    if sims.shape != want:
        hint = " (it is transposed: save sims.T)" if sims.shape == want[::-1] else ""
        raise StoreError(f"{path}: shape {sims.shape}, but split {split!r} has {n_images} images x "
                         f"{n_captions} captions{hint}; rows are the split's images and columns its "
                         f"captions, in store order")
    return sims


def _check_finite(sims: np.ndarray, path: str | Path, rows: int = 1024) -> None:
    for a in range(0, sims.shape[0], rows):
        block = np.asarray(sims[a:a + rows])
        if block.dtype.kind == "f" and not np.all(np.isfinite(block)):
            i, j = np.argwhere(~np.isfinite(block))[0]
            raise StoreError(f"{path}: non-finite similarity at row {a + i}, column {j}")


def evaluate_sims(sims_path: str | Path, store: str | Path | FeatureStore, *, split: str = "test",
                  protocols: Sequence[str] | None = None, out: str | Path | None = None,
                  progress: bool = False) -> dict[str, Any]:
    """Metrics of every protocol for an external (images x captions) matrix; writes a metrics JSON.

    ``out`` (default: ``<sims stem>_metrics.json`` beside the matrix) receives the same document
    ``vsekit evaluate`` writes, protocol ``warnings`` included. Returns it with the printed ``table``
    added.
    """
    from .evaluate_run import check_protocols, default_protocols, protocol_warnings, run_protocols

    check_protocols(protocols)
    fstore = store if isinstance(store, FeatureStore) else FeatureStore.open(store)
    es = EvalSet.from_store(fstore, split)
    sims = load_sims(sims_path, len(es.rows), len(es.captions), split)
    _check_finite(sims, sims_path)

    def scorer(img_sel, cap_sel) -> torch.Tensor:
        block = np.asarray(sims[img_sel])[:, cap_sel]
        return torch.from_numpy(np.array(block, dtype=np.float32, order="C"))  # a writable copy

    n_img = len(es.rows)
    protocols = list(protocols or default_protocols(fstore, n_img))
    warnings = protocol_warnings(protocols, n_img, split)
    results = run_protocols(scorer, n_img, es.caption_image, protocols, progress)
    label = Path(sims_path).name
    doc = {"sims": str(sims_path), "split": split, "store": str(fstore.path), "n_images": int(len(es.rows)),
           "n_captions": int(len(es.captions)), "dtype": str(sims.dtype), "protocols": results,
           "warnings": warnings}  # saved under the key plain `vsekit evaluate` uses
    out_path = Path(out) if out else Path(sims_path).with_name(Path(sims_path).stem + "_metrics.json")
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(doc, indent=2))
    return {**doc, "table": format_table([(label, p, m) for p, m in results.items()]),
            "metrics_path": str(out_path)}
