"""`vsekit embed` (joint-space vectors of a run) and `train --tensorboard` (curves as events)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from vsekit.cli import main
from vsekit.train import train

torch.set_num_threads(1)
FAST = dict(presets=["demo"], progress=False, embed_dim=16, word_dim=8, batch_size=32, epochs=1)


# end to end (CLI runs, extraction, training, subprocesses): in `make test`, not in `make test-fast`
pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def store_path(tmp_path_factory):
    from vsekit.storage.demo import make_demo_data
    from vsekit.storage.sources.karpathy import ingest_karpathy
    from vsekit.tokenize import tokenize
    from vsekit.train.demo import pixel_features

    d = tmp_path_factory.mktemp("embed")
    make_demo_data(d, images=80, seed=0, size=32, val_fraction=0.2, test_fraction=0.25)
    store, _ = ingest_karpathy(d / "dataset_demo.json", d, d / "s.zarr")
    tokenize(store, min_count=1)
    pixel_features(store, block_rows=16)
    return str(d / "s.zarr")


def _evaluate_sims(run, tmp_path):
    r = CliRunner().invoke(main, ["evaluate", str(run), "--save-sims", "--no-progress", "--out", str(tmp_path / "ev")])
    assert r.exit_code == 0, r.output
    return np.load(tmp_path / "ev" / "sims_test.npy"), json.loads((tmp_path / "ev" / "metrics.json").read_text())


@pytest.mark.parametrize("model", ["vse", "order"])
def test_embeddings_reproduce_the_models_scores(store_path, tmp_path, model):
    pq = pytest.importorskip("pyarrow.parquet")
    from vsekit.storage import FeatureStore

    train(store_path, "pixels", model, tmp_path / "run", **FAST)
    r = CliRunner().invoke(main, ["embed", str(tmp_path / "run"), "--split", "test", "--out", str(tmp_path / "e")])
    assert r.exit_code == 0, r.output
    img, cap = np.load(tmp_path / "e" / "images.npy"), np.load(tmp_path / "e" / "captions.npy")
    sims, metrics = _evaluate_sims(tmp_path / "run", tmp_path)
    if model == "vse":  # faiss inner product on the vectors = the model's cosine score
        assert np.allclose(np.linalg.norm(img, axis=1), 1, atol=1e-5)
        got = img @ cap.T
    else:  # order violation, computed here in numpy; `--model order` starts from VSE++'s Order0,
        # whose score is the norm of the violation (order-norm), not its square
        got = -np.sqrt(np.square(np.maximum(0, cap[None, :, :] - img[:, None, :])).sum(-1))
    assert got.shape == sims.shape
    np.testing.assert_allclose(got, sims, rtol=1e-4, atol=1e-5)
    store = FeatureStore.open(store_path)
    images = pq.read_table(tmp_path / "e" / "images.parquet")
    captions = pq.read_table(tmp_path / "e" / "captions.parquet")
    rows = store.split_rows("test")
    assert images.column("image_id").to_pylist() == [str(i) for i in store.image_ids()[rows]]
    owners = store.caption_images()
    cap_rows = np.asarray(captions.column("caption_row").to_pylist())
    assert np.array_equal(cap_rows, np.flatnonzero(np.isin(owners, rows)))
    assert np.array_equal(rows[captions.column("image_index").to_pylist()], owners[cap_rows])
    assert captions.column("text").to_pylist() == list(store.caption_text()[cap_rows])
    doc = json.loads((tmp_path / "e" / "embed.json").read_text())
    assert doc["similarity"] == ("cosine" if model == "vse" else "order-norm") and doc["dim"] == 16
    # the embeddings' own similarity matrix scored by `evaluate --sims` gives evaluate's metrics
    np.save(tmp_path / "mine.npy", got.astype(np.float32))
    r = CliRunner().invoke(main, ["evaluate", "--sims", str(tmp_path / "mine.npy"), "--store", store_path,
                                  "--no-progress"])
    assert r.exit_code == 0, r.output
    mine = json.loads((tmp_path / "mine_metrics.json").read_text())["protocols"]["all"]
    for key in ("i2t_r1", "i2t_r10", "t2i_r5", "t2i_meanr"):
        assert mine[key] == pytest.approx(metrics["protocols"]["all"][key], abs=1e-6), key


def test_pairwise_models_say_why_they_have_no_embeddings():
    from vsekit.models import create_model
    from vsekit.train.embed import check_embeddable

    saf = create_model("saf", img_shape=(4, 8), vocab_size=20, embed_dim=16, word_dim=8)
    with pytest.raises(ValueError, match="model 'saf' has no independent image and caption embeddings: its "
                                         "similarity is computed jointly for every image-caption pair"):
        check_embeddable(saf, "saf")
    vse = create_model("vse", img_shape=(4,), vocab_size=20, embed_dim=16, word_dim=8)
    assert check_embeddable(vse, "vse") == "cosine"


def test_pairwise_run_refused_through_the_cli(store_path, tmp_path):
    """A real SAF run on region-shaped features: `embed` exits 1 with the reason, no traceback."""
    from vsekit.storage import FeatureStore

    store = FeatureStore.open(store_path, mode="r+")
    if not store.has_features("reg"):
        fs = store.create_features("reg", (3, 8), "float32", attrs={"kind": "regions", "model": "t"},
                                   extra={"count": ((), "int16")}, block_rows=40)
        rng = np.random.default_rng(0)
        for b in fs.blocks():
            fs.write_block(b, rng.normal(size=(len(b), 3, 8)).astype(np.float32),
                           count=np.full(len(b), 3, np.int16))
    train(store_path, "reg", "saf", tmp_path / "saf", **FAST)
    r = CliRunner().invoke(main, ["embed", str(tmp_path / "saf"), "--out", str(tmp_path / "e")])
    assert r.exit_code == 1 and "has no independent image and caption embeddings" in r.output
    assert "Traceback" not in r.output and not (tmp_path / "e" / "images.npy").exists()


def test_tensorboard_curves_equal_metrics_jsonl(store_path, tmp_path):
    ea = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    r = CliRunner().invoke(main, ["train", "--store", store_path, "--features", "pixels", "--model", "vse",
                                  "--out", str(tmp_path / "run"), "--preset", "demo", "--epochs", "2",
                                  "--embed-dim", "16", "--word-dim", "8", "--no-progress",
                                  "--tensorboard", str(tmp_path / "tb")])
    assert r.exit_code == 0, r.output
    acc = ea.EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    log = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    rsum = [(e.step, e.value) for e in acc.Scalars("val/rsum")]
    assert rsum == [(x["epoch"], pytest.approx(x["val"]["rsum"], rel=1e-6)) for x in log]
    loss = [(e.step, e.value) for e in acc.Scalars("train/loss")]
    assert loss == [(x["epoch"], pytest.approx(x["loss"], rel=1e-6)) for x in log if x["loss"] is not None]


def test_tensorboard_resume_does_not_double_the_curves(store_path, tmp_path):
    ea = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    kw = dict(FAST, tensorboard=str(tmp_path / "tb"))
    train(store_path, "pixels", "vse", tmp_path / "run", **kw)
    train(store_path, "pixels", "vse", tmp_path / "run", resume=True, progress=False, epochs=2,
          tensorboard=str(tmp_path / "tb"))
    acc = ea.EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    log = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [e.step for e in acc.Scalars("val/rsum")] == [0, 1, 2] == [x["epoch"] for x in log]
