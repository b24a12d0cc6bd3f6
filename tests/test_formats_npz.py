"""`vsekit ingest npz`: per-image .npz files in bottom-up-attention.pytorch's key layout."""

from __future__ import annotations

import numpy as np
from click.testing import CliRunner

from vsekit.cli import main
from vsekit.storage import FeatureStore


def _write_port_npz(path, rng, n, c=2048, h=480, w=640):
    """What the port's extract_features writes (np.savez_compressed, an ``info`` dict included)."""
    x = rng.random((n, c), dtype=np.float32)
    bbox = np.sort(rng.random((n, 4), dtype=np.float32) * 400, axis=1)
    info = {"objects": np.arange(n), "cls_prob": rng.random((n, 5))}
    np.savez_compressed(path, x=x, bbox=bbox, num_bbox=n, image_h=h, image_w=w, info=info)
    return x, bbox


def test_npz_regions_padded_matched_by_number(demo_store, tmp_path):
    rng = np.random.default_rng(0)
    ids = list(demo_store.image_ids())
    assert all(i.isdigit() for i in ids)
    folder = tmp_path / "npz"
    folder.mkdir()
    truth = {}
    counts = [10, 100] + list(rng.integers(10, 101, size=len(ids) - 3))
    for row, n in zip(range(len(ids) - 1), counts):  # the last image has no file
        truth[row] = (*_write_port_npz(folder / f"COCO_val2014_{int(ids[row]):012d}.npz", rng, int(n)), int(n))
    _write_port_npz(folder / "COCO_val2014_999999999.npz", rng, 12)  # not in the store
    r = CliRunner().invoke(main, ["ingest", "npz", str(folder), "--store", str(demo_store.path),
                                  "--match", "number", "--dtype", "float32"])
    assert r.exit_code == 0, r.output
    assert "999999999 is not in" in r.output and "marked failed): 1" not in r.output
    store = FeatureStore.open(demo_store.path)
    fs = store.features("regions", {"kind": "regions", "source": "npz"})
    assert fs.shape == (len(ids), 100, 2048)
    data, boxes, count = fs.data[:], fs.array("boxes")[:], fs.array("count")[:]
    status, size = fs.status[:], fs.array("image_size")[:]
    for row, (x, bbox, n) in truth.items():
        assert count[row] == n and status[row] == 1
        assert np.array_equal(data[row, :n], x) and not data[row, n:].any()
        assert np.array_equal(boxes[row, :n], bbox) and not boxes[row, n:].any()
        assert tuple(size[row]) == (640, 480)
    last = len(ids) - 1
    assert status[last] == 2 and "no .npz" in fs.errors()[last]


def test_npz_bad_files_are_named(demo_store, tmp_path):
    rng = np.random.default_rng(1)
    folder = tmp_path / "npz"
    folder.mkdir()
    ids = list(demo_store.image_ids())
    _write_port_npz(folder / f"{ids[0]}.npz", rng, 11, c=8)
    np.savez(folder / f"{ids[1]}.npz", x=np.zeros((3, 8), np.float32), bbox=np.zeros((4, 4), np.float32),
             num_bbox=3, image_h=1, image_w=1)
    np.savez(folder / f"{ids[2]}.npz", features=np.zeros((3, 8), np.float32))
    (folder / f"{ids[3]}.npz").write_bytes(b"PK\x03\x04 truncated")
    run = CliRunner().invoke
    r = run(main, ["ingest", "npz", str(folder), "--store", str(demo_store.path)])
    assert r.exit_code == 0, r.output
    assert f"{ids[1]}.npz: x has shape (3, 8) and bbox (4, 4)" in r.output
    assert f"{ids[2]}.npz: missing array(s) x, bbox" in r.output
    assert f"{ids[3]}.npz: not a readable .npz" in r.output
    r = run(main, ["ingest", "npz", str(folder), "--store", str(demo_store.path), "--name", "r2", "--strict"])
    assert r.exit_code == 1 and "Traceback" not in r.output
    assert "r2" not in FeatureStore.open(demo_store.path).feature_names()


def test_pipeline_treats_npz_ingest_as_a_feature_set_not_a_store():
    """`vsekit run --force` must replace only the feature set an `ingest npz` stage adds, never the store."""
    from vsekit.pipeline.outputs import FeaturesOutput, stage_io

    io = stage_io("ingest npz", {"store": "coco.zarr", "name": "bu"}, lambda key: None)
    assert [type(o) for o in io.outputs] == [FeaturesOutput] and io.outputs[0].name == "bu"
