"""`vsekit run` reaches every stage option, refuses unknown --set names, adds a user's file to the
shipped recipes, and checks evaluation protocols against the split before anything runs (issue 29, item 1)."""

from __future__ import annotations

import re
import textwrap
from pathlib import Path

import pytest
from click.testing import CliRunner

from vsekit.cli import main
from vsekit.pipeline import PipelineError, run
from vsekit.storage.store import FeatureStore

REPO = Path(__file__).resolve().parents[1]


# end to end (CLI runs, extraction, training, subprocesses): in `make test`, not in `make test-fast`
pytestmark = pytest.mark.e2e


def _recipe_env(tmp_path: Path) -> dict[str, str]:
    (tmp_path / "coco").mkdir(exist_ok=True)
    (tmp_path / "coco" / "dataset_coco.json").write_text('{"images": []}')
    return {"COCO_ROOT": str(tmp_path / "coco"), "STORE_DIR": str(tmp_path / "stores"),
            "RUNS_DIR": str(tmp_path / "runs")}


def _dry(tmp_path, name="coco-fne-vgg16", **kw) -> str:
    lines: list[str] = []
    run(name, cli=main, file=str(REPO / "pipelines.yaml"), env=_recipe_env(tmp_path), dry_run=True, echo=lines.append, **kw)
    return "\n".join(lines)


def test_set_weights_reaches_the_extract_stage_and_stage_option_any_option(tmp_path):
    out = _dry(tmp_path)
    extract = next(line for line in out.splitlines() if line.strip().startswith("vsekit extract"))
    assert "--weights imagenet" in extract
    out = _dry(tmp_path, sets={"WEIGHTS": "none"})
    extract = next(line for line in out.splitlines() if line.strip().startswith("vsekit extract"))
    assert "--weights none" in extract
    out = _dry(tmp_path, stage_options=["extract.weights=none", "extract.batch_size=7", "train-sh.epochs=2"])
    lines = out.splitlines()
    extract = next(line for line in lines if line.strip().startswith("vsekit extract"))
    assert "--weights none" in extract and "--batch-size 7" in extract
    sh = next(line for line in lines if line.strip().startswith("vsekit train") and "/sh" in line)
    assert "--epochs 2" in sh
    mh = next(line for line in lines if line.strip().startswith("vsekit train") and "/mh" in line)
    assert "--epochs" not in mh   # only the stage named


def test_stage_option_errors_name_the_stage_and_the_option(tmp_path):
    with pytest.raises(PipelineError, match=r"has no stage 'extrct'; did you mean 'extract'\?"):
        _dry(tmp_path, stage_options=["extrct.weights=none"])
    with pytest.raises(PipelineError, match=r"unknown option 'wieghts' for `vsekit extract`"):
        _dry(tmp_path, stage_options=["extract.wieghts=none"])
    with pytest.raises(PipelineError, match=r"expected STAGE.OPTION=VALUE"):
        _dry(tmp_path, stage_options=["weights=none"])


def test_unknown_set_name_is_refused_with_a_suggestion(tmp_path):
    res = CliRunner().invoke(main, ["run", "coco-fne-vgg16", "--file", str(REPO / "pipelines.yaml"),
                                    "--set", "COCO_RooT=/x", "--dry-run"])
    assert res.exit_code == 1
    assert "Error: --set COCO_RooT: pipeline 'coco-fne-vgg16' has no variable ${COCO_RooT}; did you mean " \
           "'COCO_ROOT'?" in res.output


def test_user_file_adds_to_the_shipped_recipes_and_shadows_by_name(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "pipelines.yaml").write_text(textwrap.dedent("""\
        pipelines:
          mine:
            description: my own
            stages:
              - {stage: info, store: x}
          demo:
            description: my demo
            stages:
              - {stage: info, store: y}
        """))
    res = CliRunner().invoke(main, ["run", "--list"])
    assert res.exit_code == 0, res.output
    assert "coco-fne-vgg16" in res.output and "[shipped]" in res.output
    assert re.search(r"\n  mine +1 stage   my own  \[yours\]\n", res.output)
    assert re.search(r"\n  demo +1 stage   my demo  \[yours, shadows the shipped one\]\n", res.output)
    res = CliRunner().invoke(main, ["run", "coco-fne-vg16"])
    assert res.exit_code == 1 and "no pipeline 'coco-fne-vg16'; did you mean 'coco-fne-vgg16'" in res.output


def test_run_list_marks_every_pipeline_shipped_even_without_a_file_of_yours(tmp_path, monkeypatch):
    """Issue 34, item 5: the marks appeared only when a user file existed (the docs say always)."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("VSEKIT_PIPELINES", raising=False)
    res = CliRunner().invoke(main, ["run", "--list"])
    assert res.exit_code == 0, res.output
    rows = [line for line in res.output.splitlines()[1:] if line.startswith("  ")]
    assert len(rows) >= 6 and all(line.endswith("[shipped]") for line in rows), res.output


def test_protocol_that_cannot_fit_the_split_is_refused_before_anything_runs(tmp_path):
    store = FeatureStore.create(tmp_path / "s.zarr", dataset="coco")
    store.write_images(["a", "b", "c"], ["a.jpg", "b.jpg", "c.jpg"], ["train", "test", "test"])
    (tmp_path / "run").mkdir()
    path = tmp_path / "p.yaml"
    path.write_text(textwrap.dedent(f"""\
        pipelines:
          small:
            stages:
              - {{stage: info, store: {tmp_path}/s.zarr}}
              - {{stage: evaluate, runs: ["{tmp_path}/run"], store: {tmp_path}/s.zarr, protocol: [coco-1k]}}
        """))
    lines: list[str] = []
    with pytest.raises(PipelineError, match=r"--protocol coco-1k needs at least 5 test images, the test split "
                                            r"of .*s.zarr has 2; remove `protocol:`"):
        run("small", cli=main, file=str(path), env={}, echo=lines.append)
    assert not any("[1/2]" in line for line in lines)   # the info stage did not run either
    path.write_text(path.read_text().replace("coco-1k", "coco-5k"))
    with pytest.raises(PipelineError):   # the evaluation itself fails on the empty run folder...
        run("small", cli=main, file=str(path), env={}, echo=lines.append)
    # ... after a warning, printed before the first stage, that coco-5k's figures are not the papers'
    warn = next(i for i, line in enumerate(lines) if line.startswith("warning: stage 2 (evaluate): --protocol coco-5k"))
    assert warn < next(i for i, line in enumerate(lines) if line.startswith("[1/2] info"))


def test_every_stage_prints_its_elapsed_time(tmp_path):
    FeatureStore.create(tmp_path / "s.zarr", dataset="x")
    path = tmp_path / "p.yaml"
    path.write_text(f"pipelines:\n  one:\n    stages:\n      - {{stage: info, store: {tmp_path}/s.zarr}}\n")
    lines: list[str] = []
    run("one", cli=main, file=str(path), env={}, echo=lines.append)
    assert any(line.startswith("[1/1] info: done in ") and line.endswith("since the start)") for line in lines), lines


def test_recipes_leave_protocols_to_evaluate_and_demo_uses_the_global_module_option():
    text = (REPO / "pipelines.yaml").read_text()
    assert "protocol:" not in text.replace("# evaluate stages name no --protocol", "")
    assert "model_arg: [global_module" not in text and "global_module: t-emde" in text


def _demo_section(text: str) -> str:
    start = text.index("## The demo") if "## The demo" in text else text.index("`make demo` runs the `demo` pipeline")
    rest = text[start + 5:]
    end = rest.find("\n## ")
    return rest if end < 0 else rest[:end]


def test_docs_describe_the_demo_as_pipelines_yaml_has_it():
    from vsekit.pipeline import load_file

    demo = load_file(REPO / "pipelines.yaml").pipelines["demo"]
    stages = {s.id: {k: v.value for k, v in s.values.items()} for s in demo.stages}
    g, grid = stages["extract-global"], stages["extract-grid"]
    assert (g["resize"], g["input_size"]) == (32, 32)
    assert (grid["model"], grid["input_size"], grid["grid"]) == ("resnet18", 128, 4)
    for doc in (REPO / "docs" / "pipelines.md", REPO / "README.md"):
        section = " ".join(_demo_section(doc.read_text()).split())   # line breaks as spaces
        assert "32×32" in section and "ResNet-18" in section, doc
        assert "64×64" not in section and "ResNet-152" not in section, doc
        # the time it takes: measured on a fresh clone, on 2 cores, with the date
        assert "fresh clone" in section and "2 cores" in section and "2026-11-26" in section, doc
        assert "7 min 12 s" not in section


def test_make_demo_shows_the_install_and_each_step_with_its_time():
    make = (REPO / "Makefile").read_text()
    pip_lines = [line for line in make.splitlines() if "pip install" in line and not line.lstrip().startswith("#")]
    assert pip_lines and not any(" -q" in line or "--quiet" in line for line in pip_lines), pip_lines
    assert make.count("done in") >= 4   # each install step and the report say their time
