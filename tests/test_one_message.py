"""One message per mistake (issue 45): a missing store, a missing feature set, a stage run before the
one it needs and a misspelt model get the same one `Error:` line from every command, naming the
command that fixes it; a misspelt ``train --model`` is refused before torch is imported."""

from __future__ import annotations

import fnmatch
import json
import subprocess
import sys

import pytest
from click.testing import CliRunner

from vsekit.cli import main
from vsekit.storage.base import no_feature_set, no_tokens, not_a_store

pytestmark = pytest.mark.e2e


def _error(args: list[str]) -> str:
    """The command's last output line, which must be its one `Error:` line (exit code 1)."""
    res = CliRunner().invoke(main, args)
    assert res.exit_code == 1, (args, res.output, res.exception)
    lines = res.output.strip().splitlines()
    assert lines[-1].startswith("Error: ") and "Traceback" not in res.output and "Usage:" not in res.output, res.output
    return lines[-1]


def test_a_missing_store_is_one_message_from_every_command(tmp_path):
    gone = str(tmp_path / "dmeo.zarr")
    run = tmp_path / "run"
    commands = [["extract", "--store", gone, "--model", "vgg19", "--kind", "global"],
                ["train", "--store", gone, "--features", "x", "--model", "vse", "--out", str(run)],
                ["info", gone], ["tokenize", "--store", gone], ["standardize", "--store", gone, "--features", "x"],
                ["discretize", "--store", gone, "--features", "x"], ["fne", "--store", gone, "--features", "x"],
                ["export", "vsepp", "--store", gone, "--features", "x", "--out", str(tmp_path / "o")],
                ["split", "--store", gone, "--val", "1", "--test", "1"]]
    want = f"Error: {not_a_store(gone)}"
    assert "`vsekit ingest" in want
    for args in commands:
        assert _error(args) == want, args


@pytest.fixture(scope="module")
def bare_store(tmp_path_factory):
    """An ingested store with no feature set and no tokens, and one with tokens only."""
    from vsekit.storage.demo import make_demo_data
    from vsekit.storage.sources.karpathy import ingest_karpathy
    from vsekit.tokenize import tokenize

    d = tmp_path_factory.mktemp("bare")
    make_demo_data(d, images=12, seed=4, size=16)
    ingest_karpathy(d / "dataset_demo.json", d, d / "bare.zarr")
    tokens, _ = ingest_karpathy(d / "dataset_demo.json", d, d / "tokens.zarr")
    tokenize(tokens, min_count=1)
    return d


def test_a_missing_feature_set_is_one_message_naming_the_stage_that_makes_it(bare_store, tmp_path):
    store = str(bare_store / "tokens.zarr")
    commands = [["standardize", "--store", store, "--features", "vgg19"],
                ["discretize", "--store", store, "--features", "vgg19"],
                ["fne", "--store", store, "--features", "vgg19"], ["info", store, "vgg19"],
                ["export", "vsepp", "--store", store, "--features", "vgg19", "--out", str(tmp_path / "o")],
                ["train", "--store", store, "--features", "vgg19", "--model", "vse", "--out", str(tmp_path / "r")]]
    want = f"Error: {no_feature_set('vgg19', store, [])}"
    assert f"`vsekit extract --store {store} --name vgg19 ...`" in want   # training before extracting
    for args in commands:
        assert _error(args) == want, args
    # a derived set names the stage that derives it
    assert "`vsekit standardize --store S --features vgg19`" in no_feature_set("vgg19.z", "S", ["vgg19"])
    assert "`vsekit discretize --store S --features vgg19.z`" in no_feature_set("vgg19.z.fne", "S", ["vgg19.z"])


def test_a_typo_in_a_feature_set_gets_a_did_you_mean(demo_store, tmp_path):
    from vsekit.train.demo import pixel_features

    pixel_features(demo_store, block_rows=8)
    line = _error(["standardize", "--store", str(demo_store.path), "--features", "pixel"])
    assert line.startswith("Error: no feature set 'pixel' in ") and "did you mean 'pixels'?" in line, line
    assert "(it has: pixels)" in line and "`vsekit extract --store" in line


def test_a_stage_before_tokenize_is_one_message_from_every_command(bare_store, tmp_path):
    store = str(bare_store / "bare.zarr")
    want = f"Error: {no_tokens(store)}"
    assert f"`vsekit tokenize --store {store}` first" in want
    for args in (["train", "--store", store, "--features", "x", "--model", "vse", "--out", str(tmp_path / "r")],
                 ["export", "vocab", "--store", store, "--out", str(tmp_path / "v.json")]):
        assert _error(args) == want, args


def test_a_misspelt_train_model_is_refused_with_a_did_you_mean_before_torch_is_imported(bare_store, tmp_path):
    code = f"""
import json, sys
from vsekit.cli import main
try:
    main(["train", "--store", {str(bare_store / 'tokens.zarr')!r}, "--features", "x", "--model", "vgg91",
          "--out", {str(tmp_path / 'r')!r}], standalone_mode=False)
except Exception as exc:
    print(json.dumps({{"error": str(exc), "heavy": sorted(m for m in ("torch", "vsekit.models", "vsekit.train")
                                                          if m in sys.modules)}}))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    got = json.loads(out.strip().splitlines()[-1])
    assert got["heavy"] == [], got            # refused before torch or any model is imported
    assert got["error"].startswith("--model 'vgg91': unknown model; did you mean 'vgg19', a backbone of "
                                   "`vsekit extract --model`? (valid choices: order, saf, "), got
    assert "unknown model; did you mean 'vse' or" in _error(["train", "--store", str(bare_store / "tokens.zarr"), "--features",
                                              "x", "--model", "vsee", "--out", str(tmp_path / "r")])


def test_the_names_read_without_torch_are_the_registries():
    from vsekit.extract.backbones import _REGISTRY
    from vsekit.models import _MODELS
    from vsekit.suggest import BACKBONES, RETRIEVAL_MODELS

    # vsekit's own (other test modules register models of their own)
    assert sorted(n for n, f in _MODELS.items() if f.__module__.startswith("vsekit.")) == list(RETRIEVAL_MODELS)
    assert sorted(n for n, s in _REGISTRY.items() if s.build.__module__.startswith("vsekit.")) == list(BACKBONES)


def test_train_help_lists_every_preset():
    from vsekit.train.presets import PRESETS

    preset = next(p for p in main.get_command(None, "train").params if p.name == "presets")
    assert preset.help in " ".join(CliRunner().invoke(main, ["train", "--help"]).output.split()).replace("- ", "-")
    listed = preset.help.replace("(", " ").replace(")", " ").replace(",", " ")
    patterns = [w for w in listed.split() if any(c.isalnum() for c in w)]
    missing = [p for p in PRESETS if not any(fnmatch.fnmatchcase(p, pat) for pat in patterns)]
    assert not missing, missing
    assert "sman-demo" in patterns and "sgraf-demo" in patterns


def test_the_demo_recipe_validates_on_enough_images_to_raise_no_warning():
    """The demo's own validation split is at least train's SMALL_VAL, so its five train stages warn of
    nothing (the warning itself: tests/test_failed_rows.py)."""
    from pathlib import Path

    from vsekit.pipeline import load_file
    from vsekit.storage.demo import demo_splits
    from vsekit.train.data import SMALL_VAL

    demo = load_file(Path(__file__).parents[1] / "pipelines.yaml").pipelines["demo"]
    stage = next(s for s in demo.stages if s.id == "demo-data")
    values = {k: v.value for k, v in stage.values.items()}
    images = int(demo.variables["DEMO_IMAGES"].value)
    counts = demo_splits(images, int(values["val"]), int(values["test"]))
    assert counts["val"] >= SMALL_VAL and counts["train"] >= 250, counts


def test_a_missing_run_is_one_message_from_every_command(tmp_path):
    """Evaluating, embedding or reporting before training: the run folder's one line, naming `vsekit train`."""
    from vsekit.storage.base import not_a_run

    for run in (tmp_path / "runs" / "frist", tmp_path):   # a typo, and a folder that holds no run
        want = f"Error: {not_a_run(run)}"
        assert f"`vsekit train ... --out {run}`" in want
        for args in (["evaluate", str(run)], ["embed", str(run), "--out", str(tmp_path / "e")],
                     ["report", str(run), "--out", str(tmp_path / "r")]):
            assert _error(args) == want, args
