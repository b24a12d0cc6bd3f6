"""`vsekit run` recipes whose store is an ``s3://`` URL (issue 35): the recipe runs end to end on the
local S3 server and gives the store and the metrics it gives on disk; a second run skips every stage
as up to date (the records live in the store's attributes there too); no secret is recorded."""

from __future__ import annotations

import json
import textwrap

import pytest

pytest.importorskip("obstore")
pytest.importorskip("moto")

from click.testing import CliRunner  # noqa: E402

from vsekit.cli import main  # noqa: E402

from conftest import S3_TEST_SECRET  # noqa: E402
from test_objstore_ingest import _assert_same, _clean_after, _contents, _errors, _verified  # noqa: E402

pytestmark = pytest.mark.e2e

RECIPE = """\
pipelines:
  tiny:
    description: ingest, extract, FNE, tokenize, train, evaluate on one store
    defaults:
      store: ${STORE}
      extract: {model: test_resnet, weights: none, kind: fne, crops: 1, input_size: 48, resize: 56,
                batch_size: 4, block_rows: 8, workers: 0, no_progress: true}
    stages:
      - stage: ingest karpathy
        json_path: ${DATA}/dataset_demo.json
        storage_option: ["secret_access_key=${SECRET}"]
      - {stage: extract, name: feats}
      - {stage: standardize, features: feats}
      - {stage: discretize, features: feats.z, pack: true}
      - {stage: tokenize, min_count: 1}
      - {stage: train, features: feats.z.fne, model: vse, preset: [demo], embed_dim: 16, word_dim: 8,
         batch_size: 8, epochs: 1, no_progress: true, device: cpu, out: "${RUNS}/r"}
      - {stage: evaluate, runs: ["${RUNS}/r"], no_progress: true, device: cpu}
"""
STAGES = ["ingest-karpathy", "extract", "standardize", "discretize", "tokenize", "train", "evaluate"]


def _recorded(contents: dict) -> dict:
    """The store's contents without the run records (their times differ between two runs)."""
    for attrs in contents.values():
        if isinstance(attrs, dict):
            attrs.pop("pipeline", None)
    return contents


@pytest.mark.slow   # a long end-to-end pipeline, on two stores (over 5 s)
def test_a_recipe_on_s3_runs_end_to_end_as_on_disk_and_a_second_run_skips_it(s3, demo_dir, tmp_path):
    recipe = tmp_path / "pipelines.yaml"
    recipe.write_text(textwrap.dedent(RECIPE))
    url, disk = s3.url("stores/tiny.zarr"), str(tmp_path / "d.zarr")
    runs = {url: tmp_path / "runs-s3", disk: tmp_path / "runs-disk"}

    def run(store, *more, secret=S3_TEST_SECRET):
        return CliRunner().invoke(main, ["run", "tiny", "--file", str(recipe), "--set", f"STORE={store}",
                                         "--set", f"RUNS={runs[store]}", "--set", f"DATA={demo_dir}",
                                         "--set", f"SECRET={secret}", *more])

    secret = ["--storage-option", f"secret_access_key={S3_TEST_SECRET}"]
    for store in (url, disk):
        r = run(store, *secret)
        assert r.exit_code == 0 and "pipeline tiny: 7 stages ran, 0 skipped" in r.output, r.output
        for i, sid in enumerate(STAGES):
            assert f"[{i + 1}/7] {sid}: " in r.output, (sid, r.output)
        assert S3_TEST_SECRET not in r.output and "secret_access_key=***" in r.output
    _assert_same(_recorded(_contents(url)), _recorded(_contents(disk)))
    metrics = {s: json.loads((runs[s] / "r" / "metrics.json").read_text())["protocols"] for s in runs}
    assert metrics[url] == metrics[disk] and metrics[url]
    _verified(url)
    _clean_after(s3)
    # the records are in the store on S3, with the command that ran and no secret
    from vsekit.storage.store import FeatureStore

    store = FeatureStore.open(url)
    before = store.features("feats").data[:]
    old_gen = store.features("feats").attrs["generation"]
    record = store.features("feats").attrs["pipeline"]["tiny/extract"]
    assert record["stage"] == "extract" and url in record["command"]
    ingest_record = store.attrs["pipeline"]["tiny/ingest-karpathy"]
    assert "--storage-option 'secret_access_key=***'" in ingest_record["command"], ingest_record
    for key in s3.keys():
        assert S3_TEST_SECRET.encode() not in s3.client.get_object(Bucket=s3.bucket, Key=key)["Body"].read(), key
    # a second run: every stage is up to date, on S3 as on disk (the storage options, another
    # secret here, are not part of a stage's fingerprint)
    r = run(url, secret="another-secret")
    assert r.exit_code == 0, r.output
    for sid in STAGES:
        assert f"skip {sid}: up to date" in r.output, (sid, r.output)
    # a changed option of a stage whose output is on S3: it is rerun with --overwrite, which replaces the
    # set on object storage as on disk (docs/store.md, "Replacing a set or a store on object storage")
    r = run(url, "--stage-option", "extract.resize=64")
    assert r.exit_code == 0 and "extract: its options or inputs changed" in r.output, r.output
    import numpy as np

    after = FeatureStore.open(url).features("feats")
    assert after.attrs["generation"] != old_gen   # made again
    assert after.attrs["resize"] == 64 and not np.array_equal(after.data[:], before)
    _verified(url)
    _clean_after(s3)
    assert not [k for k in s3.keys() if "/.vsekit/swaps/" in k or ".next-" in k]


def test_a_two_stage_recipe_on_s3_records_in_the_store_and_skips_when_up_to_date(s3, demo_dir, tmp_path):
    """The fast case: ingest and tokenize into an S3 store, then the same recipe again skips both."""
    recipe = tmp_path / "pipelines.yaml"
    recipe.write_text(textwrap.dedent("""\
        pipelines:
          two:
            stages:
              - {stage: ingest karpathy, json_path: "${DATA}/dataset_demo.json", store: "${STORE}"}
              - {stage: tokenize, min_count: 1, store: "${STORE}"}
        """))
    url = s3.url("stores/two.zarr")
    argv = ["run", "two", "--file", str(recipe), "--set", f"STORE={url}", "--set", f"DATA={demo_dir}"]
    r = CliRunner().invoke(main, argv)
    assert r.exit_code == 0 and "2 stages ran, 0 skipped" in r.output, r.output
    from vsekit.storage.store import FeatureStore

    store = FeatureStore.open(url)
    assert store.has_tokens and "two/tokenize" in dict(store.root["tokens"].attrs)["pipeline"]
    r = CliRunner().invoke(main, argv)
    assert r.exit_code == 0 and r.output.count(": up to date") == 2, r.output
    _clean_after(s3)


@pytest.mark.slow
def test_a_shipped_recipe_runs_on_s3_with_smoke_and_a_second_run_skips_it(s3, tmp_path, monkeypatch):
    """A recipe of the shipped pipelines.yaml (f30k-sman-r152, its `--smoke` sizes) with its stores on
    S3 (`--set STORE_DIR=s3://...`): every stage runs, the set and the tokens are on S3 with a commit
    record per block, and the same command again skips every stage as up to date."""
    from vsekit.storage.store import FeatureStore

    monkeypatch.chdir(tmp_path)
    store_dir = s3.url("stores")
    argv = ["run", "f30k-sman-r152", "--smoke", "--set", f"STORE_DIR={store_dir}", "--device", "cpu"]
    r = CliRunner().invoke(main, argv)
    assert r.exit_code == 0 and "5 stages ran, 0 skipped" in r.output, r.output
    urls = sorted({k.split("/zarr.json")[0] for k in s3.keys() if k.endswith(".zarr/zarr.json")})
    assert len(urls) == 1
    url = f"s3://{s3.bucket}/{urls[0]}"
    store = FeatureStore.open(url)
    assert store.has_tokens and len(store.feature_names()) == 1
    _verified(url)
    _clean_after(s3)
    assert not (tmp_path / "vsekit-smoke" / "f30k-sman-r152" / "stores").exists()   # nothing local
    r = CliRunner().invoke(main, argv)
    assert r.exit_code == 0 and r.output.count(": up to date") == 5, r.output
