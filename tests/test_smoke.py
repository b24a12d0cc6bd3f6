"""`vsekit run RECIPE --smoke` and the work `--dry-run` prints (issue 34, item 4).

Before the issue a shipped recipe ran on small data only with symlinks for COCO_ROOT and five
`-o` overrides, and `--dry-run` said nothing of a recipe's cost. The plan of every shipped recipe is
checked here in seconds; one full smoke run of each recipe is marked slow.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from vsekit.cli import main
from vsekit.pipeline.executor import load_pipelines
from vsekit.pipeline.smoke import plan_smoke, write_butd_tsv

REPO = Path(__file__).resolve().parents[1]
RECIPES = [n for n, p in load_pipelines(str(REPO / "pipelines.yaml")).pipelines.items()]


@pytest.mark.parametrize("recipe", RECIPES)
def test_smoke_dry_run_of_every_recipe_says_what_it_shrinks_and_writes_nothing(recipe, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    res = CliRunner().invoke(main, ["run", recipe, "--smoke", "--dry-run"])
    assert res.exit_code == 0, res.output
    out = res.output
    assert out.startswith(f"--smoke: {recipe} on 40 synthetic images") and "figures mean nothing" in out
    assert not (tmp_path / "vsekit-smoke").exists()   # a dry run writes nothing
    # every extraction gets random weights and a small input; every training one epoch at batch 16
    for line in out.splitlines():
        if line.strip().startswith("vsekit extract"):
            assert "--weights none" in line and re.search(r"--input-size (32|64|96|128|224)\b", line), line
        if line.strip().startswith("vsekit train"):
            assert "--epochs 1 " in line and "--batch-size 16" in line, line
    work = out[out.index("work each stage implies:"):]
    for line in work.splitlines()[1:]:
        if " train-" in line:
            assert re.search(r": 1 epoch x \d+ steps? \(\d+ train pairs per epoch, batch 16\)", line), line


def test_dry_run_prints_the_full_recipes_work_from_the_known_split_sizes(tmp_path):
    res = CliRunner().invoke(main, ["run", "coco-fne-vgg16", "--dry-run", "--set", f"COCO_ROOT={tmp_path / 'coco'}",
                                    "--set", f"STORE_DIR={tmp_path}/s", "--set", f"RUNS_DIR={tmp_path}/r"])
    assert res.exit_code == 0, res.output
    out = res.output
    assert "(sizes of dataset_coco.json assumed:" in out
    n = 82_783 + 30_504 + 5_000 + 5_000
    assert f"extract: {n:,} images x 10 crops = {n * 10:,} forward passes of vgg16 (fne" in out
    steps = -(-82_783 // 128)   # one caption per image per epoch (the FNE presets), batch 128
    assert f"train-sh: 200 epochs x {steps:,} steps (82,783 train pairs per epoch, batch 128) = " \
           f"{200 * steps:,} steps of vse" in out
    assert "eval-poe: 5,000 test images x 25,000 captions scored" in out


def test_dry_run_counts_come_from_the_karpathy_json_when_it_is_there(tmp_path):
    root = tmp_path / "coco"
    root.mkdir()
    images = [{"filename": f"{i}.jpg", "imgid": i, "split": s, "sentences": [{"raw": "a"}] * (1 + i % 2)}
              for i, s in enumerate(["train"] * 7 + ["restval"] * 3 + ["val"] * 2 + ["test"] * 2)]
    (root / "dataset_coco.json").write_text(json.dumps({"images": images}))
    res = CliRunner().invoke(main, ["run", "coco-seam-vgg19", "--dry-run", "--set", f"COCO_ROOT={root}",
                                    "--set", f"STORE_DIR={tmp_path}/s", "--set", f"RUNS_DIR={tmp_path}/r"])
    assert res.exit_code == 0, res.output
    caps = sum(len(r["sentences"]) for r in images)
    assert f"ingest-karpathy: 14 images, {caps} captions" in res.output
    assert "extract: 14 images x 10 crops = 140 forward passes of vgg19" in res.output
    # restval folded into train (the recipe's restval_as_train); SEAM's presets train on every caption
    from vsekit.train.config import resolve_config

    assert resolve_config(None, ["seam-e"]).captions == "all"
    pairs = sum(len(r["sentences"]) for r in images if r["split"] in ("train", "restval"))
    assert re.search(rf"train-seam-e: \d+ epochs x 1 step \({pairs} train pairs per epoch, batch 128\)", res.output)


def test_smoke_refuses_an_ingest_it_cannot_feed(tmp_path):
    from vsekit.pipeline import PipelineError

    (tmp_path / "p.yaml").write_text("pipelines:\n  mine:\n    stages:\n"
                                     "      - {stage: ingest folder, image_dir: x, captions: y, store: s.zarr}\n")
    pf = load_pipelines(str(tmp_path / "p.yaml"))
    with pytest.raises(PipelineError, match=r"--smoke feeds synthetic data to `ingest karpathy` and `ingest butd`"):
        plan_smoke(pf.get("mine"), main)


def test_the_generated_butd_tsv_is_read_back_by_ingest_butd(tmp_path):
    from vsekit.storage.demo import make_demo_data
    from vsekit.storage.sources.butd import ingest_butd

    js = make_demo_data(tmp_path / "d", images=6, size=32)
    write_butd_tsv(js, tmp_path / "b.tsv", boxes=4, channels=8)
    store, _ = ingest_butd([str(tmp_path / "b.tsv")], tmp_path / "s.zarr", name="butd", dtype="float32")
    fs = store.features("butd")
    assert fs.shape == (6, 4, 8) and np.all(fs.status[:] == 1) and np.all(fs.array("count")[:] == 4)


@pytest.mark.slow
@pytest.mark.parametrize("recipe", RECIPES)
def test_smoke_runs_every_recipe_end_to_end(recipe, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    res = CliRunner().invoke(main, ["run", recipe, "--smoke"])
    assert res.exit_code == 0, res.output
    assert re.search(rf"pipeline {recipe}: \d+ stages ran, 0 skipped", res.output), res.output
    assert "rsum" in res.output   # the metrics table of its evaluations
