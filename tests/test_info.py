"""``vsekit info``: tree, shapes, dtypes, chunking, provenance and done/failed/pending counts."""

from __future__ import annotations

import numpy as np
from click.testing import CliRunner

from vsekit.cli import main


def _store_with_sets(store):
    fs = store.create_features("vgg19", (6,), np.float32, block_rows=8,
                               attrs={"kind": "global", "model": "vgg19", "weights": "none", "crops": 10})
    fs.write_block(0, np.ones((8, 6)))
    fs.write_block(1, np.ones((8, 6)), status=np.r_[np.ones(6), 2, 2])
    fs.record_errors({14: "cannot identify image file", 15: "truncated JPEG"})
    store.create_features("vgg19.z", (6,), np.float16, parent="vgg19", attrs={"kind": "global"})
    return fs


def test_info_tree_and_counts(demo_store):
    _store_with_sets(demo_store)
    r = CliRunner().invoke(main, ["info", str(demo_store.path)])
    assert r.exit_code == 0, r.output
    out = r.output
    assert "vsekit format 1, dataset 'demo'" in out
    codes = demo_store.image_splits()
    assert f"images: 24 (train {int((codes == 0).sum())}, val {int((codes == 1).sum())}, " \
           f"test {int((codes == 2).sum())})" in out
    assert "captions: 120" in out
    assert "split      (24,)" in out and "uint8" in out and "chunks=(24,)" in out
    assert "vgg19: global (24, 6) float32  done 14 / failed 2 / pending 8" in out
    assert "      data       (24, 6)                float32    chunks=(8, 6)" in out
    assert "    text       (120,)                 str        chunks=(120,)" in out
    assert "source files: " in out and "dataset_demo.json" in out
    assert "vgg19.z: global (24, 6) float16  done 0 / failed 0 / pending 24  (from vgg19)" in out


def test_info_one_set(demo_store):
    _store_with_sets(demo_store)
    r = CliRunner().invoke(main, ["info", str(demo_store.path), "vgg19"])
    assert r.exit_code == 0, r.output
    out = r.output
    assert "data       (24, 6)" in out and "chunks=(8, 6)" in out
    assert "status     (24,)" in out
    assert "provenance:" in out and 'model: "vgg19"' in out and "crops: 10" in out and "block_rows: 8" in out
    assert "failed rows (2):" in out
    ids = demo_store.image_ids()
    assert f"14 ({ids[14]}): cannot identify image file" in out


def test_info_errors(demo_store, tmp_path):
    r = CliRunner().invoke(main, ["info", str(demo_store.path), "nope"])
    assert r.exit_code == 1 and "Error: no feature set 'nope'" in r.output
    r = CliRunner().invoke(main, ["info", str(tmp_path)])
    assert r.exit_code == 1 and "is not a vsekit store" in r.output
