"""An img2dataset-shaped shard set through ingest → extract → tokenize → train → evaluate → embed.

The images are read in place from the shards; their features must equal those extracted from the
same JPEG files unpacked into a folder (ingest folder), so reading from tars changes nothing.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from vsekit.cli import main
from vsekit.storage import FeatureStore

wds = pytest.importorskip("webdataset")
torch.set_num_threads(1)

EXTRACT = ["--model", "test_resnet", "--weights", "none", "--kind", "global", "--input-size", "32",
           "--resize", "32", "--crops", "1", "--batch-size", "32", "--block-rows", "64", "--workers", "0",
           "--seed", "0", "--no-progress"]


# end to end (CLI runs, extraction, training, subprocesses): in `make test`, not in `make test-fast`
pytestmark = pytest.mark.e2e


def _ok(args):
    r = CliRunner().invoke(main, [str(a) for a in args])
    assert r.exit_code == 0, r.output
    return r.output


def test_img2dataset_shards_end_to_end(tmp_path):
    from vsekit.storage.demo import make_demo_data

    make_demo_data(tmp_path / "demo", images=300, seed=0, size=32, val_fraction=0.15, test_fraction=0.15)
    doc = json.loads((tmp_path / "demo" / "dataset_demo.json").read_text())
    (tmp_path / "wds").mkdir()
    split_lines, folder_lines = [], ["path\tcaption\tsplit"]
    per_shard = 100
    for s in range(3):  # img2dataset: KEY = shard + index, .jpg + .txt + .json per sample
        with wds.TarWriter(str(tmp_path / "wds" / f"{s:05d}.tar")) as sink:
            for i, rec in enumerate(doc["images"][s * per_shard:(s + 1) * per_shard]):
                key = f"{s:05d}{i:04d}"
                rel = f"{rec.get('filepath', 'images')}/{rec['filename']}"
                caption = rec["sentences"][0]["raw"]
                sink.write({"__key__": key, "jpg": (tmp_path / "demo" / rel).read_bytes(), "txt": caption.encode(),
                            "json": json.dumps({"key": key, "caption": caption, "status": "success",
                                                "url": f"http://example.com/{rec['filename']}"}).encode()})
                split_lines.append(f"{key}\t{rec['split']}")
                folder_lines.append(f"{rel}\t{caption}\t{rec['split']}")
    (tmp_path / "splits.tsv").write_text("\n".join(split_lines) + "\n")
    (tmp_path / "caps.tsv").write_text("\n".join(folder_lines) + "\n")
    store = tmp_path / "s.zarr"

    _ok(["ingest", "webdataset", tmp_path / "wds" / "{00000..00002}.tar", "--split-file", tmp_path / "splits.tsv",
         "--store", store])
    _ok(["extract", "--store", store, *EXTRACT, "--name", "g"])
    fs = FeatureStore.open(store).features("g")
    assert fs.counts() == {"pending": 0, "done": 300, "failed": 0}
    # the same JPEGs unpacked: identical features
    _ok(["ingest", "folder", tmp_path / "demo", tmp_path / "caps.tsv", "--store", tmp_path / "f.zarr"])
    _ok(["extract", "--store", tmp_path / "f.zarr", *EXTRACT, "--name", "g"])
    unpacked = FeatureStore.open(tmp_path / "f.zarr").features("g").data[:]
    in_place = fs.data[:]
    assert np.array_equal(in_place, unpacked)
    # resumable by row block: a block marked pending again is redone from the shards, the rest skipped
    again = FeatureStore.open(store, mode="r+").features("g")
    again.data[64:128] = 0
    again.status[64:128] = 0
    out = _ok(["extract", "--store", store, *EXTRACT, "--name", "g"])
    assert "skipped" in out
    assert np.array_equal(FeatureStore.open(store).features("g").data[:], unpacked)

    _ok(["tokenize", "--store", store, "--min-count", "1"])
    _ok(["train", "--store", store, "--features", "g", "--model", "vse", "--preset", "demo", "--epochs", "1",
         "--embed-dim", "16", "--word-dim", "8", "--batch-size", "32", "--out", tmp_path / "run", "--no-progress"])
    _ok(["evaluate", tmp_path / "run", "--no-progress"])
    metrics = json.loads((tmp_path / "run" / "metrics.json").read_text())
    n_test = sum(1 for r in doc["images"][:300] if r["split"] == "test")
    assert metrics["n_images"] == n_test == metrics["n_captions"]
    _ok(["embed", tmp_path / "run", "--out", tmp_path / "emb"])
    img, cap = np.load(tmp_path / "emb" / "images.npy"), np.load(tmp_path / "emb" / "captions.npy")
    assert img.shape == (n_test, 16) and cap.shape == (n_test, 16)
    np.testing.assert_allclose(img @ cap.T, np.load(tmp_path / "run" / "sims_test.npy"), rtol=1e-4, atol=1e-5)
