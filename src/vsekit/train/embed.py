"""``vsekit embed``: a trained run's joint-space embeddings of one split, for faiss and other tools.

Embedding models (VSE++/UVS, Order, SEAM; Faghri et al., Vendrov et al., Wehrmann et al.) score a pair
by a function of its two vectors alone, so the vectors are the model's output; they are written batch
by batch, checked first to reproduce the model's own scores. Pairwise models (SMAN, SAF, SGR) have no
such vectors and are refused with the reason. The files and their order: docs/store.md, "vsekit embed".
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..storage.store import FeatureStore
from .data import EvalSet, Tokens, image_batches, open_features
from ..models.losses import similarity as similarity_fn
from .scoring import take


def _vectors(enc: Any) -> torch.Tensor:
    """The joint-space vectors of an embedding model's encoding (SEAM captions: (vector, penalty))."""
    return enc[0] if isinstance(enc, (tuple, list)) else enc


def check_embeddable(model, name: str) -> str:
    """The similarity of an embedding model, or a ValueError saying why this model has no vectors."""
    from ..models.vse import EmbeddingModel

    if not getattr(model, "pairwise", False) and not isinstance(model, EmbeddingModel):
        raise ValueError(f"model {name!r} does not expose joint-space vectors to export; embed works for the "
                         f"embedding models (vse, order, seam-e/c/g); use `vsekit evaluate RUN --save-sims` "
                         f"for its similarity matrix")
    if not isinstance(model, EmbeddingModel):
        raise ValueError(f"model {name!r} has no independent image and caption embeddings: its similarity is "
                         f"computed jointly for every image-caption pair (cross attention or alignment between "
                         f"words and regions/cells, as in SMAN, SAF and SGR), so there is no vector per image "
                         f"or caption to export; use `vsekit evaluate RUN --save-sims` for its similarity matrix")
    return str(model.similarity)


def _check_scores(model, img: torch.Tensor, cap_enc: Any, similarity: str) -> None:
    """The model's score on a block must equal the exported vectors' similarity."""
    cap = _vectors(cap_enc)
    k_i, k_c = min(16, len(img)), min(16, len(cap))
    want = model.score(img[:k_i], take(cap_enc, slice(0, k_c))).float()
    got = similarity_fn(similarity)(img[:k_i], cap[:k_c]).float()
    if not torch.allclose(want, got, rtol=1e-4, atol=1e-5):
        raise ValueError(f"the exported vectors do not reproduce the model's scores (max difference "
                         f"{float((want - got).abs().max()):.3g}); this model cannot be exported as embeddings")


@torch.no_grad()
def embed(run: str | Path, out: str | Path, *, split: str = "test", store: str | Path | None = None,
          features: str | None = None, checkpoint: str = "best", device: str = "cpu",
          batch_size: int = 256) -> dict[str, Any]:
    """Write the embeddings of ``split`` of the run's store (or ``store``) into the folder ``out``."""
    from .checkpoint import load_model

    model, config = load_model(run, device, checkpoint)
    name = config["train"]["model"]
    similarity = check_embeddable(model, name)
    fstore = FeatureStore.open(store or config["store"])
    tokens = Tokens.from_store(fstore)
    if tokens.vocab_size != config.get("vocab_size", tokens.vocab_size):
        raise ValueError(f"{fstore.path} has a vocabulary of {tokens.vocab_size} words but the run was trained "
                         f"with {config['vocab_size']}; re-tokenize with the training vocabulary")
    source = open_features(fstore, features or config["features"], fstore.split_rows(split))
    es = EvalSet.from_store(fstore, split, source)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    img_out = cap_out = None
    pos = 0
    for feats, counts in image_batches(source, es.rows, batch_size):
        img = _vectors(model.encode_images(feats.to(device), None if counts is None else counts.to(device)))
        if img_out is None:
            img_out = np.lib.format.open_memmap(out / "images.npy", mode="w+", dtype=np.float32,
                                                shape=(len(es.rows), img.shape[1]))
            toks, lengths = tokens.batch(es.captions[:16])
            _check_scores(model, img, model.encode_captions(toks.to(device), lengths.to(device)), similarity)
        img_out[pos:pos + len(img)] = img.float().cpu().numpy()
        pos += len(img)
    for s in range(0, len(es.captions), batch_size):
        toks, lengths = tokens.batch(es.captions[s:s + batch_size])
        cap = _vectors(model.encode_captions(toks.to(device), lengths.to(device)))
        if cap_out is None:
            cap_out = np.lib.format.open_memmap(out / "captions.npy", mode="w+", dtype=np.float32,
                                                shape=(len(es.captions), cap.shape[1]))
        cap_out[s:s + len(cap)] = cap.float().cpu().numpy()
    img_out.flush()
    cap_out.flush()
    ids = fstore.image_ids()
    tables = _write_tables(out, {
        "images": {"index": np.arange(len(es.rows)), "image_id": [str(ids[r]) for r in es.rows],
                   "store_row": es.rows},
        "captions": {"index": np.arange(len(es.captions)), "caption_row": es.captions,
                     "image_index": es.caption_image, "image_id": [str(ids[es.rows[i]]) for i in es.caption_image],
                     "text": [str(t) for t in fstore.caption_text()[es.captions]]},
    })
    doc = {"run": str(run), "checkpoint": config["checkpoint"], "model": name, "split": split,
           "store": str(fstore.path), "features": features or config["features"], "similarity": similarity,
           "n_images": int(len(es.rows)), "n_captions": int(len(es.captions)), "dim": int(img_out.shape[1]),
           "files": ["images.npy", "captions.npy", *tables],
           "search": ("L2-normalised vectors: inner product = the model's cosine score (faiss IndexFlatIP)"
                      if similarity == "cosine" else
                      f"order embeddings: score(i, c) = {ORDER_SCORES.get(similarity, similarity)}, not an inner "
                      "product or L2 distance; score candidates with that formula")}
    (out / "embed.json").write_text(json.dumps(doc, indent=2))
    return doc


ORDER_SCORES = {"order": "-||max(0, c - i)||^2", "order-norm": "-||max(0, c - i)||"}


def _write_tables(out: Path, tables: dict[str, dict[str, Any]]) -> list[str]:
    """Parquet files when pyarrow is installed (the ``formats`` extra), else tab-separated text."""
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        pa = None
    names = []
    for name, cols in tables.items():
        if pa is not None:
            pq.write_table(pa.table({k: np.asarray(v) if not isinstance(v, list) else v
                                     for k, v in cols.items()}), out / f"{name}.parquet")
            names.append(f"{name}.parquet")
            continue
        keys = list(cols)
        with open(out / f"{name}.tsv", "w", encoding="utf-8") as f:
            f.write("\t".join(keys) + "\n")
            for row in zip(*(cols[k] for k in keys)):
                f.write("\t".join(" ".join(str(v).split()) for v in row) + "\n")
        names.append(f"{name}.tsv")
    return names
