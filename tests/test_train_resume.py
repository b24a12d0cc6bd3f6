"""Reruns of `vsekit train` / `evaluate` through the CLI: overwrite, resume, checkpoints, faults.

Each fault is injected deterministically (a patched write that raises KeyboardInterrupt - what
Ctrl-C raises - at a chosen point), then `train --resume` must give what an uninterrupted run gives.
"""

import json
import os

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from vsekit.cli import main
from vsekit.train import trainer

torch.set_num_threads(1)


# end to end (CLI runs, extraction, training, subprocesses): in `make test`, not in `make test-fast`
pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def store_path(tmp_path_factory):
    """160 synthetic images with tokens and pixel features."""
    from vsekit.storage.demo import make_demo_data
    from vsekit.storage.sources.karpathy import ingest_karpathy
    from vsekit.tokenize import tokenize
    from vsekit.train.demo import pixel_features

    d = tmp_path_factory.mktemp("reruns")
    make_demo_data(d, images=160, seed=3, size=32, val_fraction=0.2, test_fraction=0.2)
    store, _ = ingest_karpathy(d / "dataset_demo.json", d, d / "s.zarr")
    tokenize(store, min_count=1)
    pixel_features(store, block_rows=32)
    return str(d / "s.zarr")


def base(store_path, out, *extra, model="vse"):
    return ["train", "--store", store_path, "--features", "pixels", "--model", model, "--out", str(out),
            "--preset", "demo", "--embed-dim", "32", "--word-dim", "16", "--batch-size", "32",
            "--no-progress", *extra]


def invoke(args):
    res = CliRunner().invoke(main, [str(a) for a in args])
    assert "Traceback" not in res.output, res.output
    return res


def ok(args):
    res = invoke(args)
    assert res.exit_code == 0, res.output
    return res


def lines(path):
    return [{k: v for k, v in json.loads(x).items() if k != "time_s"} for x in path.read_text().splitlines()]


def weights(path):
    return torch.load(path, weights_only=True, map_location="cpu")["model"]


def assert_same_run(a, b):
    """Two run folders hold bitwise equal weights and the same log (less wall time), and no leftovers."""
    wa, wb = weights(a / "checkpoint_last.pt"), weights(b / "checkpoint_last.pt")
    assert wa.keys() == wb.keys()
    for k in wa:
        assert torch.equal(wa[k], wb[k]), k
    wa, wb = weights(a / "checkpoint_best.pt"), weights(b / "checkpoint_best.pt")
    for k in wa:
        assert torch.equal(wa[k], wb[k]), k
    assert lines(a / "metrics.jsonl") == lines(b / "metrics.jsonl")
    assert sorted(p.name for p in b.iterdir() if ".tmp" in p.name) == []


# --overwrite -------------------------------------------------------------------------------------
def test_overwrite_leaves_nothing_of_the_old_run(store_path, tmp_path):
    run = tmp_path / "run"
    ok(base(store_path, run, "--epochs", "1"))
    ok(["evaluate", run, "--no-progress"])
    (run / ".vsekit-pipeline.json").write_text(json.dumps({"p/train": {"fingerprint": "x"}}))
    (run / "notes.txt").write_text("mine")
    assert (run / "metrics.json").is_file() and (run / "sims_test.npy").is_file()

    # a mistake in the new command leaves the old run as it was
    bad = invoke(base(store_path, run, "--epochs", "1", "--overwrite", model="nope"))
    assert bad.exit_code == 1 and "Error:" in bad.output
    assert (run / "metrics.json").is_file() and (run / "checkpoint_best.pt").is_file()

    ok(base(store_path, run, "--epochs", "1", "--overwrite", model="order"))
    left = sorted(p.name for p in run.iterdir())
    assert left == ["checkpoint_best.pt", "checkpoint_last.pt", "config.json", "curves.png",
                    "metrics.jsonl", "notes.txt"], left
    assert json.loads((run / "config.json").read_text())["train"]["model"] == "order"


# --resume ----------------------------------------------------------------------------------------
def test_resume_applies_epochs_and_device_and_records_them(store_path, tmp_path):
    run = tmp_path / "run"
    ok(base(store_path, run, "--epochs", "1"))
    res = ok(base(store_path, run, "--epochs", "2", "--device", "cpu", "--resume"))
    assert "--epochs 1 -> 2" in res.output
    cfg = json.loads((run / "config.json").read_text())
    assert cfg["train"]["epochs"] == 2 and cfg["resumed"] == [{"changed": {"epochs": [1, 2]}}]
    assert len(lines(run / "metrics.jsonl")) == 3
    # the same command again with --resume: nothing to change, nothing refused
    ok(base(store_path, run, "--epochs", "2", "--resume"))


@pytest.mark.parametrize("extra, named", [
    (["--lr", "0.5"], "--lr 0.5"),
    (["--batch-size", "8"], "--batch-size 8"),
    (["--margin", "0.7"], "--margin 0.7"),
    (["--model-arg", "hops=3"], "--model-arg hops=3"),
    (["--seed", "9"], "--seed 9"),
    (["--sum-violation", "--max-violation"], "--max-violation/--sum-violation"),
])
def test_resume_refuses_options_that_cannot_change(store_path, tmp_path, extra, named):
    run = tmp_path / "run"
    ok(base(store_path, run, "--epochs", "1"))
    before = (run / "config.json").read_text()
    res = invoke([*base(store_path, run, "--epochs", "2", "--resume"), *extra])
    assert res.exit_code == 1 and "Error:" in res.output and named in res.output, res.output
    assert (run / "config.json").read_text() == before


def test_resume_refuses_other_model_and_features(store_path, tmp_path):
    run = tmp_path / "run"
    ok(base(store_path, run, "--epochs", "1"))
    res = invoke(base(store_path, run, "--epochs", "2", "--resume", model="order"))
    assert res.exit_code == 1 and "--model order" in res.output


def test_resume_refuses_a_feature_set_remade_with_other_settings(store_path, tmp_path):
    """The train side of `--weights` provenance: the set's config hash and weights digest must be unchanged."""
    import shutil

    from vsekit.storage.store import FeatureStore
    from vsekit.train.demo import pixel_features

    store = tmp_path / "s.zarr"
    shutil.copytree(store_path, store)
    run = tmp_path / "run"
    ok(base(str(store), run, "--epochs", "1"))
    FeatureStore.open(store, mode="r+").delete_features("pixels")
    pixel_features(FeatureStore.open(store, mode="r+"), side=8, bins=2)  # same name, other settings (and width)
    res = invoke(base(str(store), run, "--epochs", "2", "--resume"))
    assert res.exit_code == 1 and "changed since the run started" in res.output, res.output


# checkpoints -------------------------------------------------------------------------------------
class _Evil:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):  # what a hostile checkpoint does: run a callable on load
        return (open, (self.marker, "w"))


@pytest.fixture(scope="module")
def trained(store_path, tmp_path_factory):
    run = tmp_path_factory.mktemp("trained") / "run"
    ok(base(store_path, run, "--epochs", "1"))
    return run


def _copy(run, tmp_path):
    import shutil

    dst = tmp_path / "copy"
    shutil.copytree(run, dst)
    return dst


@pytest.mark.parametrize("command", ["evaluate", "report", "resume"])
def test_a_hostile_checkpoint_is_refused_not_run(store_path, trained, tmp_path, command):
    run = _copy(trained, tmp_path)
    marker = tmp_path / "pwned"
    ck = torch.load(run / "checkpoint_best.pt", weights_only=True)
    ck["model"]["evil"] = _Evil(str(marker))
    for name in ("checkpoint_best.pt", "checkpoint_last.pt"):
        torch.save(ck, run / name)
    args = {"evaluate": ["evaluate", run, "--no-progress"],
            "report": ["report", run, "--out", tmp_path / "rep"],
            "resume": base(store_path, run, "--epochs", "2", "--resume")}[command]
    res = invoke(args)
    assert not marker.exists(), "the checkpoint's code ran"
    assert "refused to load" in res.output and "open)" in res.output, res.output
    if command == "report":  # a report shows what it can and says what it left out
        assert res.exit_code == 0 and "note:" in res.output
    else:
        assert res.exit_code == 1 and "Error:" in res.output


@pytest.mark.parametrize("command", ["evaluate", "report", "resume"])
def test_a_truncated_checkpoint_is_a_clear_error(store_path, trained, tmp_path, command):
    run = _copy(trained, tmp_path)
    for name in ("checkpoint_best.pt", "checkpoint_last.pt"):
        data = (run / name).read_bytes()
        (run / name).write_bytes(data[: len(data) // 2])
    args = {"evaluate": ["evaluate", run, "--no-progress"],
            "report": ["report", run, "--out", tmp_path / "rep"],
            "resume": base(store_path, run, "--epochs", "2", "--resume")}[command]
    res = invoke(args)
    assert "truncated" in res.output and "checkpoint_" in res.output, res.output  # names the file
    if command == "report":
        assert res.exit_code == 0 and "note:" in res.output
    else:
        assert res.exit_code == 1 and "Error:" in res.output


def test_checkpoints_load_with_weights_only(trained):
    for name in ("checkpoint_best.pt", "checkpoint_last.pt"):
        ck = torch.load(trained / name, weights_only=True)
        assert isinstance(ck["config"], dict) and ck["config"]["model"] == "vse"


_AS_CUDA = {"on": False}


def _cuda_tagger(storage):
    return "cuda:0" if _AS_CUDA["on"] else None


torch.serialization.register_package(0, _cuda_tagger, lambda obj, location: None)


def test_a_cuda_trained_run_evaluates_and_resumes_on_cpu(store_path, trained, tmp_path):
    """Checkpoints whose tensors were saved from CUDA (as on a GPU machine) load on a CPU-only one."""
    run = _copy(trained, tmp_path)
    ok(["evaluate", run, "--no-progress"])
    want = json.loads((run / "metrics.json").read_text())["protocols"]
    for name in ("checkpoint_best.pt", "checkpoint_last.pt"):
        ck = torch.load(run / name, weights_only=True)
        _AS_CUDA["on"] = True
        try:
            torch.save(ck, run / name)
        finally:
            _AS_CUDA["on"] = False
    cfg = json.loads((run / "config.json").read_text())
    cfg["train"]["device"] = "cuda"
    (run / "config.json").write_text(json.dumps(cfg))
    if not torch.cuda.is_available():  # the simulation is real: a plain load fails on this machine
        with pytest.raises(RuntimeError):
            torch.load(run / "checkpoint_best.pt", weights_only=True)
    ok(["evaluate", run, "--no-progress", "--device", "cpu"])
    assert json.loads((run / "metrics.json").read_text())["protocols"] == want
    ok(base(store_path, run, "--epochs", "2", "--resume", "--device", "cpu"))
    assert json.loads((run / "config.json").read_text())["train"]["device"] == "cpu"


# faults: kill at a write point, resume, compare with an uninterrupted run ----------------------------
class Killed(KeyboardInterrupt):
    pass


def _fault(monkeypatch, target, nth, partial=False):
    """Make the ``nth`` call of ``trainer.<target>`` (``_save`` / ``_write_log``) die before it writes
    (or, with ``partial``, after writing half of its temporary file)."""
    real = getattr(trainer, target)
    calls = {"n": 0}

    def dying(*args, **kw):
        calls["n"] += 1
        if calls["n"] == nth:
            if partial:
                path = args[0] / "metrics.jsonl.tmp" if target == "_write_log" else args[0].with_suffix(".tmp")
                path.write_bytes(b'{"epoch": 1, "pha')
            raise Killed()
        return real(*args, **kw)

    monkeypatch.setattr(trainer, target, dying)


@pytest.fixture(scope="module")
def uninterrupted(store_path, tmp_path_factory):
    run = tmp_path_factory.mktemp("whole") / "run"
    ok(base(store_path, run, "--epochs", "3", "--curriculum", "--patience", "1", "--lr2", "5e-4"))
    return run


# _write_log is called once for the untrained validation, then once per epoch; _save twice per
# improving epoch (best, then last) and once otherwise.
FAULTS = {
    "before the last metrics write": ("_write_log", 4, False),
    "during the last metrics write": ("_write_log", 4, True),
    "before the first metrics write": ("_write_log", 1, False),
    "before epoch 2's metrics write": ("_write_log", 3, False),
    "before the first checkpoint write": ("_save", 1, False),
    "during the first checkpoint write": ("_save", 1, True),
    "between best and last checkpoint of epoch 1": ("_save", 2, False),
    "before epoch 3's last checkpoint": ("_save", 5, False),
}


@pytest.mark.parametrize("point", list(FAULTS))
def test_resume_after_a_kill_equals_an_uninterrupted_run(store_path, uninterrupted, tmp_path,
                                                         monkeypatch, point):
    target, nth, partial = FAULTS[point]
    run = tmp_path / "run"
    args = base(store_path, run, "--epochs", "3", "--curriculum", "--patience", "1", "--lr2", "5e-4")
    with monkeypatch.context() as m:
        _fault(m, target, nth, partial)
        res = CliRunner().invoke(main, [str(a) for a in args])
        assert res.exit_code != 0 and isinstance(res.exception, (SystemExit, KeyboardInterrupt)), res.output
    if (run / "checkpoint_last.pt").is_file():
        ok([*args, "--resume"])
    else:  # killed before the first epoch was saved: the same command starts it again
        ok(args)
    assert_same_run(uninterrupted, run)


def test_no_checkpoint_payload_needs_pickled_objects(trained):
    """Independent check of the saved payload: only tensors, dicts, lists, str, numbers, bools, None."""
    def plain(x):
        if isinstance(x, dict):
            return all(isinstance(k, (str, int)) and plain(v) for k, v in x.items())
        if isinstance(x, list):
            return all(plain(v) for v in x)
        return x is None or isinstance(x, (torch.Tensor, str, int, float, bool))

    for name in ("checkpoint_best.pt", "checkpoint_last.pt"):
        assert plain(torch.load(trained / name, weights_only=True))
    assert np.isfinite(json.loads((trained / "metrics.jsonl").read_text().splitlines()[-1])["val"]["rsum"])


# protocols ----------------------------------------------------------------------------------------
def test_a_small_split_is_labelled_all_and_coco_protocols_warn(trained, tmp_path):
    from vsekit.storage.store import FeatureStore

    run = _copy(trained, tmp_path)
    res = ok(["evaluate", run, "--no-progress"])
    doc = json.loads((run / "metrics.json").read_text())
    n = doc["n_images"]
    assert n == len(FeatureStore.open(doc["store"]).split_rows("test")) and n != 1000
    assert list(doc["protocols"]) == ["all"] and " all " in res.output and " 1k " not in res.output
    res = ok(["evaluate", run, "--no-progress", "--protocol", "coco-5k", "--protocol", "1k"])
    assert f"warning: --protocol coco-5k is defined on a 5000-image test split, but split 'test' has {n}" in res.output
    assert "warning: --protocol 1k is defined on a 1000-image" in res.output
    res = invoke(["evaluate", run, "--no-progress", "--split", "tset"])
    assert res.exit_code == 1 and "tset" in res.output


# the HTML report ------------------------------------------------------------------------------------
def test_report_shows_the_ensemble_row_and_one_colour_per_run(store_path, trained, tmp_path):
    import re

    a = _copy(trained, tmp_path)
    b = tmp_path / "b"
    ok(base(store_path, b, "--epochs", "1", "--seed", "1"))
    res = ok(["evaluate", a, b, "--no-progress"])          # SGRAF-style: mean of the runs' similarities
    row = next(x for x in res.output.splitlines() if x.startswith("copy + b"))
    rsum = float(row.split()[-1])
    ok(["report", a, b, "--out", tmp_path / "rep", "--caption-queries", "1", "--image-queries", "1", "--attention", "0"])
    html = (tmp_path / "rep" / "index.html").read_text()
    cell = re.search(r'data-run="copy \+ b" data-protocol="all" data-metric="rsum" data-value="([^"]+)"', html)
    assert cell, "no ensemble row in the HTML report"
    assert float(cell.group(1)) == pytest.approx(rsum, abs=0.051)
    # R@1 chart: each run one colour (both directions), each direction one line style
    chart = re.search(r'<svg[^>]*aria-label="validation R@1".*?</svg>', html).group(0)
    lines_ = re.findall(r'<polyline fill="none" stroke="(#\w+)" stroke-width="1.8"( stroke-dasharray="[^"]+")?', chart)
    assert len(lines_) == 4
    (ca1, da1), (ca2, da2), (cb1, db1), (cb2, db2) = lines_
    assert ca1 == ca2 and cb1 == cb2 and ca1 != cb1
    assert da1 == db1 == "" and da2 == db2 != ""


def test_chart_colours_stay_distinct_beyond_the_palette():
    from vsekit.report.plots import colour

    assert len({colour(i) for i in range(40)}) == 40


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_resuming_a_cuda_run_on_a_cpu_machine_says_how(store_path, trained, tmp_path):
    run = _copy(trained, tmp_path)
    cfg = json.loads((run / "config.json").read_text())
    cfg["train"]["device"] = "cuda"
    (run / "config.json").write_text(json.dumps(cfg))
    res = invoke(base(store_path, run, "--epochs", "2", "--resume"))
    assert res.exit_code == 1 and "--device cpu" in res.output, res.output
