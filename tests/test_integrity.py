"""Checksums (issue 23, findings 4 and 5): a finished block that lost its checksum is damage, and
nothing is trained on a block whose bytes differ from their recorded CRC-32.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from vsekit.cli import main
from vsekit.storage import FeatureStore, integrity

torch = pytest.importorskip("torch")
torch.set_num_threads(1)

from vsekit.extract import extract  # noqa: E402

KW = dict(weights="none", input_size=32, resize=36, batch_size=4, block_rows=4, workers=0, progress=False)


def _raw(fs) -> dict:
    return {k: np.asarray(fs.group[k][:]).tobytes() for k in sorted(fs.group.array_keys())}


def _chunk(path: Path, name: str, array: str, index: int) -> Path:
    return integrity._chunk_file(FeatureStore.open(path).features(name), array, index)


@pytest.fixture()
def extracted(demo_store, tmp_path):
    """A finished extraction (24 rows, blocks of 4) and its arrays' bytes before any damage."""
    extract(demo_store, "test_resnet", "global", name="g", **KW)
    return demo_store.path, _raw(demo_store.features("g"))


def test_chunk_deleted_with_its_checksum_is_damage_refused_by_train_and_rewritten(extracted):
    from vsekit.train.data import open_features

    path, ref = extracted
    _chunk(path, "g", "data", 2).unlink()
    _chunk(path, "g", integrity.SUMS, 2).unlink()
    r = CliRunner().invoke(main, ["info", str(path), "g", "--verify"])
    assert r.exit_code == 1, r.output
    assert "block 2: its rows are finished but no checksum is recorded (rows 8-11)" in r.output
    assert "older vsekit" not in r.output
    store = FeatureStore.open(path)
    with pytest.raises(Exception, match=r"block 2: its rows are finished but no checksum"):
        open_features(store, "g", np.arange(store.n_images))
    res = extract(path, "test_resnet", "global", name="g", **KW)   # the resume rewrites block 2 only
    assert res.blocks_run == 1
    assert _raw(FeatureStore.open(path).features("g")) == ref
    assert CliRunner().invoke(main, ["info", str(path), "g", "--verify"]).exit_code == 0


def test_set_that_lost_its_checksum_records_is_damage(extracted):
    """Every set records checksums from its creation (0.1.0 has no set without them): a set whose
    records are gone is reported and refused as damaged, not passed as unchecked."""
    import zarr

    from vsekit.train.data import open_features

    path, _ = extracted
    g = zarr.open_group(str(path / "features" / "g"), mode="r+")
    del g[integrity.SUMS]
    g.attrs.pop("checksummed")
    r = CliRunner().invoke(main, ["info", str(path), "g", "--verify"])
    assert r.exit_code == 1, r.output
    assert "block 0: its rows are finished but the set's list of checksummed arrays is missing (rows 0-3)" in r.output
    store = FeatureStore.open(path)
    with pytest.raises(Exception, match="damaged"):
        open_features(store, "g", np.arange(store.n_images))
    fs = store.features("g")
    assert not integrity.block_committed(fs, fs.blocks()[0])


# train verifies every block it reads ---------------------------------------------------------------
@pytest.fixture(scope="module")
def train_store(tmp_path_factory):
    """40 synthetic images with tokens and (raw float32) pixel features in blocks of 8 rows."""
    from vsekit.storage.demo import make_demo_data
    from vsekit.storage.sources.karpathy import ingest_karpathy
    from vsekit.tokenize import tokenize
    from vsekit.train.demo import pixel_features

    d = tmp_path_factory.mktemp("integrity")
    make_demo_data(d, images=40, seed=3, size=16, val_fraction=0.2, test_fraction=0.2)
    store, _ = ingest_karpathy(d / "dataset_demo.json", d, d / "s.zarr")
    tokenize(store, min_count=1)
    pixel_features(store, block_rows=8, side=4, bins=2)
    return d / "s.zarr"


def _flip(f: Path, at: int = 20) -> None:
    b = bytearray(f.read_bytes())
    b[at] ^= 0x40
    f.write_bytes(bytes(b))


def _train(store: Path, out: Path) -> object:
    return CliRunner().invoke(main, ["train", "--store", str(store), "--features", "pixels", "--model", "vse",
                                     "--out", str(out), "--preset", "demo", "--epochs", "1", "--embed-dim", "8",
                                     "--word-dim", "8", "--batch-size", "8", "--no-progress"])


def test_train_refuses_a_flipped_byte_with_one_error_line(train_store, tmp_path):
    store = tmp_path / "s.zarr"
    shutil.copytree(train_store, store)
    fs = FeatureStore.open(store).features("pixels")
    rows = store_train_rows(store)
    block = int(rows[0]) // fs.chunk_rows     # a block training reads
    _flip(integrity._chunk_file(fs, "data", block))
    assert integrity.verify(fs, quick=True).ok   # the size is unchanged: only the CRC sees it
    r = _train(store, tmp_path / "run")
    assert r.exit_code == 1, r.output
    # one Error: line (the small-validation-split warning before it is not an error)
    err = [x for x in r.output.splitlines() if x.strip() and not x.startswith(("warning:", "note:"))]
    assert len(err) == 1 and err[0].startswith("Error: feature set 'pixels'"), r.output
    lo, hi = block * fs.chunk_rows, block * fs.chunk_rows + fs.chunk_rows - 1
    assert f"block {block} (rows {lo}-{hi}) is damaged (data chunk file's CRC-32" in err[0]
    assert "--verify --repair" in err[0]
    # the same store undamaged trains
    ok = tmp_path / "ok.zarr"
    shutil.copytree(train_store, ok)
    assert _train(ok, tmp_path / "run2").exit_code == 0


def store_train_rows(path: Path) -> np.ndarray:
    return FeatureStore.open(path).split_rows("train")


def test_every_reader_path_checks_the_crc(tmp_path):
    """The raw float32 path (read straight into the window buffer) and zarr's decoding path (zstd,
    int8, region counts) both refuse a block whose bytes changed, and read the others."""
    from vsekit.train.data import FeatureSource, PairStream, Tokens

    rng = np.random.default_rng(0)
    store = FeatureStore.create(tmp_path / "s.zarr", dataset="t")
    n = 20
    store.write_images([f"i{k}" for k in range(n)], [f"{k}.jpg" for k in range(n)], ["train"] * n)
    raw = store.create_features("raw", (16,), "float32", attrs={"kind": "global"}, block_rows=8)
    zst = store.create_features("zst", (3, 16), "float32", attrs={"kind": "regions"}, block_rows=8,
                                extra={"count": ((), "int16")})
    data = rng.normal(size=(n, 16)).astype(np.float32)
    for b in raw.blocks():
        raw.write_block(b, data[b.start:b.stop])
        zst.write_block(b, np.repeat(data[b.start:b.stop, None], 3, 1),
                        count=np.full(len(b), 3, np.int16))
    for name in ("raw", "zst"):
        src = FeatureSource(store.features(name))
        got, _ = src.read(0, n)
        np.testing.assert_array_equal(got.reshape(n, -1)[:, :16], data)
    # the edge block (rows 16-19) of the raw set, and the count chunk of the regions set
    _flip(integrity._chunk_file(store.features("raw"), "data", 2), at=4)
    _flip(integrity._chunk_file(store.features("zst"), "count", 1), at=len(
        integrity._chunk_file(store.features("zst"), "count", 1).read_bytes()) - 3)
    src = FeatureSource(store.features("raw"))
    out = np.empty((4, 16), np.float32)
    with pytest.raises(Exception, match=r"block 2 \(rows 16-19\) is damaged \(data chunk file's CRC-32"):
        src.read_into(16, 20, out)
    src.read_into(8, 16, np.empty((8, 16), np.float32))   # an undamaged block reads
    with pytest.raises(Exception, match=r"block 1 \(rows 8-15\) is damaged \(count chunk file"):
        FeatureSource(store.features("zst")).read(8, 16)
    # a whole epoch: the damaged block stops it
    store.root.require_group("tokens")
    tokens = Tokens(np.arange(1, n + 1), np.arange(n + 1), [str(i) for i in range(n + 1)])
    stream = PairStream(FeatureSource(store.features("raw")), tokens, np.arange(n), np.arange(n), batch_size=4)
    with pytest.raises(Exception, match="is damaged"):
        list(stream.epoch(0))
