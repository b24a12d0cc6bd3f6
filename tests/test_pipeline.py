"""vsekit run / pipelines.yaml: validation with lines, skipping, reruns, --from, --dry-run, resume.

The executor is exercised with the real ``demo-data``, ``ingest`` and ``info`` commands plus small
test-only ``extract`` / ``standardize`` / ``evaluate`` commands that write real feature sets and
run folders (and log each row block they compute), so what ran is checked on disk.
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import click
import numpy as np
import pytest
from click.testing import CliRunner

from vsekit.cli import VsekitGroup, main
from vsekit.cli.ingest import ingest
from vsekit.cli.store import demo_data, info
from vsekit.extract import default_name
from vsekit.pipeline import PipelineError, load_file, metrics_table, resolve_pipeline, run
from vsekit.storage import FeatureStore, StoreError

REPO = Path(__file__).resolve().parents[1]


# a test-only CLI: real demo-data/ingest/info + toy stages that write real feature sets ------------
def _log(path: str, entry: dict) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(entry) + "\n")


@click.command("extract")
@click.option("--store", required=True, type=click.Path(exists=True, file_okay=False))
@click.option("--model", required=True, type=click.Choice(["toy", "toy2"]))
@click.option("--kind", default="global", type=click.Choice(["global", "fne"]))
@click.option("--name", default=None)
@click.option("--scale", default=1.0, type=float)
@click.option("--crops", default=1, type=click.Choice(["1", "5", "10"]))
@click.option("--taps", multiple=True)
@click.option("--fail-after", default=0, type=int, help="Crash after this many blocks (0: never).")
@click.option("--overwrite", is_flag=True)
@click.option("--cluster", default=None)
@click.option("--log", "log_path", required=True, type=click.Path())
def toy_extract(store, model, kind, name, scale, crops, taps, fail_after, overwrite, cluster, log_path):
    st = FeatureStore.open(store, "r+")
    name = name or default_name(model, kind)
    fs = st.create_features(name, (3,), "float32", attrs={"kind": kind, "model": model, "scale": scale},
                            block_rows=4, overwrite=overwrite)
    for n, block in enumerate(fs.pending_blocks()):
        if fail_after and n == fail_after:
            raise StoreError(f"simulated crash in block {block.index}")
        rows = np.arange(block.start, block.stop, dtype=np.float32)[:, None]
        fs.write_block(block, (rows + np.arange(3, dtype=np.float32)) * scale)
        _log(log_path, {"cmd": "extract", "name": name, "block": block.index, "cluster": cluster})


@click.command("standardize")
@click.option("--store", required=True, type=click.Path(exists=True, file_okay=False))
@click.option("--features", required=True)
@click.option("--overwrite", is_flag=True)
@click.option("--log", "log_path", required=True, type=click.Path())
def toy_standardize(store, features, overwrite, log_path):
    st = FeatureStore.open(store, "r+")
    src = st.features(features, complete=True)
    x = src.data[:]
    out = st.create_features(f"{features}.z", (3,), "float32", attrs={"kind": "global"}, block_rows=4,
                             parent=features, overwrite=overwrite)
    for block in out.blocks():
        out.write_block(block, x[block.start:block.stop] - x.mean(0))
    _log(log_path, {"cmd": "standardize", "name": f"{features}.z"})


@click.command("evaluate")
@click.argument("runs", nargs=-1, required=True, type=click.Path(file_okay=False))
@click.option("--protocol", default="1k", type=click.Choice(["1k", "coco-1k", "coco-5k"]))
@click.option("--log", "log_path", required=True, type=click.Path())
def toy_evaluate(runs, protocol, log_path):
    run_dir = Path(runs[0])
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "metrics.json").write_text(json.dumps(
        {protocol: {"i2t": {"r1": 10.0, "r5": 30.0}, "t2i": {"r1": 5.0, "r5": 20.0}, "rsum": 65.0}}))
    _log(log_path, {"cmd": "evaluate", "runs": list(runs)})


def _group() -> click.Group:
    @click.group(cls=VsekitGroup)
    def cli():
        pass

    for cmd in (demo_data, ingest, info, toy_extract, toy_standardize, toy_evaluate):
        cli.add_command(cmd)
    return cli


TOY = """\
variables:
  OUT: {out}
pipelines:
  toy:
    description: a toy pipeline
    defaults:
      store: ${{OUT}}/s.zarr
      log: ${{OUT}}/log.jsonl
    stages:
      - stage: demo-data
        out_dir: ${{OUT}}/data
        images: 10
        size: 32
      - stage: ingest karpathy
        json_path: ${{OUT}}/data/dataset_demo.json
      - stage: extract
        id: feats
        model: toy
        name: toy
        scale: {scale}
      - stage: standardize
        features: toy
      - stage: evaluate
        runs: ["${{OUT}}/run"]
"""


def _write(tmp_path: Path, text: str, name: str = "p.yaml") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


def _toy(tmp_path: Path, scale: float = 1.0) -> Path:
    return _write(tmp_path, TOY.format(out=tmp_path / "out", scale=scale))


def _events(tmp_path: Path) -> list[dict]:
    log = tmp_path / "out" / "log.jsonl"
    if not log.exists():
        return []
    events = [json.loads(x) for x in log.read_text().splitlines()]
    log.unlink()
    return events


def _run(path: Path, name: str = "toy", **kw):
    lines: list[str] = []
    result = run(name, file=str(path), cli=_group(), echo=lines.append, env={}, **kw)
    return result, "\n".join(lines)


# validation -------------------------------------------------------------------------------------
def _resolve(tmp_path: Path, text: str, name: str = "p", **kw):
    pf = load_file(_write(tmp_path, text))
    return resolve_pipeline(pf.get(name), _group(), env={}, **kw)


HEAD = """\
pipelines:
  p:
    stages:
      - stage: demo-data
        out_dir: d
"""


@pytest.mark.parametrize("tail, line, message", [
    ("      - stage: extrct\n", 6, r"unknown stage 'extrct'; valid choices: demo-data, evaluate, extract"),
    ("      - stage: ingest\n        store: s\n", 6, r"stage 'ingest' needs a subcommand.*karpathy"),
    ("      - stage: ingest karpathy\n        store: s.zarr\n        json_path: d/x.json\n"
     "        image_rooot: d\n", 9, r"unknown option 'image_rooot' for `vsekit ingest karpathy`; valid: .*image-root"),
    ("      - stage: demo-data\n        id: again\n        out_dir: e\n        images: many\n",
     9, r"option 'images' of `vsekit demo-data`: .*'many' is not a valid integer"),
    ("      - stage: demo-data\n        id: again\n        out_dir: e\n        images: 2.5\n",
     9, r"option 'images'.*expects an integer"),
    ("      - stage: extract\n        store: s\n        log: l\n        model: resnet\n",
     9, r"option 'model' of `vsekit extract`: .*'resnet' is not one of 'toy', 'toy2'"),
    ("      - stage: extract\n        store: s\n        log: l\n        model: toy\n        taps: {a: 1}\n",
     10, r"option 'taps'.*expects a single value"),
    ("      - stage: ingest karpathy\n        store: s.zarr\n        json_path: ${DATA_ROOT}/x.json\n",
     8, r"variable \$\{DATA_ROOT\} is not set; set it in the environment, with `--set DATA_ROOT=VALUE`"),
    ("      - stage: standardize\n        store: s.zarr\n        log: l\n        features: vgg19\n",
     9, r"--features 'vgg19': no earlier stage makes this feature set in .*s.zarr; earlier stages make: none"),
    ("      - stage: extract\n        store: s\n        log: l\n", 6, r"needs the option 'model'"),
    ("      - stage: demo-data\n        out_dir: e\n        out_dir: f\n", 8, r"key 'out_dir' is given twice"),
    ("      - stage: demo-data\n        id: demo-data\n        out_dir: e\n", 7,
     r"id 'demo-data' is already used by stage 1"),
])
def test_validation_errors_name_pipeline_stage_and_line(tmp_path, tail, line, message):
    with pytest.raises(PipelineError) as exc:
        _resolve(tmp_path, HEAD + tail)
    text = str(exc.value)
    assert text.startswith(f"{tmp_path / 'p.yaml'}, line {line}:"), text
    if "twice" not in message:
        assert "pipeline 'p', stage 2" in text, text
    import re
    assert re.search(message, text), text


def test_feature_reference_must_come_from_an_earlier_stage(tmp_path):
    text = """\
    pipelines:
      p:
        defaults: {store: s.zarr, log: l}
        stages:
          - stage: extract
            model: toy
            kind: fne
          - stage: standardize
            features: toy_fne
          - stage: standardize
            id: again
            features: toy_fne.z
          - stage: standardize
            id: late
            features: toy
    """
    with pytest.raises(PipelineError, match=r"line 15: pipeline 'p', stage 4 \(late\): --features 'toy': "
                                            r"no earlier stage makes.*earlier stages make: toy_fne, toy_fne.z, "
                                            r"toy_fne.z.z$"):
        _resolve(tmp_path, text)
    # the same references in a valid order resolve; made names follow the commands' own defaults
    stages = _resolve(tmp_path, text.replace("features: toy\n", "features: toy_fne\n"))
    assert [s.io.makes[0][1] for s in stages] == ["toy_fne", "toy_fne.z", "toy_fne.z.z", "toy_fne.z"]


def test_defaults_anchors_variables_and_flags_build_the_cli_argv(tmp_path):
    text = """\
    variables:
      ROOT: /data
      STORE: ${ROOT}/coco.zarr
    defaults:
      store: ${STORE}
      log: ${LOGDIR:-/tmp}/l.jsonl
      extract: {crops: 10}
    x-common: &common
      model: toy
      kind: fne
    pipelines:
      p:
        stages:
          - stage: ingest karpathy
            json_path: ${ROOT}/karpathy.json
            keep_restval: true
            no_check_files: true
          - stage: extract
            <<: *common
            taps: [conv1, conv2]
            crops: 5
    """
    with pytest.raises(PipelineError, match=r"line 8: unknown top-level key 'common'"):
        _resolve(tmp_path, text.replace("x-common:", "common:"))
    stages = _resolve(tmp_path, text, sets={"ROOT": "/elsewhere"}, cluster="local:2")
    ingest_argv, extract_argv = (s.argv() for s in stages)
    assert ingest_argv == ["ingest", "karpathy", "--store", "/elsewhere/coco.zarr", "--keep-restval",
                           "--no-check-files", "--", "/elsewhere/karpathy.json"]
    assert extract_argv[:1] == ["extract"]
    pairs = list(zip(extract_argv[1::2], extract_argv[2::2]))
    assert ("--crops", "5") in pairs and ("--crops", "10") not in pairs     # the stage wins over defaults
    assert ("--taps", "conv1") in pairs and ("--taps", "conv2") in pairs    # multiple=True
    assert ("--cluster", "local:2") in pairs                                # only where accepted
    assert ("--model", "toy") in pairs and ("--kind", "fne") in pairs       # from the YAML anchor
    assert ("--log", "/tmp/l.jsonl") in pairs                               # ${VAR:-default}
    assert "--cluster" not in ingest_argv


# running ----------------------------------------------------------------------------------------
def test_second_run_skips_everything_and_changed_option_reruns_downstream(tmp_path):
    path = _toy(tmp_path)
    result, out = _run(path)
    assert result.ran == ["demo-data", "ingest-karpathy", "feats", "standardize", "evaluate"]
    assert [e["cmd"] for e in _events(tmp_path)] == ["extract"] * 3 + ["standardize", "evaluate"]
    store = FeatureStore.open(tmp_path / "out" / "s.zarr")
    z = store.features("toy.z").data[:]
    rows = np.arange(10, dtype=np.float32)[:, None] + np.arange(3)
    np.testing.assert_allclose(z, rows - rows.mean(0))
    assert store.features("toy").attrs["pipeline"]["toy/feats"]["stage"] == "feats"
    assert "run      " in out and "65.00" in out          # the metrics table of the evaluated run

    result, out = _run(path)
    assert result.ran == [] and len(result.skipped) == 5
    for sid in ("demo-data", "ingest-karpathy", "feats", "standardize", "evaluate"):
        assert f"skip {sid}: up to date" in out
    assert _events(tmp_path) == []
    assert "65.00" in out                                 # the table is printed even when all skip

    # a changed option reruns that stage (replacing its stale output) and everything after it
    path = _toy(tmp_path, scale=2.0)
    result, out = _run(path)
    assert result.ran == ["feats", "standardize", "evaluate"]
    assert result.skipped == ["demo-data", "ingest-karpathy"]
    assert "feats: its options or inputs changed" in out and "--overwrite" in out
    assert "standardize: an earlier stage (feats) runs" in out
    np.testing.assert_allclose(FeatureStore.open(tmp_path / "out" / "s.zarr").features("toy").data[:], rows * 2)


def test_from_and_force(tmp_path):
    path = _toy(tmp_path)
    _run(path)
    _events(tmp_path)
    result, out = _run(path, from_stage="standardize")
    assert result.ran == ["standardize", "evaluate"]
    assert "skip feats: before --from standardize" in out
    assert [e["cmd"] for e in _events(tmp_path)] == ["standardize", "evaluate"]
    result, _ = _run(path, from_stage="3")
    assert result.ran == ["feats", "standardize", "evaluate"]
    with pytest.raises(PipelineError, match=r"--from 'nope': no such stage; valid: demo-data, "):
        _run(path, from_stage="nope")
    result, _ = _run(path, force=True)
    assert len(result.ran) == 5


def test_dry_run_prints_the_plan_and_changes_nothing(tmp_path):
    path = _toy(tmp_path)
    result, out = _run(path, dry_run=True)
    assert not (tmp_path / "out").exists()
    assert "pipeline toy: 5 of 5 stages would run" in out
    assert "run  demo-data: its output does not exist yet" in out
    # a first run: every stage runs because its output does not exist, not "because an earlier one runs"
    assert "run  feats: its output does not exist yet" in out and "an earlier stage" not in out
    assert f"vsekit ingest karpathy --store {tmp_path}/out/s.zarr" in out
    _run(path)
    _toy(tmp_path, scale=3.0)
    result, out = _run(path, dry_run=True)
    assert "pipeline toy: 3 of 5 stages would run" in out
    assert "skip ingest-karpathy: up to date" in out
    assert "run  feats: its options or inputs changed" in out
    assert "--scale 3.0" in out and "--overwrite" in out
    assert _events(tmp_path)[-1]["cmd"] == "evaluate"       # only the real run wrote the log
    assert np.all(FeatureStore.open(tmp_path / "out" / "s.zarr").features("toy").data[:, 0]
                  == np.arange(10))


def test_interrupted_run_resumes_by_row_block(tmp_path):
    path = _toy(tmp_path)
    text = path.read_text().replace("        scale: 1.0\n", "        scale: 1.0\n        fail_after: ${FAIL:-0}\n")
    path.write_text(text)
    lines: list[str] = []
    with pytest.raises(PipelineError, match=r"(?s)stage 3 \(feats\) failed: simulated crash in block 2.*"
                                            r"rerun `vsekit run toy`"):
        run("toy", file=str(path), cli=_group(), echo=lines.append, env={}, sets={"FAIL": "2"})
    assert [e.get("block") for e in _events(tmp_path)] == [0, 1]   # blocks 0 and 1 were written
    fs = FeatureStore.open(tmp_path / "out" / "s.zarr").features("toy")
    assert fs.counts() == {"pending": 2, "done": 8, "failed": 0}
    assert "pipeline" not in fs.attrs                    # no record: the stage did not finish
    # the rerun skips the finished stages and resumes the extraction at block 2 (its output has
    # no record, so it is not stale: no --overwrite)
    result, out = _run(path)
    assert result.skipped == ["demo-data", "ingest-karpathy"]
    assert "feats: its output is incomplete: resuming" in out
    assert "--overwrite" not in out.split("feats: its output")[1].split("\n")[1]
    assert [(e["cmd"], e.get("block")) for e in _events(tmp_path)] == [
        ("extract", 2), ("standardize", None), ("evaluate", None)]
    rows = np.arange(10, dtype=np.float32)[:, None] + np.arange(3)
    np.testing.assert_allclose(FeatureStore.open(tmp_path / "out" / "s.zarr").features("toy").data[:], rows)


def test_deleted_output_reruns_its_stage(tmp_path):
    path = _toy(tmp_path)
    _run(path)
    import shutil
    shutil.rmtree(tmp_path / "out" / "run")
    result, out = _run(path)
    assert result.ran == ["evaluate"] and "evaluate: its output does not exist yet" in out


def test_cli_list_dry_run_and_errors(tmp_path, monkeypatch):
    path = _write(tmp_path, """\
    pipelines:
      small:
        description: demo data and a store
        stages:
          - stage: demo-data
            out_dir: ${OUT}/data
            images: 6
            size: 32
          - stage: ingest karpathy
            json_path: ${OUT}/data/dataset_demo.json
            store: ${OUT}/s.zarr
          - stage: info
            store: ${OUT}/s.zarr
    """)
    runner = CliRunner()
    res = runner.invoke(main, ["run", "--list", "--file", str(path)])
    assert res.exit_code == 0 and runner.invoke(main, ["run", "--file", str(path)]).output.startswith(res.output)
    assert res.exit_code == 0 and "small" in res.output and "3 stages  demo data and a store" in res.output
    res = runner.invoke(main, ["run", "small", "--file", str(path)])
    assert res.exit_code == 1
    assert f"Error: {path}, line 6: pipeline 'small', stage 1 (demo-data): variable ${{OUT}} is not set" in res.output
    monkeypatch.setenv("OUT", str(tmp_path / "env"))
    res = runner.invoke(main, ["run", "small", "--file", str(path), "--set", f"OUT={tmp_path / 'o'}"])
    assert res.exit_code == 0, res.output
    assert (tmp_path / "o" / "s.zarr" / "zarr.json").exists() and not (tmp_path / "env").exists()
    res = runner.invoke(main, ["run", "small", "--file", str(path), "--set", f"OUT={tmp_path / 'o'}"])
    assert res.exit_code == 0 and "skip ingest-karpathy: up to date" in res.output
    assert "info: makes no recorded output" in res.output
    res = runner.invoke(main, ["run", "nope", "--file", str(path)])
    assert res.exit_code == 1 and "no pipeline 'nope'; valid choices: " in res.output and ", small" in res.output


def test_metrics_table_flattens_and_aligns(tmp_path):
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps({"i2t": {"r1": 1.0, "r5": 2.5}, "rsum": 9.0, "note": "x"}))
    b.write_text(json.dumps({"i2t": {"r1": 3.0, "r5": 4.0}, "rsum": 12.0}))
    table = metrics_table([("alpha", a), ("beta-model", b), ("gone", tmp_path / "c.json")]).splitlines()
    assert table[0].split() == ["run", "i2t", "r1", "i2t", "r5", "rsum"]
    assert table[2].split() == ["alpha", "1.00", "2.50", "9.00"]
    assert table[3].split() == ["beta-model", "3.00", "4.00", "12.00"]
    assert table[4].split() == ["gone", "-", "-", "-"]


# the real recipes ---------------------------------------------------------------------------------
def _recipe_env(tmp_path: Path) -> dict[str, str]:
    return {"COCO_ROOT": str(tmp_path / "coco"), "F30K_ROOT": str(tmp_path / "f30k"),
            "BUTD_TSV": str(tmp_path / "butd" / "*.tsv"), "STORE_DIR": str(tmp_path / "stores"),
            "RUNS_DIR": str(tmp_path / "runs"), "DEMO_DIR": str(tmp_path / "demo")}


RECIPES = ["coco-fne-vgg16", "coco-seam-irv2", "coco-seam-vgg19", "f30k-sman-r152", "coco-sgraf-butd", "demo"]


def test_pipelines_yaml_has_the_recipes():
    pf = load_file(REPO / "pipelines.yaml")
    assert set(RECIPES) <= set(pf.pipelines)


@pytest.mark.parametrize("name", RECIPES)
def test_every_recipe_validates_against_the_real_cli_and_dry_runs(tmp_path, name):
    lines: list[str] = []
    from vsekit.cli import main

    result = run(name, cli=main, file=str(REPO / "pipelines.yaml"), env=_recipe_env(tmp_path), dry_run=True,
                 echo=lines.append)
    assert all(s.action == "run" for s in result.steps)
    assert len(lines) == 1 + 2 * len(result.steps)
    assert not (tmp_path / "stores").exists() and not (tmp_path / "demo").exists()


def test_metrics_table_uses_the_papers_layout_for_evaluate_results(tmp_path):
    m = {f"{d}_{k}": v for d in ("i2t", "t2i") for k, v in
         (("r1", 12.5), ("r5", 40.0), ("r10", 60.0), ("medr", 8.0), ("meanr", 20.0), ("mrr", 0.25))}
    m["rsum"] = 225.0
    path = tmp_path / "metrics.json"
    path.write_text(json.dumps({"runs": ["r"], "protocols": {"1k": m}}))
    table = metrics_table([("train-seam", path)])
    row = [line for line in table.splitlines() if line.startswith("train-seam")][0]
    assert row.split()[:3] == ["train-seam", "1k", "|"] and "12.5" in row and row.rstrip().endswith("225.0")


@click.command("train")
@click.option("--store", required=True, type=click.Path(exists=True, file_okay=False))
@click.option("--features", required=True)
@click.option("--out", required=True, type=click.Path(file_okay=False))
@click.option("--epochs", default=2, type=int)
@click.option("--crash-at", default=0, type=int)
@click.option("--resume", is_flag=True)
@click.option("--overwrite", is_flag=True)
@click.option("--log", "log_path", required=True, type=click.Path())
def toy_train(store, features, out, epochs, crash_at, resume, overwrite, log_path):
    out = Path(out)
    last = out / "checkpoint_last.pt"
    if last.exists() and not (resume or overwrite):
        raise StoreError(f"{out} already holds a training run; pass --resume or --overwrite")
    start = int(last.read_text()) if resume else 0
    out.mkdir(parents=True, exist_ok=True)
    for epoch in range(start + 1, epochs + 1):
        if epoch == crash_at:
            raise StoreError(f"simulated crash in epoch {epoch}")
        last.write_text(str(epoch))
        _log(log_path, {"cmd": "train", "epoch": epoch, "resume": resume, "overwrite": overwrite})


def test_interrupted_training_resumes_from_its_checkpoint_and_changed_one_restarts(tmp_path):
    path = _toy(tmp_path)
    text = path.read_text() + ("      - stage: train\n        features: toy.z\n        out: ${OUT}/train\n"
                               "        epochs: ${EPOCHS:-3}\n        crash_at: ${CRASH:-0}\n")
    path.write_text(text)
    cli = _group()
    cli.add_command(toy_train)
    with pytest.raises(PipelineError, match="simulated crash in epoch 3"):
        run("toy", file=str(path), cli=cli, echo=lambda s: None, env={"CRASH": "3"})
    assert [(e["epoch"], e["resume"]) for e in _events(tmp_path) if e["cmd"] == "train"] == [(1, False), (2, False)]
    lines: list[str] = []
    result = run("toy", file=str(path), cli=cli, echo=lines.append, env={})
    assert result.ran == ["train"]
    assert "--resume" in "\n".join(lines) and "--overwrite" not in "\n".join(lines)
    assert [(e["epoch"], e["resume"]) for e in _events(tmp_path)] == [(3, True)]
    # a changed option restarts the run with --overwrite
    result = run("toy", file=str(path), cli=cli, echo=lines.append, env={"EPOCHS": "4"})
    assert result.ran == ["train"]
    assert [(e["epoch"], e["overwrite"]) for e in _events(tmp_path)] == [(1, True), (2, True), (3, True), (4, True)]


def test_unset_variables_of_other_pipelines_do_not_block_this_one(tmp_path):
    path = _write(tmp_path, f"""\
    pipelines:
      mine:
        stages:
          - {{stage: demo-data, out_dir: "{tmp_path}/d", images: 4, size: 16}}
      theirs:
        stages:
          - {{stage: demo-data, out_dir: "${{COCO_ROOT}}/d", images: many}}
    """)
    with pytest.raises(PipelineError, match=r"line 7: pipeline 'theirs', stage 1 \(demo-data\): option 'images'"):
        _run(path, "mine")      # a wrong type anywhere in the file stops every run
    path.write_text(path.read_text().replace("images: many", "images: 4"))
    result, _ = _run(path, "mine")
    assert result.ran == ["demo-data"] and (tmp_path / "d" / "dataset_demo.json").exists()
    with pytest.raises(PipelineError, match=r"line 7: .*variable \$\{COCO_ROOT\} is not set"):
        _run(path, "theirs")


def test_defaults_that_apply_nowhere_are_errors(tmp_path):
    stages = HEAD.split("\n", 2)[2]        # the stages: block of HEAD
    with pytest.raises(PipelineError, match=r"line 4: pipeline 'p': default 'stroe' is an option of none"):
        _resolve(tmp_path, "pipelines:\n  p:\n    defaults:\n      stroe: s.zarr\n" + stages)
    with pytest.raises(PipelineError, match=r"line 4: pipeline 'p': defaults: 'trian' is not a command"):
        _resolve(tmp_path, "pipelines:\n  p:\n    defaults:\n      trian: {epochs: 2}\n" + stages)


def test_fingerprint_ignores_where_a_stage_runs_but_not_its_input_files(tmp_path):
    from vsekit.pipeline import fingerprint

    path = _toy(tmp_path)
    spec = load_file(path).get("toy")
    plain_fps = [fingerprint(s, "") for s in resolve_pipeline(spec, _group(), env={})]
    clustered = resolve_pipeline(spec, _group(), env={}, cluster="local:3")
    assert (clustered[2].values["cluster"].kind, clustered[2].values["cluster"].n) == ("local", 3)   # parsed once
    assert "--cluster" in clustered[2].argv()
    assert [fingerprint(s, "") for s in clustered] == plain_fps
    _run(path)
    result, out = _run(path)
    assert result.ran == []
    # the Karpathy JSON the ingest stage reads changes on disk: ingest and everything after it rerun
    json_path = tmp_path / "out" / "data" / "dataset_demo.json"
    json_path.write_text(json_path.read_text().replace("a picture of", "a photo of"))
    result, out = _run(path)
    assert result.ran == ["ingest-karpathy", "feats", "standardize", "evaluate"]
    assert "ingest-karpathy: its options or inputs changed" in out


def test_stage_outputs_are_named_by_the_stages_themselves(monkeypatch):
    """The pipeline asks each stage what it writes: the names follow the stage's own rule (changing
    the rule in the stage changes what the pipeline expects), and extract's default is MODEL_KIND."""
    import importlib

    from vsekit.pipeline.outputs import stage_io

    # the modules (vsekit.fne's attributes of these names are the stage functions)
    standardize, discretize, combined = (importlib.import_module(f"vsekit.fne.{m}")
                                         for m in ("standardize", "discretize", "combined"))

    def made(command, **values):
        return [name for _, name in stage_io(command, {"store": "s.zarr", **values}, lambda k: None).makes]

    assert made("extract", model="vgg19", kind="grid") == ["vgg19_grid"]
    assert made("extract", model="vgg19") == ["vgg19_global"]
    assert made("standardize", features="f") == ["f.z"] == [standardize.output_name("f")]
    assert made("discretize", features="f.z") == ["f.z.fne"] == [discretize.output_name("f.z")]
    assert made("fne", features="f") == ["f.z", "f.z.fne"] == list(combined.output_names("f"))
    assert made("standardize", features="f", name="mine") == ["mine"]
    monkeypatch.setattr(standardize, "output_name", lambda features, name=None: name or f"{features}.std")
    monkeypatch.setattr(discretize, "output_name", lambda features, name=None: name or f"{features}.q")
    assert made("standardize", features="f") == ["f.std"]
    assert made("fne", features="f") == ["f.std", "f.std.q"]


def test_stages_run_as_functions_with_typed_values_not_through_the_command_line(tmp_path, monkeypatch):
    """Before: each stage was run by `cli.main(args=argv)`, its values turned back into text and parsed
    again. Now the stage's command function is called with the typed values; no command line is parsed."""
    parsed: list[list[str]] = []
    real = click.Command.parse_args

    def spy(self, ctx, args):
        if args:
            parsed.append(list(args))
        return real(self, ctx, args)

    monkeypatch.setattr(click.Command, "parse_args", spy)
    path = _toy(tmp_path)
    result, _out = _run(path)
    assert result.ran == ["demo-data", "ingest-karpathy", "feats", "standardize", "evaluate"]
    assert parsed == []
