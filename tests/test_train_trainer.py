"""The trainer (curriculum, resume), the CLI train/evaluate, and learnability on the demo data."""

import json
import math

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from vsekit.cli import main
from vsekit.train import train
from vsekit.train.evaluation import metrics_from_ranks

torch.set_num_threads(1)


# end to end (CLI runs, extraction, training, subprocesses): in `make test`, not in `make test-fast`
pytestmark = pytest.mark.e2e


def build_store(d) -> str:
    """400 synthetic images (80 val, 50 test, the rest train), their tokens and pixel
    features in ``d``; returns the store's path."""
    from vsekit.storage.demo import make_demo_data
    from vsekit.storage.sources.karpathy import ingest_karpathy
    from vsekit.tokenize import tokenize
    from vsekit.train.demo import pixel_features

    make_demo_data(d, images=400, seed=0, size=32, val_fraction=0.2, test_fraction=0.125)
    store, _ = ingest_karpathy(d / "dataset_demo.json", d, d / "s.zarr")
    tokenize(store, min_count=1)
    pixel_features(store, block_rows=64)
    return str(d / "s.zarr")


@pytest.fixture(scope="module")
def store_path(tmp_path_factory):
    return build_store(tmp_path_factory.mktemp("train"))


def _lines(path):
    return [json.loads(x) for x in path.read_text().splitlines()]


FAST = dict(presets=["demo"], progress=False, embed_dim=32, word_dim=16, batch_size=64)


def test_resume_gives_the_same_result_as_an_uninterrupted_run(store_path, tmp_path):
    kw = dict(FAST, curriculum=True, patience=1, lr2=5e-4)
    train(store_path, "pixels", "order", tmp_path / "a", epochs=4, **kw)
    train(store_path, "pixels", "order", tmp_path / "b", epochs=2, **kw)
    train(store_path, "pixels", "order", tmp_path / "b", resume=True, epochs=4, progress=False)
    a = torch.load(tmp_path / "a" / "checkpoint_last.pt", weights_only=False)
    b = torch.load(tmp_path / "b" / "checkpoint_last.pt", weights_only=False)
    for k in a["model"]:
        torch.testing.assert_close(a["model"][k], b["model"][k], rtol=0, atol=0)
    strip = lambda rows: [{k: v for k, v in r.items() if k != "time_s"} for r in rows]  # noqa: E731
    assert strip(_lines(tmp_path / "a" / "metrics.jsonl")) == strip(_lines(tmp_path / "b" / "metrics.jsonl"))
    assert len(_lines(tmp_path / "a" / "metrics.jsonl")) == 5  # untrained + 4 epochs


def test_curriculum_switches_to_max_loss_from_the_best_checkpoint(store_path, tmp_path):
    # a vanishing lr keeps the val rsum flat, so the sum phase stalls after `patience` epochs
    summary = train(store_path, "pixels", "vse", tmp_path / "c", epochs=4, curriculum=True, patience=1,
                    lr=1e-12, lr2=1e-11, **FAST)
    log = _lines(tmp_path / "c" / "metrics.jsonl")
    assert [r["phase"] for r in log[1:]] == ["sum", "sum", "max", "max"]
    assert summary["switched_at"] == 2 and "best checkpoint (epoch 1)" in log[2]["switch"]
    assert log[3]["lr"] == pytest.approx(1e-11) and log[1]["lr"] == pytest.approx(1e-12)
    # the max-of-hinges loss is far below the sum over all negatives of the same model
    assert log[3]["loss"] < 0.2 * log[2]["loss"]
    assert (tmp_path / "c" / "curves.png").stat().st_size > 1000


def test_cli_train_and_evaluate(store_path, tmp_path):
    run = tmp_path / "run"
    args = ["train", "--store", store_path, "--features", "pixels", "--model", "seam-e", "--out", str(run),
            "--preset", "demo", "--epochs", "2", "--embed-dim", "32", "--model-arg", "hops=2", "--no-progress"]
    res = CliRunner().invoke(main, args)
    assert res.exit_code == 0, res.output
    for name in ("config.json", "checkpoint_last.pt", "checkpoint_best.pt", "metrics.jsonl", "curves.png"):
        assert (run / name).is_file(), name
    cfg = json.loads((run / "config.json").read_text())
    assert cfg["train"]["model_args"]["hops"] == 2 and cfg["train"]["margin"] == 0.05  # SEAM preset + override
    assert len(_lines(run / "metrics.jsonl")) == 3
    again = CliRunner().invoke(main, args)
    assert again.exit_code == 1 and "--resume" in again.output

    res = CliRunner().invoke(main, ["evaluate", str(run), "--no-progress"])
    assert res.exit_code == 0, res.output
    assert "R@1" in res.output and "rsum" in res.output
    doc = json.loads((run / "metrics.json").read_text())
    m = doc["protocols"]["all"]   # a 50-image split is not labelled "1k"
    # independent check: the metrics recomputed from the saved similarity matrix
    sims = np.load(run / "sims_test.npy")
    cap_img = np.load(run / "sims_test_caption_image.npy")
    assert sims.shape == (doc["n_images"], doc["n_captions"]) == (50, 250)
    ref = metrics_from_ranks(*ranks_from_matrix(sims, cap_img))
    assert m["rsum"] == pytest.approx(ref["rsum"]) and f"{m['rsum']:.1f}" in res.output

    # two runs: the ensemble's similarities are the mean of theirs
    run2 = tmp_path / "run2"
    assert CliRunner().invoke(main, [*args[:8], str(run2), *args[9:], "--seed", "1"]).exit_code == 0
    CliRunner().invoke(main, ["evaluate", str(run2), "--no-progress"])
    res = CliRunner().invoke(main, ["evaluate", str(run), str(run2), "--out", str(tmp_path / "ens"), "--no-progress"])
    assert res.exit_code == 0, res.output
    mean = (np.load(run / "sims_test.npy") + np.load(run2 / "sims_test.npy")) / 2
    np.testing.assert_allclose(np.load(tmp_path / "ens" / "sims_test.npy"), mean, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("args, message", [
    (["--model", "nope"], "valid choices"),
    (["--model", "vse", "--preset", "xx"], "unknown preset"),
    (["--model", "vse", "--model-arg", "hops=3"], "--model-arg hops"),
    (["--model", "seam-c", "--epochs", "0"], "--epochs must be at least 1"),
])
def test_cli_train_errors(store_path, tmp_path, args, message):
    res = CliRunner().invoke(main, ["train", "--store", store_path, "--features", "pixels", "--out",
                                    str(tmp_path / "r"), *args])
    assert res.exit_code == 1 and message in res.output, res.output


def chance_rsum(store_path, split: str = "val") -> float:
    """The expected rsum of a random ranking of ``split``: i2t R@K is the chance that one of an
    image's c captions (of M) is among K drawn without replacement, t2i R@K is K / N."""
    from vsekit.storage.store import FeatureStore
    from vsekit.train.data import EvalSet

    ev = EvalSet.from_store(FeatureStore.open(store_path), split)
    n, m = len(ev.rows), len(ev.captions)
    per_image = np.bincount(ev.caption_image, minlength=n)
    total = 0.0
    for k in (1, 5, 10):
        total += np.mean([1 - math.comb(m - c, k) / math.comb(m, k) for c in per_image])
        total += min(k, n) / n
    return 100 * total


def test_chance_rsum_is_the_mean_rsum_of_random_rankings(store_path):
    from vsekit.storage.store import FeatureStore
    from vsekit.train.data import EvalSet

    ev = EvalSet.from_store(FeatureStore.open(store_path), "val")
    rng = np.random.default_rng(0)
    draws = [metrics_from_ranks(*ranks_from_matrix(rng.random((len(ev.rows), len(ev.captions))),
                                                   ev.caption_image))["rsum"] for _ in range(400)]
    assert chance_rsum(store_path) == pytest.approx(np.mean(draws), abs=4 * np.std(draws) / 20)


def demo_learning_run(store_path, out, model: str, seed: int) -> dict:
    """Train ``model`` with the demo preset and ``seed`` (initial weights, batch order); the summary
    holds the best and the untrained val rsum."""
    return train(store_path, "pixels", model, out, presets=["demo"], progress=False, seed=seed)


LEARNING_MODELS = ["vse", "order", "seam-e", "seam-c", "seam-g"]


def learns_the_demo_data(store_path, out, model: str, seed: int, chance: float):
    """(best val rsum, its bar, the run's summary): the bar is 3x chance and 2x the same model untrained. Against chance, not the
    untrained draw alone: the untrained rsum is chance plus noise (24.8-57.8 against 39.3 over
    seeds 0-19 of the five models): the old bar, 3x that draw, held by 10% at worst (3.31x, vse
    seed 14), a margin that rested on the draw. The sweep's worst seed is 1.4x this bar."""
    s = demo_learning_run(store_path, out, model, seed)
    return s["best_rsum"], max(3 * chance, 2 * s["untrained_rsum"]), s


@pytest.mark.parametrize("model", LEARNING_MODELS)
def test_every_model_learns_the_demo_data(store_path, tmp_path, model):
    """Every model learns the demo data with the demo preset. Holds for every seed:
    tests/test_learning_seeds.py runs seeds 0-19 (worst values in its docstring)."""
    best, bar, s = learns_the_demo_data(store_path, tmp_path / model, model, seed=0, chance=chance_rsum(store_path))
    assert best >= bar, (model, bar, s)


def ranks_from_matrix(sims, caption_image, **kw):
    """Ranks of an in-memory (n_images, n_captions) similarity matrix, through the evaluation's own
    blockwise ``compute_ranks`` (float64 scores)."""
    import numpy as np
    import torch

    from vsekit.train.evaluation import compute_ranks

    sims_t = torch.as_tensor(np.asarray(sims, dtype=np.float64))
    return compute_ranks(lambda i, c: sims_t[i][:, c], sims_t.shape[0], np.asarray(caption_image), **kw)
