"""`vsekit run` reruns of a real `train` stage through the CLI: interrupted, changed, resumed.

Ctrl-C is injected deterministically: the trainer's checkpoint write raises KeyboardInterrupt on a
chosen call. The final weights are compared with an uninterrupted `vsekit train` of the same options.
"""

import json
import shutil
import textwrap

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
    from vsekit.storage.demo import make_demo_data
    from vsekit.storage.sources.karpathy import ingest_karpathy
    from vsekit.tokenize import tokenize
    d = tmp_path_factory.mktemp("pipe")
    make_demo_data(d, images=120, seed=5, size=32, val_fraction=0.2, test_fraction=0.2)
    store, _ = ingest_karpathy(d / "dataset_demo.json", d, d / "s.zarr")
    tokenize(store, min_count=1)
    return str(d / "s.zarr")


def pipeline_file(tmp_path, store):
    path = tmp_path / "pipelines.yaml"
    path.write_text(textwrap.dedent(f"""
        pipelines:
          t:
            description: train and evaluate on pixel features
            stages:
              - stage: extract
                store: {store}
                model: resnet18
                weights: none
                input_size: 32
                resize: 32
                name: feats
                workers: 0
                no_progress: true
              - stage: train
                store: {store}
                features: feats
                model: vse
                preset: [demo]
                embed_dim: 32
                word_dim: 16
                batch_size: 32
                epochs: 3
                lr: ${{LR:-0.002}}
                out: {tmp_path}/run
                no_progress: true
              - stage: evaluate
                runs: [{tmp_path}/run]
                no_progress: true
        """))
    return path


def vrun(path, lr=None, kill_at=None, monkeypatch=None):
    """`vsekit run t`; with ``kill_at`` the nth checkpoint write raises KeyboardInterrupt (Ctrl-C)."""
    args = ["run", "t", "--file", str(path)] + (["--set", f"LR={lr}"] if lr else [])
    if kill_at is None:
        res = CliRunner().invoke(main, args)
        assert res.exit_code == 0, res.output
        return res.output
    real, calls = trainer._save, {"n": 0}

    def dying(*a, **k):
        calls["n"] += 1
        if calls["n"] == kill_at:
            raise KeyboardInterrupt
        return real(*a, **k)

    with monkeypatch.context() as m:
        m.setattr(trainer, "_save", dying)
        res = CliRunner().invoke(main, args)
    assert res.exit_code == 1 and "aborted; rerun `vsekit run t` to resume" in res.output, res.output
    assert "Traceback" not in res.output
    return res.output


def reference(store, out, lr):
    args = ["train", "--store", store, "--features", "feats", "--model", "vse", "--preset", "demo",
            "--embed-dim", "32", "--word-dim", "16", "--batch-size", "32", "--epochs", "3", "--lr", str(lr),
            "--out", str(out), "--no-progress"]
    res = CliRunner().invoke(main, args)
    assert res.exit_code == 0, res.output
    return out


def same_weights(a, b):
    wa = torch.load(a / "checkpoint_last.pt", weights_only=True)["model"]
    wb = torch.load(b / "checkpoint_last.pt", weights_only=True)["model"]
    return all(torch.equal(wa[k], wb[k]) for k in wa)


def train_line(output):
    return next(x for x in output.splitlines() if x.strip().startswith("vsekit train"))


def test_changed_option_then_ctrl_c_then_run_resumes(store_path, tmp_path, monkeypatch):
    """The issue's path: a stage reruns because an option changed, is interrupted, and must resume."""
    path = pipeline_file(tmp_path, store_path)
    vrun(path)
    out = vrun(path, lr="0.001", kill_at=3, monkeypatch=monkeypatch)  # in epoch 2 of the new run
    assert "--overwrite" in train_line(out)
    assert not (tmp_path / "run" / "metrics.json").exists()           # the old run's evaluation is gone
    out = vrun(path, lr="0.001")
    assert "train: its options or inputs changed" not in out, out
    assert "--resume" in train_line(out) and "--overwrite" not in train_line(out)
    assert "resuming" in out and "after epoch 1" in out
    assert same_weights(reference(store_path, tmp_path / "ref", 0.001), tmp_path / "run")
    out = vrun(path, lr="0.001")
    assert "skip train: up to date" in out and "skip evaluate: up to date" in out


def test_first_run_interrupted_then_interrupted_again_while_resuming(store_path, tmp_path, monkeypatch):
    path = pipeline_file(tmp_path, store_path)
    vrun(path, kill_at=2, monkeypatch=monkeypatch)              # epoch 1's last checkpoint never written
    out = vrun(path, kill_at=3, monkeypatch=monkeypatch)        # start again, die in epoch 2
    assert "--overwrite" not in train_line(out)
    out = vrun(path, kill_at=2, monkeypatch=monkeypatch)        # resume, die again
    assert "--resume" in train_line(out)
    out = vrun(path)
    assert "--resume" in train_line(out) and "--overwrite" not in train_line(out)
    assert same_weights(reference(store_path, tmp_path / "ref", 0.002), tmp_path / "run")


def test_interrupted_before_the_overwrite_happened_runs_it_again(store_path, tmp_path, monkeypatch):
    """Killed after the running record was written but before train replaced the old run."""
    path = pipeline_file(tmp_path, store_path)
    vrun(path)
    with monkeypatch.context() as m:
        def die(*a, **k):
            raise KeyboardInterrupt
        m.setattr(trainer, "build_model", die)
        res = CliRunner().invoke(main, ["run", "t", "--file", str(path), "--set", "LR=0.001"])
        assert res.exit_code == 1 and "Traceback" not in res.output
    record = json.loads((tmp_path / "run" / ".vsekit-pipeline.json").read_text())["t/train"]
    assert record["state"] == "running" and record["overwrite"] is True
    out = vrun(path, lr="0.001")
    assert "interrupted before it replaced its old output" in out and "--overwrite" in train_line(out)
    assert same_weights(reference(store_path, tmp_path / "ref", 0.001), tmp_path / "run")


def test_deleted_run_folder_reruns_and_copied_run_is_not_taken_for_current(store_path, tmp_path):
    path = pipeline_file(tmp_path, store_path)
    vrun(path)
    shutil.rmtree(tmp_path / "run")
    out = vrun(path)
    assert "train: its output does not exist yet" in out and "--overwrite" not in train_line(out)


# the recipes ship with the package -----------------------------------------------------------------
def test_packaged_recipes_equal_the_repository_file():
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    assert (repo / "src/vsekit/data/pipelines.yaml").read_bytes() == (repo / "pipelines.yaml").read_bytes()
    import tomllib

    data = tomllib.loads((repo / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["vsekit"]
    assert "data/*" in data


def test_run_list_works_from_an_installed_package(tmp_path):
    """The package alone (as a wheel installs it, no checkout around it): --list, and --file wins."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    import vsekit

    site = tmp_path / "site"
    shutil.copytree(Path(vsekit.__file__).parent, site / "vsekit",
                    ignore=shutil.ignore_patterns("__pycache__"))
    work = tmp_path / "work"
    work.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("VSEKIT_PIPELINES", "PYTHONPATH")}
    env["PYTHONPATH"] = str(site)
    code = "import sys; from vsekit.cli import main; sys.exit(main(sys.argv[1:]))"
    res = subprocess.run([sys.executable, "-c", code, "run", "--list"], cwd=work, env=env,
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    assert f"pipelines in {site / 'vsekit' / 'data' / 'pipelines.yaml'}" in res.stdout and " demo " in res.stdout
    (work / "mine.yaml").write_text("pipelines:\n  only:\n    description: mine\n    stages:\n"
                                    "      - {stage: info, store: x}\n")
    res = subprocess.run([sys.executable, "-c", code, "run", "--list", "--file", "mine.yaml"], cwd=work,
                         env=env, capture_output=True, text=True, timeout=300)
    # the user's file adds its pipelines to the shipped recipes (it used to hide them)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "only              1 stage   mine  [yours]" in res.stdout and " demo " in res.stdout, res.stdout
