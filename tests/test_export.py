"""Exports (vsepp, scan, hdf5, vocab) and their round trips back through ingest."""

from __future__ import annotations

import json

import numpy as np
import pytest
from click.testing import CliRunner

from vsekit.cli import main
from vsekit.storage import FeatureStore, StoreError, ingest_precomp
from vsekit.storage.interop import export_scan, export_vsepp, ingest_hdf5


def _fill(store: FeatureStore, name: str, row_shape, dtype, seed=0, block_rows=5, kind="global", extra=None):
    rng = np.random.default_rng(seed)
    values = rng.normal(size=(store.n_images, *row_shape)).astype(dtype)
    fs = store.create_features(name, row_shape, dtype, attrs={"kind": kind, "model": "test", "crops": 1},
                               block_rows=block_rows, extra=extra)
    for b in fs.blocks():
        aux = {}
        if extra:
            aux = {"count": np.full(len(b), row_shape[0], np.int16)}
        fs.write_block(b, values[b.start:b.stop], **aux)
    return values


def _split_order(store):
    return np.concatenate([store.split_rows(s) for s in ("train", "val", "test")])


def test_vsepp_files_and_round_trip(demo_store, tmp_path):
    g = _fill(demo_store, "g", (7,), np.float32)
    r = CliRunner().invoke(main, ["export", "vsepp", "--store", str(demo_store.path), "--features", "g",
                                  "--out", str(tmp_path / "v")])
    assert r.exit_code == 0, r.output
    test_rows = demo_store.split_rows("test")
    ims = np.load(tmp_path / "v" / "test_ims.npy")  # what VSE++'s PrecompDataset loads
    assert np.array_equal(ims, g[test_rows])
    caps = (tmp_path / "v" / "test_caps.txt").read_text().splitlines()
    assert len(caps) == 5 * len(test_rows)
    owners, text = demo_store.caption_images(), demo_store.caption_text()
    for k, line in enumerate(caps):  # caption k belongs to image k // 5, as VSE++ assumes
        assert owners[list(text).index(line)] == test_rows[k // 5]
    assert sorted(p.name for p in (tmp_path / "v").iterdir()) == sorted(
        f"{s}_{x}" for s in ("train", "dev", "test") for x in ("ims.npy", "caps.txt", "ids.txt"))
    back, _ = ingest_precomp(tmp_path / "v", tmp_path / "back.zarr")
    order = _split_order(demo_store)
    assert np.array_equal(back.features("precomp").data[:], g[order])
    assert list(back.image_ids()) == list(demo_store.image_ids()[order])
    assert np.array_equal(back.image_splits(), demo_store.image_splits()[order])
    for new_row, old_row in enumerate(order):
        new_caps = back.caption_text()[back.caption_images() == new_row]
        assert list(new_caps) == list(text[owners == old_row])


def test_scan_round_trip_regions_and_grid(demo_store, tmp_path):
    regs = _fill(demo_store, "reg", (36, 4), np.float16, kind="regions",
                 extra={"boxes": ((36, 4), "float32"), "count": ((), "int16")})
    export_scan(demo_store, "reg", tmp_path / "s")
    ims = np.load(tmp_path / "s" / "train_ims.npy")
    assert ims.shape == (len(demo_store.split_rows("train")), 36, 4) and ims.dtype == np.float16
    back, _ = ingest_precomp(tmp_path / "s", tmp_path / "back.zarr", name="reg")
    fs = back.features("reg", {"kind": "regions"})
    assert np.array_equal(fs.data[:], regs[_split_order(demo_store)])
    grid = _fill(demo_store, "grid", (2, 2, 3), np.float16, kind="grid")
    export_scan(demo_store, "grid", tmp_path / "gr", splits=["val"], dtype="float32")
    ims = np.load(tmp_path / "gr" / "dev_ims.npy")
    assert ims.dtype == np.float32
    assert np.array_equal(ims, grid[demo_store.split_rows("val")].reshape(-1, 4, 3).astype(np.float32))
    assert not (tmp_path / "gr" / "train_ims.npy").exists()


def test_hdf5_plain_h5py_and_round_trip(demo_store, tmp_path):
    import h5py

    g = _fill(demo_store, "g", (7,), np.float32)
    fs = demo_store.features("g")
    fs.record_errors({3: "bad image"})
    out = tmp_path / "x.h5"
    r = CliRunner().invoke(main, ["export", "hdf5", "--store", str(demo_store.path), "--out", str(out)])
    assert r.exit_code == 0, r.output
    with h5py.File(out, "r") as h5:
        assert np.array_equal(h5["features/g/data"][:], g)
        assert h5["features/g/data"].compression == "gzip"
        assert h5["features/g/data"].chunks is not None
        assert h5["features/g"].attrs["kind"] == "global"
        assert h5["features/g"].attrs["crops"] == 1
        assert json.loads(h5["features/g"].attrs["errors"]) == {"3": "bad image"}
        assert list(h5["images/id"].asstr()[:]) == list(demo_store.image_ids())
        assert list(h5["captions/text"].asstr()[:]) == list(demo_store.caption_text())
        assert np.array_equal(h5["captions/image"][:], demo_store.caption_images())
        assert h5.attrs["dataset"] == "demo"
    back = ingest_hdf5(out, tmp_path / "back.zarr")
    assert np.array_equal(back.features("g").data[:], g)
    assert back.features("g").attrs == fs.attrs
    assert back.features("g").counts() == fs.counts()
    assert list(back.image_paths()) == list(demo_store.image_paths())
    assert np.array_equal(back.image_splits(), demo_store.image_splits())
    assert list(back.caption_text()) == list(demo_store.caption_text())
    assert back.attrs["codes"] == demo_store.attrs["codes"]
    r = CliRunner().invoke(main, ["ingest", "hdf5", str(out), "--store", str(tmp_path / "b2.zarr")])
    assert r.exit_code == 0 and "1 feature sets" in r.output


def test_export_refusals(demo_store, tmp_path):
    _fill(demo_store, "g", (7,), np.float32)
    regs = demo_store.create_features("half", (3, 2), np.float16, attrs={"kind": "regions"}, block_rows=4)
    regs.write_block(0, np.ones((4, 3, 2)))
    with pytest.raises(StoreError, match="'half' is incomplete: 20 of 24 rows are pending"):
        export_scan(demo_store, "half", tmp_path / "o")
    for b in regs.blocks()[1:]:
        regs.write_block(b, np.ones((len(b), 3, 2)), status=np.r_[2, np.ones(len(b) - 1)])
    regs.record_errors({4: "unreadable JPEG"})
    with pytest.raises(StoreError, match="'half' has 5 failed rows \\(first: row 4: unreadable JPEG\\)"):
        export_scan(demo_store, "half", tmp_path / "o")
    with pytest.raises(StoreError, match="the vsepp layout holds one vector per image"):
        _fill(demo_store, "r2", (3, 2), np.float16, kind="regions")
        export_vsepp(demo_store, "r2", tmp_path / "o")
    with pytest.raises(StoreError, match="the scan layout holds"):
        export_scan(demo_store, "g", tmp_path / "o")
    with pytest.raises(StoreError, match=r"image row \d+ \(id \d+\) has 5 captions; .* needs 6"):
        export_vsepp(demo_store, "g", tmp_path / "o", captions_per_image=6)
    r = CliRunner().invoke(main, ["export", "vsepp", "--store", str(demo_store.path), "--features", "nope",
                                  "--out", str(tmp_path / "o")])
    assert r.exit_code == 1 and "no feature set 'nope'" in r.output and "it has: g, half, r2" in r.output
    with pytest.raises(ValueError, match="unknown split 'dev'"):
        export_vsepp(demo_store, "g", tmp_path / "o", splits=["dev"])


def test_export_vocab(demo_store, tmp_path):
    tok = pytest.importorskip("vsekit.tokenize", reason="vsekit.tokenize is not built yet")
    if not hasattr(tok, "export_vocab_json") or not hasattr(tok, "tokenize"):
        pytest.skip("vsekit.tokenize.export_vocab_json / tokenize not available yet")
    r = CliRunner().invoke(main, ["export", "vocab", "--store", str(demo_store.path), "--out",
                                  str(tmp_path / "v.json")])
    assert r.exit_code == 1 and "no tokens yet" in r.output
    tok.tokenize(demo_store.path)
    r = CliRunner().invoke(main, ["export", "vocab", "--store", str(demo_store.path), "--out",
                                  str(tmp_path / "v.json")])
    assert r.exit_code == 0, r.output
    assert (tmp_path / "v.json").stat().st_size > 0
    assert "circle" in (tmp_path / "v.json").read_text()
