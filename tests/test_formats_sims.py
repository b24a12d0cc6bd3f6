"""`vsekit evaluate --sims`: an external similarity matrix under vsekit's protocols, checked against
an independent argsort ranking (the VSE++ evaluation loop, re-implemented) and hand-computed ties."""

from __future__ import annotations

import json

import numpy as np
import pytest
from click.testing import CliRunner

from vsekit.cli import main
from vsekit.storage import FeatureStore
from vsekit.train.external import evaluate_sims


def _store(path, caps_per_image, dataset="coco", extra_train=3):
    """Test images with the given caption counts, interleaved with a few train images."""
    n_test = len(caps_per_image)
    splits = ["train"] * extra_train + ["test"] * n_test
    order = np.random.default_rng(3).permutation(len(splits))
    splits = [splits[i] for i in order]
    test_rows = [r for r, s in enumerate(splits) if s == "test"]
    owners = []
    for r, s in enumerate(splits):
        k = caps_per_image[test_rows.index(r)] if s == "test" else 5
        owners += [r] * k
    owners = np.random.default_rng(4).permutation(owners)  # captions not grouped by image
    with FeatureStore.building(path, dataset=dataset) as store:
        store.write_images([f"i{r}" for r in range(len(splits))], [""] * len(splits), splits)
        store.write_captions([f"c{m}" for m in range(len(owners))], owners)
    cap_rows = [m for m in range(len(owners)) if splits[owners[m]] == "test"]
    cap_image = np.array([test_rows.index(owners[m]) for m in cap_rows])
    return store, cap_image


def _numpy_metrics(sims, cap_image):
    """Independent reference: argsort positions, as VSE++'s i2t/t2i loops (no ties in the input)."""
    n_img, n_cap = sims.shape
    i2t = np.array([min(int(np.where(np.argsort(-sims[i]) == c)[0][0]) for c in np.flatnonzero(cap_image == i))
                    for i in range(n_img)])
    t2i = np.array([int(np.where(np.argsort(-sims[:, c]) == cap_image[c])[0][0]) for c in range(n_cap)])
    out = {}
    for d, r in (("i2t", i2t), ("t2i", t2i)):
        for k in (1, 5, 10):
            out[f"{d}_r{k}"] = 100.0 * np.mean(r < k)
        out[f"{d}_medr"] = np.floor(np.median(r)) + 1
        out[f"{d}_meanr"] = r.mean() + 1
    return out


def test_sims_match_independent_ranking_uneven_captions_and_folds(tmp_path):
    caps = [5, 4, 6, 5, 1, 5, 7, 5, 3, 5]  # images with != 5 captions
    store, cap_image = _store(tmp_path / "s.zarr", caps)
    rng = np.random.default_rng(0)
    sims = rng.normal(size=(len(caps), len(cap_image))).astype(np.float32)
    sims[cap_image, np.arange(len(cap_image))] += 1.0  # a weakly informative model
    np.save(tmp_path / "clip_sims.npy", sims)
    r = CliRunner().invoke(main, ["evaluate", "--sims", str(tmp_path / "clip_sims.npy"), "--store",
                                  str(store.path), "--split", "test", "--no-progress",
                                  "--protocol", "coco-1k", "--protocol", "coco-5k"])
    assert r.exit_code == 0, r.output
    assert "defined on a 5000-image test split" in r.output  # a 10-image split is not COCO 5K
    doc = json.loads((tmp_path / "clip_sims_metrics.json").read_text())
    assert set(doc["protocols"]) == {"coco-1k", "coco-5k"}
    ref = _numpy_metrics(sims.astype(np.float64), cap_image)
    for key, value in ref.items():
        assert doc["protocols"]["coco-5k"][key] == pytest.approx(value), key
    # coco-1k: five sequential folds of the images, metrics averaged
    folds = np.array_split(np.arange(len(caps)), 5)
    per_fold = []
    for f in folds:
        cols = np.flatnonzero(np.isin(cap_image, f))
        local = np.searchsorted(f, cap_image[cols])
        per_fold.append(_numpy_metrics(sims[np.ix_(f, cols)].astype(np.float64), local))
    for key in ref:
        assert doc["protocols"]["coco-1k"][key] == pytest.approx(np.mean([m[key] for m in per_fold])), key


def test_ties_count_against_the_query(tmp_path):
    store, cap_image = _store(tmp_path / "s.zarr", [1, 1, 1], dataset="flickr")
    sims = np.zeros((3, 3), dtype=np.float64)  # a constant scorer: every match ties with 2 others
    sims[0, np.flatnonzero(cap_image == 0)] = 1.0  # image 0's caption strictly best everywhere
    np.save(tmp_path / "s.npy", sims)
    res = evaluate_sims(tmp_path / "s.npy", store, out=tmp_path / "m.json")
    m = res["protocols"]["all"]  # a 3-image split is labelled as what it is
    # hand count: i2t ranks: image 0 -> 0; images 1, 2 -> 2 (two non-matching scores tie at 0)
    assert m["i2t_r1"] == pytest.approx(100 / 3) and m["i2t_meanr"] == pytest.approx(1 + 4 / 3)
    # t2i: image 0's caption ranks image 0 first; another caption's column is all zeros: rank 2
    assert m["t2i_r1"] == pytest.approx(100 / 3) and m["t2i_medr"] == 3.0


def test_sims_refusals(tmp_path):
    store, cap_image = _store(tmp_path / "s.zarr", [5, 5])
    run = CliRunner().invoke
    np.save(tmp_path / "t.npy", np.zeros((len(cap_image), 2), np.float32))
    r = run(main, ["evaluate", "--sims", str(tmp_path / "t.npy"), "--store", str(store.path)])
    assert r.exit_code == 1 and "it is transposed" in r.output and "Traceback" not in r.output
    bad = np.zeros((2, len(cap_image)), np.float32)
    bad[1, 3] = np.nan
    np.save(tmp_path / "n.npy", bad)
    r = run(main, ["evaluate", "--sims", str(tmp_path / "n.npy"), "--store", str(store.path)])
    assert r.exit_code == 1 and "non-finite similarity at row 1, column 3" in r.output
    r = run(main, ["evaluate", "--sims", str(tmp_path / "n.npy")])
    assert r.exit_code == 1 and "--store" in r.output
