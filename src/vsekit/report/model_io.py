"""A trained run's model over its store's test split: load, encode in blocks, score.

The model is rebuilt from the run's ``config.json`` and ``checkpoint_best.pt`` (or the last one)
by ``vsekit.train.checkpoint``, the one module that saves and loads checkpoints. Features and tokens
are read from the store a block of rows at a time, so memory is bounded by the block size, not the
test-set size.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..storage.store import DONE, FeatureStore, StoreError
from ..train.data import Tokens
from .runs import RunInfo


def _first(cfg: dict[str, Any], *keys: str) -> Any:
    """The first of ``keys`` found in ``cfg`` or one level below it (``{"data": {"store": ..}}``)."""
    for key in keys:
        if key in cfg and cfg[key] not in (None, ""):
            return cfg[key]
    for value in cfg.values():
        if isinstance(value, dict):
            for key in keys:
                if key in value and value[key] not in (None, ""):
                    return value[key]
    return None


@dataclass
class SplitData:
    """The rows of one split: image rows in the store, caption rows, and how they relate."""

    store: FeatureStore
    split: str
    image_rows: np.ndarray       # store image rows of the split (sorted)
    caption_rows: np.ndarray     # store caption rows of the split (sorted)
    caption_image: np.ndarray    # local image index of each local caption

    tokens: Any = None           # the store's train.data.Tokens, read once (None: no tokens)

    @classmethod
    def of(cls, store: FeatureStore, split: str, features: str | None = None) -> "SplitData":
        """The split's images (only those whose ``features`` are done, as the evaluator uses) and
        their captions, in store order."""
        image_rows = store.split_rows(split)
        if features and store.has_features(features):
            status = np.asarray(store.features(features).status[:])
            image_rows = image_rows[status[image_rows] == DONE]
        local = np.full(store.n_images, -1, dtype=np.int64)
        local[image_rows] = np.arange(len(image_rows))
        cap_img = local[store.caption_images()]
        caption_rows = np.flatnonzero(cap_img >= 0)
        tokens = Tokens.from_store(store) if store.has_tokens else None
        return cls(store, split, image_rows, caption_rows, cap_img[caption_rows], tokens)

    def caption_texts(self, local: np.ndarray) -> list[str]:
        """Texts of a few local captions (read one contiguous range per caption)."""
        return [str(self.store.caption_text(int(self.caption_rows[j]), int(self.caption_rows[j]) + 1)[0])
                for j in local]

    def image_file(self, local: int) -> Path:
        return self.store.image_file(int(self.image_rows[local]))


def open_store(run: RunInfo, store: str | Path | None = None) -> FeatureStore:
    """The run's store: ``store`` if given, else the path in its config (absolute, or relative to the
    current folder or to the run folder), or the object-store URL either names."""
    from ..storage.objstore import is_object_url

    path = store or _first(run.config, "store", "store_path")
    if not path:
        raise StoreError(f"{run.path}/config.json names no store; pass --store")
    if is_object_url(str(path)):   # s3://... (the run recorded the URL, never its credentials)
        return FeatureStore.open(str(path))
    for cand in (Path(path), run.path / path):
        if (cand / "zarr.json").exists():
            return FeatureStore.open(cand)
    raise StoreError(f"store {path} of run {run.path} is not on disk; pass --store")


def features_name(run: RunInfo) -> str | None:
    name = _first(run.config, "features", "feature_set", "features_name")
    return name if isinstance(name, str) else None


def load_model(run: RunInfo, device: str = "cpu"):
    """The run's trained model in eval mode, loaded through ``vsekit.train.checkpoint``.

    A run written by the trainer (``config.json`` with a ``train`` section) is rebuilt by
    ``checkpoint.load_model``; any other run folder through the model registry, with the config's
    ``model`` and ``model_kwargs`` and the checkpoint's ``model`` state dict (``checkpoint.load_file``).
    """
    from ..train import checkpoint

    ckpt = run.checkpoint
    if ckpt is None:
        raise StoreError(f"{run.path} has no checkpoint_best.pt or checkpoint_last.pt")
    if isinstance(run.config.get("train"), dict):
        model, _ = checkpoint.load_model(run.path, device)
        return model.eval()
    from ..models import create_model

    kwargs = _first(run.config, "model_kwargs", "model_args") or {}
    model = create_model(run.model_name, **kwargs)
    state = checkpoint.load_file(ckpt, device)
    if isinstance(state, dict) and isinstance(state.get("model"), dict):
        state = state["model"]
    model.load_state_dict(state)
    return model.to(device).eval()


def read_features(store: FeatureStore, name: str, rows: np.ndarray):
    """Image features of store ``rows`` (sorted) as float32 tensors ``(feats, counts or None)``.

    Rows are decoded as the trainer feeds them (FNE int8 → float, 2-bit packed → unpacked), with
    one read of the covering row range (callers pass a block of nearby rows).
    """
    from ..train.data import FeatureSource

    rows = np.asarray(rows, dtype=np.int64)
    lo, hi = int(rows.min()), int(rows.max()) + 1
    data, counts = FeatureSource(store.features(name)).read(lo, hi)
    data = np.ascontiguousarray(data[rows - lo], dtype=np.float32)
    return torch.from_numpy(data), None if counts is None else torch.from_numpy(counts[rows - lo])


def read_tokens(store: FeatureStore, caption_rows: np.ndarray, tokens: Any = None):
    """Padded token ids (B, L) int64 and true lengths (B,) of store ``caption_rows``, as the trainer
    batches them (``tokens``: the store's :class:`~vsekit.train.data.Tokens`, if already read)."""
    return (tokens or Tokens.from_store(store)).batch(caption_rows)


class ModelSource:
    """Scores of a split computed by the run's model, one block of the other side at a time."""

    def __init__(self, model, data: SplitData, features: str, *, device: str = "cpu", block: int = 256):
        self.model, self.data, self.features = model, data, features
        self.device, self.block = device, int(block)
        self.n_images = len(data.image_rows)
        self.n_captions = len(data.caption_rows)
        self.label = "the run's model (best checkpoint)"

    def encode_images(self, local: np.ndarray):
        feats, counts = read_features(self.data.store, self.features, self.data.image_rows[local])
        with torch.no_grad():
            return self.model.encode_images(feats.to(self.device),
                                            None if counts is None else counts.to(self.device))

    def encode_captions(self, local: np.ndarray):
        tokens, lengths = read_tokens(self.data.store, self.data.caption_rows[local], self.data.tokens)
        with torch.no_grad():
            return self.model.encode_captions(tokens.to(self.device), lengths.to(self.device))

    def _score(self, img, cap) -> np.ndarray:
        with torch.no_grad():
            return self.model.score(img, cap).float().cpu().numpy().astype(np.float64)

    def _blocks(self, n: int):
        return (np.arange(s, min(s + self.block, n)) for s in range(0, n, self.block))

    def caption_columns(self, caps: np.ndarray) -> np.ndarray:
        cap = self.encode_captions(np.asarray(caps))
        return np.concatenate([self._score(self.encode_images(idx), cap) for idx in self._blocks(self.n_images)])

    def image_rows(self, imgs: np.ndarray) -> np.ndarray:
        img = self.encode_images(np.asarray(imgs))
        return np.concatenate([self._score(img, self.encode_captions(idx)) for idx in self._blocks(self.n_captions)],
                              axis=1)
