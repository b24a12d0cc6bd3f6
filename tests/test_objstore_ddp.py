"""Data-parallel training on a store on object storage (issue 35): ``vsekit train --nproc-per-node 2``
(gloo ranks on the CPU) on an ``s3://`` store served by moto trains the weights and logs the metrics of
the same run in one process on a disk store, with the node's window shared in memory and with the
per-rank fallback; the ``--storage-option`` values reach the ranks without being written anywhere.

Each case starts two rank processes (about 20 s on 2 cores): ``slow``."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from click.testing import CliRunner

pytest.importorskip("obstore")
pytest.importorskip("moto")

from conftest import S3_TEST_SECRET  # noqa: E402
from vsekit.cli import main  # noqa: E402

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def _build(store, demo):
    """The same store at ``store`` (a path or a URL): 60 demo images, tokens, pixel features."""
    from vsekit.storage.sources.karpathy import ingest_karpathy
    from vsekit.storage.store import FeatureStore
    from vsekit.tokenize import tokenize
    from vsekit.train.demo import pixel_features

    ingest_karpathy(demo / "dataset_demo.json", demo, store)
    st = FeatureStore.open(store, mode="r+")
    tokenize(st, min_count=1)
    with st.writer("pixels", stage="test"):
        pixel_features(st, block_rows=8)


def _train(store, out, *extra):
    return ["train", "--store", str(store), "--features", "pixels", "--model", "vse", "--out", str(out),
            "--preset", "demo", "--embed-dim", "16", "--word-dim", "8", "--batch-size", "8", "--epochs", "2",
            "--captions", "all", "--no-progress", "--device", "cpu", "--shuffle-memory", "0.00002", *extra]


def _log(run):
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture()
def stores(s3, tmp_path_factory):
    from vsekit.storage.demo import make_demo_data

    demo = tmp_path_factory.mktemp("demo")
    make_demo_data(demo, images=60, seed=3, size=16, val_fraction=0.2, test_fraction=0.2)
    disk = demo / "s.zarr"
    _build(disk, demo)
    _build(s3.url(), demo)
    return {"disk": disk, "s3": s3.url()}


@pytest.mark.parametrize("shared", [True, False], ids=["shared-window", "per-rank-fallback"])
def test_two_ranks_on_s3_train_the_one_process_run_on_disk(s3, stores, tmp_path, shared):
    one = tmp_path / "one"
    res = CliRunner().invoke(main, _train(stores["disk"], one))
    assert res.exit_code == 0, res.output
    # the ranks find the endpoint and the secret only in --storage-option: not in their environment
    env = {k: v for k, v in os.environ.items() if k not in ("AWS_ENDPOINT_URL", "AWS_SECRET_ACCESS_KEY")}
    tmp = tmp_path / "tmp"       # the launcher's and the ranks' temporary files, searched below
    tmp.mkdir()
    env.update(OMP_NUM_THREADS="1", TMPDIR=str(tmp))
    if not shared:               # no room for the node's window: every rank reads its own rows
        env["VSEKIT_SHARED_WINDOW_DIR"] = str(tmp_path / "no-such-folder")
    two = tmp_path / "two"
    args = _train(stores["s3"], two, "--nproc-per-node", "2", "--storage-option", f"endpoint={s3.endpoint}",
                  "--storage-option", f"secret_access_key={S3_TEST_SECRET}")
    r = subprocess.run([sys.executable, "-m", "vsekit.cli", *args], capture_output=True, text=True, env=env,
                       timeout=400)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "data-parallel over 2 ranks (gloo)" in r.stdout
    assert r.stdout.count("trained vse for 2 epochs") == 1
    fell_back = "the training window is not shared by the ranks of a node" in r.stdout + r.stderr
    assert fell_back == (not shared), r.stdout + r.stderr
    wa = torch.load(one / "checkpoint_last.pt", weights_only=True)["model"]
    wb = torch.load(two / "checkpoint_last.pt", weights_only=True)["model"]
    assert wa.keys() == wb.keys()
    for k in wa:
        assert torch.allclose(wa[k], wb[k], rtol=1e-4, atol=1e-5), (k, (wa[k] - wb[k]).abs().max().item())
    a, b = _log(one), _log(two)
    assert [e["epoch"] for e in b] == [0, 1, 2]
    for x, y in zip(a, b):
        if x["loss"] is not None:
            assert y["loss"] == pytest.approx(x["loss"], rel=1e-4)
        for k in x["val"]:
            assert y["val"][k] == pytest.approx(x["val"][k], abs=1e-3), (x["epoch"], k)
    assert json.loads((two / "config.json").read_text())["store"] == stores["s3"]
    # the secret is in no output, no file of the run, no temporary file, no object of the store
    assert S3_TEST_SECRET not in r.stdout + r.stderr
    for folder in (two, tmp):
        for f in folder.rglob("*"):
            if f.is_file():
                assert S3_TEST_SECRET.encode() not in f.read_bytes(), f
    for key in s3.keys():
        body = s3.client.get_object(Bucket=s3.bucket, Key=key)["Body"].read()
        assert S3_TEST_SECRET.encode() not in body, key
