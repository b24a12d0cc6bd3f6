"""A new user's first hour (issue 29): exact messages that name the fix, and wrong input refused.

Each test fails on the code before the issue: "did you mean", a changed-settings error that lists the
settings, COCO split folders searched by rule, a null caption refused, FNE codes not standardized,
a vector set refused for SMAN, and messages that say what is true.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from vsekit.cli import main
from vsekit.storage.store import FeatureStore, ProvenanceError, StoreError
from vsekit.suggest import did_you_mean, improve_message


# end to end (CLI runs, extraction, training, subprocesses): in `make test`, not in `make test-fast`
pytestmark = pytest.mark.e2e


def _store(tmp_path: Path, n: int = 12) -> FeatureStore:
    store = FeatureStore.create(tmp_path / "s.zarr", dataset="toy")
    store.write_images([str(i) for i in range(n)], [f"{i}.jpg" for i in range(n)],
                       ["train"] * (n - 4) + ["val", "val", "test", "test"])
    store.write_captions([f"a photo {i}" for i in range(n)], list(range(n)))
    return store


def _fill(store, name, width=6, seed=0, **attrs):
    values = np.random.default_rng(seed).normal(size=(store.n_images, width)).astype(np.float32)
    fs = store.create_features(name, (width,), np.float32, attrs={"kind": "global", "model": "toy", **attrs},
                               block_rows=4)
    for b in fs.blocks():
        fs.write_block(b, values[b.start:b.stop])
    return fs


def test_did_you_mean():
    assert did_you_mean("shh", ["sh", "mh", "soe"]) == "did you mean 'sh'?"
    assert did_you_mean("zzz", ["sh", "mh"]) == ""
    many = ", ".join(["sh", "mh", "soe", "moe", "ph", "poe"] + [f"preset{i}" for i in range(40)])
    msg = improve_message(f"unknown preset 'shh'; valid choices: {many}")
    assert msg.startswith("unknown preset 'shh'; did you mean 'sh'?") and "(46 in all)" in msg
    assert "preset39" not in msg   # a long list is shortened to its first names and a count
    # the quoted name nearest the list is the one suggested for, not an earlier one
    msg = improve_message("p.yaml, line 3: pipeline 'demo', stage 2 (extract): unknown option 'wieghts' "
                          "for `vsekit extract`; valid: batch-size, weights, workers")
    assert "did you mean 'weights'?" in msg


def test_cli_suggests_presets_and_feature_sets(tmp_path):
    store = _store(tmp_path)
    _fill(store, "vgg19_fne")
    res = CliRunner().invoke(main, ["train", "--store", str(store.path), "--features", "vgg19_fne", "--out",
                                    str(tmp_path / "run"), "--preset", "shh"])
    assert res.exit_code == 1 and "unknown preset 'shh'; did you mean 'sh'?" in res.output
    assert res.output.count(",") < 20   # not all 43 presets
    res = CliRunner().invoke(main, ["standardize", "--store", str(store.path), "--features", "vgg19_fn"])
    assert res.exit_code == 1 and "no feature set 'vgg19_fn'" in res.output
    assert "did you mean 'vgg19_fne'?" in res.output


def test_changed_settings_error_lists_the_settings_that_differ(tmp_path):
    store = _store(tmp_path)
    _fill(store, "feat", crops=10, resize=256)
    with pytest.raises(ProvenanceError) as exc:
        store.create_features("feat", (6,), np.float32, attrs={"kind": "global", "model": "toy", "crops": 5,
                                                               "resize": 256})
    assert "with different settings (crops 10 → 5)" in str(exc.value)
    assert "config_hash" not in str(exc.value)


def test_changed_thresholds_of_a_derived_set_are_listed(tmp_path):
    from vsekit.fne import discretize, standardize

    store = _store(tmp_path)
    _fill(store, "feat")
    standardize(store, "feat")
    discretize(store, "feat.z")
    res = CliRunner().invoke(main, ["discretize", "--store", str(store.path), "--features", "feat.z",
                                    "--thresholds", "-0.5", "0.5"])
    assert res.exit_code == 1 and "thresholds [-0.25, 0.15] → [-0.5, 0.5]" in res.output, res.output
    assert "config_hash" not in res.output


def test_standardize_refuses_ternary_codes(tmp_path):
    from vsekit.fne import discretize, standardize

    store = _store(tmp_path)
    _fill(store, "feat")
    standardize(store, "feat")
    discretize(store, "feat.z")
    res = CliRunner().invoke(main, ["standardize", "--store", str(store.path), "--features", "feat.z.fne"])
    assert res.exit_code == 1 and "'feat.z.fne' holds ternary FNE codes" in res.output
    assert "feat.z.fne.z" not in FeatureStore.open(store.path).feature_names()


def test_discretize_refuses_raw_features_and_allow_raw_lets_it_through(tmp_path):
    from vsekit.fne import discretize

    store = _store(tmp_path)
    _fill(store, "feat")
    res = CliRunner().invoke(main, ["discretize", "--store", str(store.path), "--features", "feat"])
    assert res.exit_code == 1 and res.output.count("Error:") == 1, res.output
    assert "'feat' holds raw, unstandardised values" in res.output
    assert "vsekit standardize --features feat" in res.output and "--allow-raw" in res.output
    assert "feat.fne" not in FeatureStore.open(store.path).feature_names()   # nothing written
    res = CliRunner().invoke(main, ["discretize", "--store", str(store.path), "--features", "feat", "--allow-raw"])
    assert res.exit_code == 0, res.output
    x = np.asarray(FeatureStore.open(store.path).features("feat").data[:], dtype=np.float64)
    want = np.where(x > 0.15, 1, np.where(x < -0.25, -1, 0))
    np.testing.assert_array_equal(FeatureStore.open(store.path).features("feat.fne").data[:], want)
    with pytest.raises(StoreError, match="raw, unstandardised"):
        discretize(store, "feat", name="again")


def test_standardize_refuses_a_standardized_set_unless_allowed(tmp_path):
    from vsekit.fne import fne, standardize

    store = _store(tmp_path)
    _fill(store, "feat")
    standardize(store, "feat")
    for cmd in ("standardize", "fne"):
        res = CliRunner().invoke(main, [cmd, "--store", str(store.path), "--features", "feat.z"])
        assert res.exit_code == 1 and "'feat.z' is standardized already" in res.output, res.output
        assert "vsekit discretize --features feat.z" in res.output and "--allow-standardized" in res.output
    assert "feat.z.z" not in FeatureStore.open(store.path).feature_names()
    res = CliRunner().invoke(main, ["standardize", "--store", str(store.path), "--features", "feat.z",
                                    "--allow-standardized"])
    assert res.exit_code == 0, res.output
    assert FeatureStore.open(store.path).features("feat.z.z").attrs["parent"] == "feat.z"
    with pytest.raises(StoreError, match="standardized already"):
        fne(store, "feat.z")


def _coco(tmp_path: Path, captions) -> tuple[Path, Path]:
    ann = tmp_path / "captions_train2014.json"
    ann.write_text(json.dumps({"images": [{"id": k, "file_name": f"{k:012d}.jpg"} for k in range(len(captions))],
                               "annotations": [{"image_id": k, "caption": c} for k, c in enumerate(captions)]}))
    splits = tmp_path / "splits.json"
    splits.write_text(json.dumps({str(k): "train" for k in range(len(captions))}))
    return ann, splits


def test_coco_plain_file_names_are_found_in_split_folders_and_the_hint_states_the_rule(tmp_path):
    ann, splits = _coco(tmp_path, ["a dog", "a cat"])
    (tmp_path / "root" / "train2014").mkdir(parents=True)
    res = CliRunner().invoke(main, ["ingest", "coco", str(ann), "--split-file", str(splits), "--image-root",
                                    str(tmp_path / "root"), "--store", str(tmp_path / "a.zarr")])
    assert res.exit_code == 1
    assert "IMAGE_ROOT/file_name, then IMAGE_ROOT/SET/file_name for SET in the file name's own set" in res.output
    assert "train2014, val2014, test2014, train2017, val2017, test2017" in res.output
    for k in range(2):
        (tmp_path / "root" / "train2014" / f"{k:012d}.jpg").write_bytes(b"x")
    res = CliRunner().invoke(main, ["ingest", "coco", str(ann), "--split-file", str(splits), "--image-root",
                                    str(tmp_path / "root"), "--store", str(tmp_path / "b.zarr")])
    assert res.exit_code == 0, res.output
    assert list(FeatureStore.open(tmp_path / "b.zarr").image_paths()) == [f"train2014/{k:012d}.jpg" for k in range(2)]


def test_a_null_coco_caption_is_an_error_not_an_empty_caption(tmp_path):
    ann, splits = _coco(tmp_path, ["a dog", None])
    (tmp_path / "root").mkdir()
    res = CliRunner().invoke(main, ["ingest", "coco", str(ann), "--split-file", str(splits), "--image-root",
                                    str(tmp_path / "root"), "--store", str(tmp_path / "s.zarr"), "--no-check-files"])
    assert res.exit_code == 1
    assert f"{ann}: annotations[1]: field 'caption' must be a string, got None" in res.output


def test_sman_on_a_vector_set_names_the_fix(tmp_path):
    store = _store(tmp_path)
    _fill(store, "vgg19_fne", kind="fne")
    res = CliRunner().invoke(main, ["train", "--store", str(store.path), "--features", "vgg19_fne", "--model",
                                    "sman", "--out", str(tmp_path / "run")])
    assert res.exit_code == 1
    assert "--model sman reads a grid set (`vsekit extract --kind grid`" in res.output
    assert "check --model-arg" not in res.output and not (tmp_path / "run").exists()


def test_resume_refusal_names_only_options_train_has():
    from vsekit.cli.train import train_cmd
    from vsekit.train.trainer import RESUMABLE, option_name

    names = {o for p in train_cmd.params for o in [*p.opts, *p.secondary_opts]}
    assert {option_name(k) for k in RESUMABLE} <= names   # --eval-batch included


def test_summaries_say_what_is_true():
    from vsekit.fne.derived import Result
    from vsekit.tokenize.runner import TokenizeSummary

    text = Result("feat", "feat.z", rows=10, failed_rows=0, blocks_written=1, blocks_total=1).summary()
    assert "failed" not in text
    text = Result("feat", "feat.z", rows=10, failed_rows=2, blocks_written=1, blocks_total=1,
                  details={"zero_std_features": 7}).summary()
    assert "(2 failed in the parent, left failed)" in text and "zero std features 7 (features constant" in text
    s = TokenizeSummary(store="s", captions=20, tokens=315, vocabulary=40, vocab_splits=["train"], vocab_captions=20,
                        empty=0, truncated=0, unknown=147, min_count=4)
    assert "<unk> tokens: 147 of 315 (47%: words seen fewer than --min-count 4 times in train are <unk>" in str(s)


def test_train_reports_one_epoch_in_the_singular(monkeypatch, tmp_path):
    import vsekit.train as train_mod

    store = _store(tmp_path)
    _fill(store, "g")
    monkeypatch.setattr(train_mod, "train", lambda *a, **k: {"model": "vse", "epochs": 1, "best_rsum": 1.0,
                                                              "best_epoch": 1, "untrained_rsum": 0.5, "out": "o"})
    res = CliRunner().invoke(main, ["train", "--store", str(store.path), "--features", "g", "--model", "vse",
                                    "--out", str(tmp_path / "run")])
    assert res.exit_code == 0, res.output
    assert "trained vse for 1 epoch: best val rsum" in res.output


def test_unknown_models_get_a_suggestion(tmp_path):
    store = _store(tmp_path)
    _fill(store, "g")
    res = CliRunner().invoke(main, ["train", "--store", str(store.path), "--features", "g", "--model", "smna",
                                    "--out", str(tmp_path / "run")])
    assert res.exit_code == 1 and "--model 'smna': unknown model; did you mean 'sman'?" in res.output
    # extract's backbone error, as the engine raises it, gets the suggestion in the CLI's Error: line
    msg = improve_message("unknown model 'vgg91'; valid choices: inception_resnet_v2, resnet152, vgg16, vgg19 "
                          "or any timm model name (see timm.list_models())")
    assert "did you mean 'vgg19' or 'vgg16'?" in msg


def test_a_bad_model_is_one_error_line_in_train_and_extract_and_timm_names_are_suggested(tmp_path):
    """Issue 34, item 5: `train --model vsepp` printed a Click usage block, extract one Error: line;
    `--model resnet81` was offered vsekit's four backbones, not timm's resnet18."""
    store = _store(tmp_path)
    _fill(store, "g")
    train = CliRunner().invoke(main, ["train", "--store", str(store.path), "--features", "g", "--model", "vsepp",
                                      "--out", str(tmp_path / "run")])
    extract = CliRunner().invoke(main, ["extract", "--store", str(store.path), "--model", "resnet81",
                                        "--kind", "global", "--weights", "none"])
    for res in (train, extract):
        assert res.exit_code == 1, res.output
        lines = [line for line in res.output.splitlines() if line.strip()]
        assert len(lines) == 1 and lines[0].startswith("Error: --model '"), res.output   # no Usage: block
        assert "unknown model; did you mean" in lines[0] and "(valid choices: " in lines[0]
    assert "did you mean 'vse'" in train.output
    assert "did you mean 'resnet18'" in extract.output and "any timm model name" in extract.output
    assert not (tmp_path / "run").exists()


def test_a_mistyped_option_ranks_the_closest_first():
    res = CliRunner().invoke(main, ["extract", "--modle", "vgg19"])
    assert res.exit_code == 1
    assert "Did you mean '--model'?" in res.output or "Did you mean one of: '--model', " in res.output, res.output


def test_counts_of_one_are_singular(tmp_path):
    """Issue 34, item 5: "ran 1 blocks", "1 failed rows", "1 stages"."""
    from vsekit.extract.runner import ExtractResult
    from vsekit.fne.derived import Result
    from vsekit.storage.interop import export_precomp

    text = ExtractResult("x", n_rows=1, done=1, failed=0, pending=0, blocks_run=1, blocks_skipped=0, seconds=1.0,
                         images=1).summary()
    assert "pending of 1 row; ran 1 block, skipped 0 already done" in text
    assert "wrote 1 of 1 block" in Result("f", "f.z", rows=3, failed_rows=0, blocks_written=1, blocks_total=1).summary()
    store = _store(tmp_path)
    fs = _fill(store, "g")
    status = np.asarray(fs.status[:]).copy()
    status[2] = 2
    fs.status[:] = status
    with pytest.raises(StoreError, match=r"'g' has 1 failed row; first: row 2 \(id 2\): no reason recorded\. "):
        export_precomp(store, "g", tmp_path / "o", layout="vsepp", captions_per_image=1)
    (tmp_path / "p.yaml").write_text("pipelines:\n  one:\n    description: d\n    stages:\n"
                                     f"      - {{stage: info, store: {store.path}}}\n")
    res = CliRunner().invoke(main, ["run", "one", "--file", str(tmp_path / "p.yaml")])
    assert res.exit_code == 0 and "pipeline one: 1 stage ran, 0 skipped" in res.output, res.output
    res = CliRunner().invoke(main, ["run", "one", "--file", str(tmp_path / "p.yaml"), "--dry-run"])
    assert "pipeline one: 1 of 1 stage would run" in res.output, res.output
