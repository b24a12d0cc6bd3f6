"""Every command, given bad values, ends in one clear line: never a Python traceback.

Usage errors keep Click's exit code 2; everything else a user can cause is ``Error: ...`` with exit
code 1. The table must name every command ``vsekit --help`` lists (checked below), so a new command
cannot be added without its bad-value cases.
"""

from __future__ import annotations

import json

import click
import pytest
import torch
from click.testing import CliRunner

from vsekit.cli import main

torch.set_num_threads(1)



def all_commands() -> list[str]:
    ctx = click.Context(main)
    out: list[str] = []

    def walk(group, prefix):
        for name in group.list_commands(ctx):
            cmd = group.get_command(ctx, name)
            if isinstance(cmd, click.Group):
                walk(cmd, prefix + [name])
            else:
                out.append(" ".join(prefix + [name]))
    walk(main, [])
    return out


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    """A small store (tokens, pixel features), a trained run, and hostile files."""
    from vsekit.storage.demo import make_demo_data
    from vsekit.storage.sources.karpathy import ingest_karpathy
    from vsekit.tokenize import tokenize
    from vsekit.train.demo import pixel_features

    d = tmp_path_factory.mktemp("errors")
    make_demo_data(d, images=40, seed=2, size=32, val_fraction=0.2, test_fraction=0.2)
    store, _ = ingest_karpathy(d / "dataset_demo.json", d, d / "s.zarr")
    tokenize(store, min_count=1)
    pixel_features(store, block_rows=16)
    run = d / "run"
    res = CliRunner().invoke(main, ["train", "--store", str(d / "s.zarr"), "--features", "pixels", "--model", "vse",
                                    "--preset", "demo", "--epochs", "1", "--embed-dim", "16", "--word-dim", "8",
                                    "--out", str(run), "--no-progress"])
    assert res.exit_code == 0, res.output
    broken = d / "broken"
    broken.mkdir()
    (broken / "config.json").write_text((run / "config.json").read_text())
    data = (run / "checkpoint_best.pt").read_bytes()
    (broken / "checkpoint_best.pt").write_bytes(data[: len(data) // 3])
    (d / "garbage.bin").write_bytes(b"\x00\x01not a file of any known kind\xff" * 10)
    (d / "garbage.json").write_text("{not json")
    (d / "list.json").write_text(json.dumps([1, 2, 3]))
    (d / "garbage.yaml").write_text("pipelines: [unclosed\n")
    (d / "empty").mkdir()
    return {"S": str(d / "s.zarr"), "RUN": str(run), "BROKEN": str(broken), "BIN": str(d / "garbage.bin"),
            "JSON": str(d / "garbage.json"), "LIST": str(d / "list.json"), "YAML": str(d / "garbage.yaml"),
            "EMPTY": str(d / "empty"), "ROOT": str(d), "OUT": str(d / "out"), "KJSON": str(d / "dataset_demo.json")}


def dev(*args):
    """A device case: the command name first, as the table's other cases omit it."""
    return list(args)[1:]


TRAIN = ["train", "--store", "{S}", "--features", "pixels", "--out", "{OUT}/t", "--preset", "demo", "--epochs", "1",
         "--no-progress"]

CASES = {
    "demo-data": [[], ["{OUT}/d", "--images", "abc"], ["{OUT}/d", "--images", "-3"], ["{BIN}"]],
    "discretize": [["--store", "{S}", "--features", "nope"], ["--store", "{EMPTY}", "--features", "pixels"],
                   ["--store", "{S}", "--features", "pixels", "--thresholds", "0.5", "0.1"],
                   ["--store", "{S}", "--features", "pixels", "--thresholds", "x", "0.1"]],
    "evaluate": [["{RUN}", "--protocol", "coco-7k"], ["{RUN}", "--split", "tset"], ["{EMPTY}"], ["{BROKEN}"],
                 ["{RUN}", "--batch-size", "0"], ["{RUN}", "--features", "nope"], ["{RUN}", "--store", "{EMPTY}"],
                 dev("evaluate", "{RUN}", "--device", "gpu"), dev("evaluate", "{RUN}", "--device", "cuda:7")],
    "embed": [["{EMPTY}", "--out", "{OUT}/e"], ["{BROKEN}", "--out", "{OUT}/e"],
              ["{RUN}", "--out", "{OUT}/e", "--split", "tset"], ["{RUN}", "--out", "{OUT}/e", "--batch-size", "0"],
              dev("embed", "{RUN}", "--out", "{OUT}/e", "--device", "gpu")],
    "export hdf5": [["--store", "{S}", "--features", "nope", "--out", "{OUT}/x.h5"], ["--store", "{EMPTY}"]],
    "export scan": [["--store", "{S}", "--features", "nope", "--out", "{OUT}/scan"],
                    ["--store", "{S}", "--features", "pixels", "--out", "{OUT}/scan", "--splits", "tset"]],
    "export vocab": [["--store", "{EMPTY}", "--out", "{OUT}/v.json"], ["--store", "{S}"]],
    "export vsepp": [["--store", "{S}", "--features", "nope", "--out", "{OUT}/vsepp"],
                     ["--store", "{S}", "--features", "pixels", "--out", "{OUT}/vsepp", "--captions-per-image", "0"]],
    "extract": [["--store", "{S}", "--model", "no_such_model_xyz", "--weights", "none", "--no-progress"],
                ["--store", "{S}", "--model", "resnet18", "--weights", "{BIN}", "--no-progress"],
                ["--store", "{S}", "--model", "resnet18", "--weights", "{ROOT}/missing.pth", "--no-progress"],
                ["--store", "{S}", "--model", "resnet18", "--weights", "none", "--crops", "7"],
                ["--store", "{S}", "--model", "resnet18", "--weights", "none", "--batch-size", "0", "--no-progress"],
                ["--store", "{S}", "--model", "vit_tiny_patch16_224", "--kind", "grid", "--grid", "99",
                 "--weights", "none", "--no-progress"],
                ["--store", "{S}", "--model", "resnet18", "--kind", "regions", "--boxes", "{JSON}", "--weights",
                 "none", "--no-progress"],
                dev("extract", "--store", "{S}", "--model", "resnet18", "--weights", "none", "--device", "gpu",
                    "--no-progress")],
    "fne": [["--store", "{S}", "--features", "nope"], ["--store", "{S}", "--features", "pixels", "--split", "tset"],
            ["--store", "{S}", "--features", "pixels", "--stats-from", "garbage"]],
    "info": [["{ROOT}/missing.zarr"], ["{S}", "nope"], ["{EMPTY}"]],
    "ingest butd": [["{BIN}", "--store", "{OUT}/b.zarr"], ["{ROOT}/missing.tsv", "--store", "{OUT}/b.zarr"]],
    "ingest coco": [["{JSON}", "--store", "{OUT}/c.zarr"], ["{LIST}", "--store", "{OUT}/c.zarr"]],
    "ingest folder": [["{EMPTY}", "{JSON}", "--store", "{OUT}/f.zarr"], ["{EMPTY}", "{BIN}", "--store", "{OUT}/f.zarr"]],
    "ingest hdf5": [["{BIN}", "--store", "{OUT}/h.zarr"]],
    "ingest karpathy": [["{JSON}", "--store", "{OUT}/k.zarr"], ["{LIST}", "--store", "{OUT}/k.zarr"],
                        ["{KJSON}", "--image-root", "{ROOT}/missing", "--store", "{OUT}/k.zarr"],
                        ["{KJSON}", "--store", "{S}"]],
    "ingest npz": [["{EMPTY}", "--store", "{S}"], ["{ROOT}/missing", "--store", "{S}"],
                   ["{EMPTY}", "--store", "{ROOT}/missing.zarr"]],
    "ingest parquet": [["{BIN}", "--store", "{OUT}/pq.zarr"], ["{EMPTY}", "--store", "{OUT}/pq.zarr"]],
    "ingest webdataset": [["{BIN}", "--store", "{OUT}/w.zarr"], ["{ROOT}/missing-{{0..3}}.tar", "--store",
                                                                    "{OUT}/w.zarr"]],
    "ingest precomp": [["{EMPTY}", "--store", "{OUT}/p.zarr"]],
    "report": [["{RUN}", "--out", "{OUT}/r", "--split", "tset"], ["{EMPTY}", "--out", "{OUT}/r"],
               ["{RUN}", "--out", "{OUT}/r", "--top-k", "0"], ["{RUN}", "--out", "{BIN}"],
               dev("report", "{RUN}", "--out", "{OUT}/r", "--device", "gpu")],
    "report-boxes": [["{S}", "nope", "--out", "{OUT}/rb"], ["{ROOT}/missing.zarr", "x", "--out", "{OUT}/rb"],
                     ["{S}", "pixels", "--out", "{OUT}/rb"], ["{S}", "pixels", "--rows", "a,b", "--out", "{OUT}/rb"]],
    "run": [["nope", "--file", "{YAML}"], ["--file", "{ROOT}/missing.yaml", "--list"], ["t", "--set", "novalue"],
            ["nope", "--file", "{JSON}"]],
    "split": [["--store", "{S}"], ["--store", "{S}", "--ratios", "0.5,0.5"], ["--store", "{S}", "--val", "999"],
              ["--store", "{S}", "--split-file", "{JSON}"], ["--store", "{EMPTY}", "--val", "1"]],
    "standardize": [["--store", "{S}", "--features", "nope"],
                    ["--store", "{S}", "--features", "pixels", "--split", "tset"],
                    ["--store", "{S}", "--features", "pixels", "--stats-from", "{EMPTY}::pixels"]],
    "tokenize": [["--store", "{S}", "--min-count", "-1"], ["--store", "{S}", "--vocab-splits", "tset"],
                 ["--store", "{S}", "--max-len", "0"], ["--store", "{EMPTY}"]],
    "train": [["--model", "seam-e", "--model-arg", "hops=many"], ["--model", "vse", "--model-arg", "novalue"],
              ["--model", "vse", "--features", "nope"], ["--model", "vse", "--lr", "-1"],
              ["--model", "sman"], ["--model", "vse", "--batch-size", "0"],
              ["--model", "vse", "--resume"],
              dev("train", "--model", "vse", "--device", "gpu"), dev("train", "--model", "vse", "--device", "cuda:7")],
}


def test_the_table_names_every_command():
    assert sorted(CASES) == sorted(all_commands())


def _params():
    for command, cases in CASES.items():
        for i, case in enumerate(cases):
            args = (TRAIN + case) if command == "train" else [*command.split(), *case]
            yield pytest.param(args, id=f"{command}-{i}")


@pytest.mark.parametrize("args", list(_params()))
def test_bad_values_end_in_one_clear_line(env, args):
    argv = [a.format(**env) for a in args]
    res = CliRunner().invoke(main, argv)
    tb = "" if res.exception is None or isinstance(res.exception, SystemExit) else repr(res.exception)
    assert "Traceback" not in res.output and not tb, f"{argv}\n{res.output}\n{tb}"
    assert res.exit_code in (1, 2), f"exit {res.exit_code} for {argv}:\n{res.output}"
    if res.exit_code == 1:
        assert res.output.rstrip().splitlines()[-1].startswith("Error: ") or "Error: " in res.output, res.output
