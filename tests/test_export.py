"""Exports (vsepp, scan, hdf5, vocab) and their round trips back through ingest."""

from __future__ import annotations

import json

import numpy as np
import pytest
from click.testing import CliRunner

from vsekit.cli import main
from vsekit.storage import FeatureStore, StoreError, ingest_precomp
from vsekit.storage.interop import export_precomp, ingest_hdf5


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
    export_precomp(demo_store, "reg", tmp_path / "s", layout="scan")
    ims = np.load(tmp_path / "s" / "train_ims.npy")
    assert ims.shape == (len(demo_store.split_rows("train")), 36, 4) and ims.dtype == np.float16
    back, _ = ingest_precomp(tmp_path / "s", tmp_path / "back.zarr", name="reg")
    fs = back.features("reg", {"kind": "regions"})
    assert np.array_equal(fs.data[:], regs[_split_order(demo_store)])
    grid = _fill(demo_store, "grid", (2, 2, 3), np.float16, kind="grid")
    export_precomp(demo_store, "grid", tmp_path / "gr", splits=["val"], dtype="float32", layout="scan")
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
        export_precomp(demo_store, "half", tmp_path / "o", layout="scan")
    for b in regs.blocks()[1:]:
        regs.write_block(b, np.ones((len(b), 3, 2)), status=np.r_[2, np.ones(len(b) - 1)])
    regs.record_errors({4: "unreadable JPEG"})
    with pytest.raises(StoreError, match=r"'half' has 5 failed rows; first: row 4 \(id [^)]+\): unreadable JPEG\. "
                                         r"The scan layout needs features for every image: pass --drop-failed") as err:
        export_precomp(demo_store, "half", tmp_path / "o", layout="scan")
    assert len(str(err.value)) < 400 and "--retry-failed" not in str(err.value)   # was ~1,100 characters
    with pytest.raises(StoreError, match="the vsepp layout holds one vector per image"):
        _fill(demo_store, "r2", (3, 2), np.float16, kind="regions")
        export_precomp(demo_store, "r2", tmp_path / "o", layout="vsepp")
    with pytest.raises(StoreError, match="the scan layout holds"):
        export_precomp(demo_store, "g", tmp_path / "o", layout="scan")
    with pytest.raises(StoreError, match=r"image row \d+ \(id \d+\) has 5 captions; .* needs 6"):
        export_precomp(demo_store, "g", tmp_path / "o", captions_per_image=6, layout="vsepp")
    r = CliRunner().invoke(main, ["export", "vsepp", "--store", str(demo_store.path), "--features", "nope",
                                  "--out", str(tmp_path / "o")])
    assert r.exit_code == 1 and "no feature set 'nope'" in r.output and "it has: g, half, r2" in r.output
    with pytest.raises(ValueError, match="unknown split 'dev'"):
        export_precomp(demo_store, "g", tmp_path / "o", splits=["dev"], layout="vsepp")


def test_export_vocab(demo_store, tmp_path):
    tok = pytest.importorskip("vsekit.tokenize", reason="vsekit.tokenize is not built yet")
    if not hasattr(tok, "export_vocab_json") or not hasattr(tok, "tokenize"):
        pytest.skip("vsekit.tokenize.export_vocab_json / tokenize not available yet")
    r = CliRunner().invoke(main, ["export", "vocab", "--store", str(demo_store.path), "--out",
                                  str(tmp_path / "v.json")])
    assert r.exit_code == 1 and "has no tokens; run `vsekit tokenize --store" in r.output
    tok.tokenize(demo_store.path)
    r = CliRunner().invoke(main, ["export", "vocab", "--store", str(demo_store.path), "--out",
                                  str(tmp_path / "v.json")])
    assert r.exit_code == 0, r.output
    assert (tmp_path / "v.json").stat().st_size > 0
    assert "circle" in (tmp_path / "v.json").read_text()


# reference-loader compatibility (issue 17) --------------------------------------------------------
def _coco_like_store(path, n_test=1200, n_train=6, n_restval=4, n_val=3, dim=4):
    """A COCO-named store whose test split is larger than one 1K fold; 5 captions per image."""
    counts = {"train": n_train, "restval": n_restval, "val": n_val, "test": n_test}
    splits = [s for s in ("train", "val", "test", "restval") for _ in range(counts[s])]
    rng = np.random.default_rng(0)
    splits = [splits[i] for i in rng.permutation(len(splits))]  # splits interleaved in store order
    n = len(splits)
    with FeatureStore.building(path, dataset="coco") as store:
        store.write_images([str(100 + i) for i in range(n)], [""] * n, splits)
        words = ["dog", "cat", "red", "car", "man", "tree"]
        store.write_captions([f"a {words[i % 6]} and {words[(i // 6) % 6]} number {i % 5}" for i in range(5 * n)],
                             np.repeat(np.arange(n), 5))
    g = _fill(store, "g", (dim,), np.float32, block_rows=64)
    return store, g


class _PrecompDataset:
    """The few loading lines of VSE++'s / SCAN's PrecompDataset (data.py), re-implemented."""

    def __init__(self, loc, data_split):
        with open(f"{loc}/{data_split}_caps.txt", "rb") as f:
            self.captions = [line.strip() for line in f]
        self.images = np.load(f"{loc}/{data_split}_ims.npy")
        self.length = len(self.captions)
        self.im_div = 5 if self.images.shape[0] != self.length else 1
        if data_split == "dev":
            self.length = 5000

    def __getitem__(self, index):
        return self.images[index // self.im_div], self.captions[index]


def test_coco_testall_and_restval_into_train_read_by_reference_loader(tmp_path):
    store, g = _coco_like_store(tmp_path / "c.zarr")
    out = tmp_path / "coco_precomp"
    r = CliRunner().invoke(main, ["export", "vsepp", "--store", str(store.path), "--features", "g",
                                                  "--out", str(out), "--restval-into-train"])
    assert r.exit_code == 0, r.output
    assert sorted(p.name for p in out.glob("*_ims.npy")) == ["dev_ims.npy", "test_ims.npy", "testall_ims.npy",
                                                           "train_ims.npy"]
    assert "dev has 15 captions, fewer than the 5000" in r.stderr
    assert "testall has 1200 images" in r.stderr
    ids, owners, text = store.image_ids(), store.caption_images(), store.caption_text()
    splits = store.image_splits()
    test_rows = np.flatnonzero(splits == 2)
    expect = {"testall": test_rows, "test": test_rows[:1000],
              "train": np.flatnonzero((splits == 0) | (splits == 3))}
    for name, rows in expect.items():
        ds = _PrecompDataset(str(out), name)
        assert ds.im_div == 5 and len(ds.images) == len(rows) and ds.length == 5 * len(rows)
        file_ids = (out / f"{name}_ids.txt").read_text().split()
        assert file_ids == [str(ids[r]) for r in rows]
        for index in range(0, ds.length, 7):  # every item pairs a caption with its own image
            image, caption = ds[index]
            row = rows[index // 5]
            assert np.array_equal(image, g[row])
            assert caption.decode() in set(text[owners == row])
    ds = _PrecompDataset(str(out), "dev")
    with pytest.raises(IndexError):  # what the warning is about
        ds[4999]
    # without COCO in the name (or with --no-testall) test is the whole split
    summary = export_precomp(store, "g", tmp_path / "plain", testall=False, splits=["test"], layout="vsepp")
    assert list(summary["splits"]) == ["test"] and summary["splits"]["test"]["images"] == 1200


def test_vocab_pickle_loads_as_vsepp_vocabulary_and_json_as_scan(demo_store, tmp_path, monkeypatch):
    import pickle
    import sys
    import types

    tok = pytest.importorskip("vsekit.tokenize")
    tok.tokenize(demo_store.path)
    _fill(demo_store, "g", (3,), np.float32)
    r = CliRunner().invoke(main, ["export", "vsepp", "--store", str(demo_store.path), "--features", "g",
                                  "--out", str(tmp_path / "o"), "--vocab-name", "demo_precomp"])
    assert r.exit_code == 0, r.output

    # VSE++'s vocab.py: the class their pickle.load needs, re-implemented
    class Vocabulary:
        def __init__(self):
            self.word2idx, self.idx2word, self.idx = {}, {}, 0

        def add_word(self, word):
            if word not in self.word2idx:
                self.word2idx[word] = self.idx
                self.idx2word[self.idx] = word
                self.idx += 1

        def __call__(self, word):
            return self.word2idx.get(word, self.word2idx["<unk>"])

        def __len__(self):
            return len(self.word2idx)

    module = types.ModuleType("vocab")
    module.Vocabulary = Vocabulary
    Vocabulary.__module__ = "vocab"
    monkeypatch.setitem(sys.modules, "vocab", module)
    with open(tmp_path / "o" / "demo_precomp_vocab.pkl", "rb") as f:
        v = pickle.load(f)
    itos = list(demo_store.root["tokens"].attrs["vocabulary"])
    assert isinstance(v, Vocabulary) and len(v) == len(itos) == v.idx
    assert [v("<pad>"), v("<start>"), v("<end>"), v("<unk>")] == [0, 1, 2, 3]
    assert all(v(w) == i and v.idx2word[i] == w for i, w in enumerate(itos))
    assert v("zzzunseen") == 3
    # SCAN's deserialize_vocab
    d = json.loads((tmp_path / "o" / "demo_precomp_vocab.json").read_text())
    scan_vocab = Vocabulary()
    scan_vocab.word2idx, scan_vocab.idx2word, scan_vocab.idx = d["word2idx"], d["idx2word"], d["idx"]
    assert all(scan_vocab(w) == i for i, w in enumerate(itos)) and scan_vocab.idx == len(itos)
    r = CliRunner().invoke(main, ["export", "vocab", "--store", str(demo_store.path), "--out",
                                  str(tmp_path / "v.pkl")])
    assert r.exit_code == 0 and (tmp_path / "v.pkl").read_bytes() == (
        tmp_path / "o" / "demo_precomp_vocab.pkl").read_bytes()


def test_export_refuses_an_existing_output_and_replaces_it_whole(demo_store, tmp_path):
    """issue 29 item 3: an existing --out is refused without --overwrite; with it, nothing old is kept."""
    _fill(demo_store, "g", (7,), np.float32)
    out = tmp_path / "v"
    out.mkdir()
    (out / "coco_precomp_vocab.json").write_text("{}")          # another store's export
    (out / "train_ims.npy").write_bytes(b"old")
    args = ["export", "vsepp", "--store", str(demo_store.path), "--features", "g", "--out", str(out)]
    r = CliRunner().invoke(main, args)
    assert r.exit_code == 1 and f"Error: {out} already exists; pass --overwrite to replace it" in r.output
    assert (out / "train_ims.npy").read_bytes() == b"old"        # nothing touched
    r = CliRunner().invoke(main, [*args, "--overwrite"])
    assert r.exit_code == 0, r.output
    assert sorted(p.name for p in out.iterdir()) == sorted(
        f"{s}_{x}" for s in ("train", "dev", "test") for x in ("ims.npy", "caps.txt", "ids.txt"))
    assert np.load(out / "train_ims.npy").shape[1] == 7
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".v.")]   # no hidden leftovers
    h5 = tmp_path / "s.h5"
    h5.write_bytes(b"old")
    r = CliRunner().invoke(main, ["export", "hdf5", "--store", str(demo_store.path), "--out", str(h5)])
    assert r.exit_code == 1 and "already exists; pass --overwrite" in r.output and h5.read_bytes() == b"old"


def test_drop_failed_leaves_failed_images_and_their_captions_out_and_records_it(demo_store, tmp_path):
    """Issue 34: a broken image could not be dropped; export refused any set with a failed row."""
    g = _fill(demo_store, "g", (7,), np.float32)
    fs = demo_store.features("g")
    test_rows = demo_store.split_rows("test")
    bad = [int(test_rows[1]), int(demo_store.split_rows("train")[0])]
    status = np.asarray(fs.status[:]).copy()
    status[bad] = 2
    fs.status[:] = status
    fs.record_errors({bad[0]: "truncated JPEG", bad[1]: "cannot decode"})
    r = CliRunner().invoke(main, ["export", "vsepp", "--store", str(demo_store.path), "--features", "g",
                                  "--out", str(tmp_path / "v")])
    assert r.exit_code == 1 and "--drop-failed" in r.output and not (tmp_path / "v").exists()
    r = CliRunner().invoke(main, ["export", "vsepp", "--store", str(demo_store.path), "--features", "g",
                                  "--out", str(tmp_path / "v"), "--drop-failed"])
    assert r.exit_code == 0, r.output
    assert "--drop-failed: left out 2 failed images and their 10 captions" in r.output
    keep = test_rows[test_rows != bad[0]]
    np.testing.assert_array_equal(np.load(tmp_path / "v" / "test_ims.npy"), g[keep])
    ids = demo_store.image_ids()
    assert (tmp_path / "v" / "test_ids.txt").read_text().split() == [str(ids[r]) for r in keep]
    text, owners = demo_store.caption_text(), demo_store.caption_images()
    want = [" ".join(str(text[m]).split()) for r in keep for m in np.flatnonzero(owners == r)[:5]]
    assert (tmp_path / "v" / "test_caps.txt").read_text().splitlines() == want
    train_ids = (tmp_path / "v" / "train_ids.txt").read_text().split()
    assert str(ids[bad[1]]) not in train_ids and len(train_ids) == len(demo_store.split_rows("train")) - 1
    rows = [line.split("\t") for line in (tmp_path / "v" / "dropped_failed.tsv").read_text().splitlines()]
    assert rows[0] == ["split", "image_id", "row", "captions", "reason"]
    assert sorted(rows[1:]) == sorted([["test", str(ids[bad[0]]), str(bad[0]), "5", "truncated JPEG"],
                                       ["train", str(ids[bad[1]]), str(bad[1]), "5", "cannot decode"]])
