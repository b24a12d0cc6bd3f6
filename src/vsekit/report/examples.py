"""Retrieval examples from the test split: sampled queries and their top-k, scored in blocks.

Only the sampled queries are scored, against every item of the other side, one block at a time:
for n sampled captions that is an (N_images, n) matrix, never the full (N_images, N_captions)
one, so a COCO-5K test set costs a few encoder passes, not 125M scores held at once.

Ordering is by score descending, ties broken by the lower index (as a stable sort of ``-S``).
Ranks are 1-based: ``1 + #{items scoring strictly higher than the correct one}``; a correct item's
*position* is its place in that ordering (ties put it behind the lower indices), which is where the
page shows it when it is not among the top k.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import numpy as np


class ScoreSource(Protocol):
    """Similarities of the split's images (rows) and captions (columns), local indices."""

    n_images: int
    n_captions: int
    label: str

    def caption_columns(self, caps: np.ndarray) -> np.ndarray:
        """Scores of every image against captions ``caps``: (n_images, len(caps))."""

    def image_rows(self, imgs: np.ndarray) -> np.ndarray:
        """Scores of images ``imgs`` against every caption: (len(imgs), n_captions)."""


class SimsFileSource:
    """A saved similarity matrix (``sims_<split>.npy``, images × captions), read through a memory map."""

    def __init__(self, path: str | Path, block: int = 4096):
        self.path = Path(path)
        self.sims = np.load(self.path, mmap_mode="r")
        if self.sims.ndim != 2:
            raise ValueError(f"{self.path} is not a 2-D similarity matrix (shape {self.sims.shape})")
        self.n_images, self.n_captions = (int(s) for s in self.sims.shape)
        self.block = block
        self.label = f"saved similarities ({self.path.name})"

    def caption_columns(self, caps: np.ndarray) -> np.ndarray:
        out = np.empty((self.n_images, len(caps)), dtype=np.float64)
        for s in range(0, self.n_images, self.block):
            out[s:s + self.block] = self.sims[s:s + self.block][:, caps]
        return out

    def image_rows(self, imgs: np.ndarray) -> np.ndarray:
        return np.asarray(self.sims[np.asarray(imgs)], dtype=np.float64)


def top_k(scores: np.ndarray, k: int) -> np.ndarray:
    """Indices of the ``k`` best scores of each row, best first, ties to the lower index (a stable sort
    of ``-scores``; the rows are the few sampled queries)."""
    return np.argsort(-np.asarray(scores), axis=1, kind="stable")[:, :k]


@dataclass
class CaptionExample:
    caption: int                 # local caption index in the split
    text: str
    image: int                   # local index of its image
    top: list[int]               # local image indices, best first
    top_scores: list[float]
    rank: int                    # rank of the correct image
    position: int = 0            # its place in the ordering (> rank when tied with lower indices)


@dataclass
class ImageExample:
    image: int                   # local image index in the split
    top: list[int]               # local caption indices, best first
    top_scores: list[float]
    matches: list[bool]          # whether each top caption belongs to the image
    rank: int                    # rank of its best-ranked caption
    n_captions: int              # how many captions the image has
    correct: int | None = None   # its best-ranked own caption (local index), None if it has none
    correct_score: float | None = None
    correct_position: int = 0    # its place in the ordering


def position(row: np.ndarray, j: int) -> int:
    """1-based place of item ``j`` when ``row`` is ordered by score, ties to the lower index."""
    return 1 + int(np.sum(row > row[j])) + int(np.sum(row[:j] == row[j]))


@dataclass
class Examples:
    source: str
    captions: list[CaptionExample] = field(default_factory=list)
    images: list[ImageExample] = field(default_factory=list)


def sample(n_total: int, n: int, seed: int) -> np.ndarray:
    """A sorted, seeded sample of ``n`` of ``range(n_total)``."""
    n = max(0, min(int(n), n_total))
    return np.sort(np.random.default_rng(seed).choice(n_total, size=n, replace=False)) if n else \
        np.empty(0, dtype=np.int64)


def retrieval_examples(src: ScoreSource, caption_image: np.ndarray, caption_text, *,
                       n_captions: int = 8, n_images: int = 6, k: int = 5, seed: int = 0) -> Examples:
    """Top-k images for a sample of captions and top-k captions for a sample of images.

    ``caption_image[j]`` is the local image index of local caption ``j``; ``caption_text[j]`` its text.
    """
    caption_image = np.asarray(caption_image)
    if len(caption_image) != src.n_captions:
        raise ValueError(f"{src.label}: {src.n_captions} captions, but the split has {len(caption_image)}")
    ex = Examples(source=src.label)
    caps = sample(src.n_captions, n_captions, seed)
    if len(caps):
        cols = src.caption_columns(caps).T  # (n, n_images)
        for j, c, row, best in zip(range(len(caps)), caps, cols, top_k(cols, k)):
            g = int(caption_image[c])
            ex.captions.append(CaptionExample(
                caption=int(c), text=str(caption_text[c]), image=g, top=[int(i) for i in best],
                top_scores=[float(row[i]) for i in best], rank=1 + int(np.sum(row > row[g])),
                position=position(row, g)))
    imgs = sample(src.n_images, n_images, seed + 1)
    if len(imgs):
        rows = src.image_rows(imgs)  # (n, n_captions)
        for g, row, best in zip(imgs, rows, top_k(rows, k)):
            own = np.flatnonzero(caption_image == g)
            # its best own caption, ties to the lower index (the order of the top-k list)
            correct = int(own[np.argmax(row[own])]) if len(own) else None
            rank = 1 + int(np.sum(row > row[correct])) if len(own) else 0
            ex.images.append(ImageExample(
                image=int(g), top=[int(i) for i in best], top_scores=[float(row[i]) for i in best],
                matches=[bool(caption_image[i] == g) for i in best], rank=rank, n_captions=len(own),
                correct=correct, correct_score=None if correct is None else float(row[correct]),
                correct_position=0 if correct is None else position(row, correct)))
    return ex
