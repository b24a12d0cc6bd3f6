"""``evaluate``: load training runs (``checkpoint.load_model``), score the test split block by block,
print and save the metrics.

Several runs are evaluated as one model whose similarities are the mean of theirs (SGRAF = a SAF run
+ an SGR run); they must use the same store and split.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch

from ..storage.objstore import store_ref
from ..storage.store import FeatureStore
from .checkpoint import load_model
from ..storage.splits import resplit_since
from .data import EvalSet, Tokens, failed_note, open_features
from .evaluation import PROTOCOLS, evaluate_protocol, format_table
from .scoring import EnsembleScorer, encode_set, save_sims

SMALL_SIMS = 4_000_000  # sims_<split>.npy is written by default up to this many entries


# "all": every image of the split at once, labelled as such whatever the split's size
ALL_PROTOCOLS = (*PROTOCOLS, "all")
# the split size each protocol is defined on (COCO: 5000 test images; Flickr30K: 1000)
PROTOCOL_IMAGES = {"coco-1k": 5000, "coco-5k": 5000, "1k": 1000}


def default_protocols(store: FeatureStore, n_images: int) -> list[str]:
    """COCO's two protocols on a 5000-image COCO split, ``1k`` on a 1000-image split, else ``all``.

    A protocol's name is a claim about the test set; a 50-image demo split labelled "1k" would make
    its figures look comparable to the papers' when they are not.
    """
    if "coco" in store.dataset.lower() and n_images == 5000:
        return ["coco-1k", "coco-5k"]
    return ["1k"] if n_images == 1000 else ["all"]


def protocol_warnings(protocols: Sequence[str], n_images: int, split: str) -> list[str]:
    """A warning for each protocol asked for on a split of another size than it is defined on."""
    out = []
    for p in protocols:
        want = PROTOCOL_IMAGES.get(p)
        if want is not None and n_images != want:
            out.append(f"--protocol {p} is defined on a {want}-image test split, but split {split!r} has "
                       f"{n_images} usable images: its figures are not comparable to the papers' "
                       f"(use --protocol all to label them as what they are)")
    return out


def check_protocols(protocols: Sequence[str] | None) -> None:
    for p in protocols or ():
        if p not in ALL_PROTOCOLS:
            raise ValueError(f"unknown protocol {p!r}; valid choices: {', '.join(ALL_PROTOCOLS)}")


def run_protocols(scorer, n_img: int, cap_image: np.ndarray, protocols: Sequence[str], progress: bool) -> dict:
    """The metrics of each protocol; ``all`` is the whole split in one fold, as ``1k`` computes it."""
    with torch.no_grad():
        return {p: evaluate_protocol(scorer, n_img, cap_image, "1k" if p == "all" else p, progress=progress)
                for p in protocols}


def evaluate(runs: Sequence[str | Path], *, protocols: Sequence[str] | None = None, split: str = "test",
             store: str | Path | None = None, features: str | None = None, device: str = "cpu",
             batch_size: int = 256, save: bool | None = None, out: str | Path | None = None,
             progress: bool = True, checkpoint: str = "best") -> dict[str, Any]:
    """Evaluate one run, or the similarity average of several, on ``split``; writes ``metrics.json``.

    Returns ``{"runs", "split", "protocols": {name: metrics}, "table", "metrics_path"}``. ``store`` /
    ``features`` override the run's own (to evaluate on another store with the same vocabulary).
    """
    if not runs:
        raise ValueError("evaluate needs at least one run folder")
    check_protocols(protocols)
    models, configs = zip(*(load_model(r, device, checkpoint) for r in runs))
    store_path = store_ref(store or configs[0]["store"])
    for r, c in zip(runs, configs):
        if store is None and store_ref(c["store"]) != store_path:
            raise ValueError(f"runs use different stores ({c['store']} for {r} vs {store_path}); "
                             f"an ensemble must be evaluated on one store")
    fstore = FeatureStore.open(store_path)
    tokens = Tokens.from_store(fstore)
    encodings, evalset = [], None
    for model, cfg in zip(models, configs):
        name = features or cfg["features"]
        source = open_features(fstore, name, fstore.split_rows(split))
        es = EvalSet.from_store(fstore, split, source)
        if evalset is not None and (not np.array_equal(es.rows, evalset.rows)):
            raise ValueError("the runs' feature sets have different usable test images; cannot average them")
        evalset = es
        if tokens.vocab_size != cfg.get("vocab_size", tokens.vocab_size):
            raise ValueError(f"{store_path} has a vocabulary of {tokens.vocab_size} words but the run was "
                             f"trained with {cfg['vocab_size']}; re-tokenize with the training vocabulary")
        encodings.append(encode_set(model, source, tokens, es, batch_size=batch_size, device=device))
    scorer = EnsembleScorer(models, encodings)
    n_img, n_cap = len(evalset.rows), len(evalset.captions)
    cap_image = evalset.caption_image
    protocols = list(protocols or default_protocols(fstore, n_img))
    warnings = protocol_warnings(protocols, n_img, split) + [w for w in [failed_note(fstore, source, split),
                                                                       *(resplit_since(fstore, r) for r in runs)] if w]
    results = run_protocols(scorer, n_img, cap_image, protocols, progress)
    label = " + ".join(Path(r).name for r in runs)
    table = format_table([(label, p, m) for p, m in results.items()])
    out_dir = Path(out) if out else Path(runs[0])
    out_dir.mkdir(parents=True, exist_ok=True)
    metrics_path = out_dir / ("metrics.json" if len(runs) == 1 or out else "metrics_ensemble.json")
    doc = {"runs": [str(r) for r in runs], "split": split, "store": str(store_path),
           "n_images": n_img, "n_captions": n_cap,
           "checkpoints": [c["checkpoint"] for c in configs], "protocols": results, "warnings": warnings}
    if save or (save is None and n_img * n_cap <= SMALL_SIMS):
        sims_path = out_dir / f"sims_{split}.npy"
        save_sims(scorer, n_img, n_cap, str(sims_path))
        np.save(out_dir / f"sims_{split}_caption_image.npy", cap_image)
        doc["sims"] = str(sims_path)
    metrics_path.write_text(json.dumps(doc, indent=2))
    return {**doc, "table": table, "metrics_path": str(metrics_path), "warnings": warnings}
