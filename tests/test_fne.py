"""FNE post-processing (issue #4): standardize, discretize, packing, resume, cluster path and CLI.

References are computed independently with plain numpy (np.mean / np.std over the chosen rows).
"""

from __future__ import annotations

import numpy as np
import pytest
from click.testing import CliRunner
from hypothesis import given, settings
from hypothesis import strategies as hst
from hypothesis.extra import numpy as hnp

from vsekit.cli import main
from vsekit.fne import discretize, fne, pack, packed_width, standardize, unpack, unpack_torch
from vsekit.fne import stats as st
from vsekit.storage import DONE, FAILED, FeatureStore, ProvenanceError, StoreError

SPLITS = np.array(["train"] * 40 + ["val"] * 12 + ["test"] * 8)
TAPS = [{"name": "a", "width": 5, "start": 0, "stop": 5}, {"name": "b", "width": 4, "start": 5, "stop": 9}]


def make_data(seed: int = 0, n: int = 60, d: int = 9) -> tuple[np.ndarray, np.ndarray]:
    """Random float32 features with a zero-variance column, a train-constant column, a constant row
    and two failed train rows (holding garbage that must not count)."""
    rng = np.random.default_rng(seed)
    x = (rng.normal(size=(n, d)) * rng.uniform(0.5, 3, size=d) + rng.normal(size=d) * 4).astype(np.float32)
    x[:, 2] = 1.75                       # zero variance everywhere
    x[:40, 6] = -3.0                     # constant over train only: std 0, so 0 in val/test too
    x[min(45, n - 1), :] = 1.75           # a constant row
    status = np.full(n, DONE, np.uint8)
    status[[3, 11]] = FAILED
    x[[3, 11]] = 1e6                     # would wreck the statistics if counted
    return x, status


def make_store(path, x, status, *, block_rows=16, taps=TAPS, name="feat", splits=SPLITS):
    store = FeatureStore.create(path, dataset="t")
    n = len(x)
    store.write_images([f"i{i}" for i in range(n)], [f"{i}.jpg" for i in range(n)], list(splits[:n]))
    attrs = {"kind": "fne", "model": "vgg19", "weights": "none"}
    if taps is not None:
        attrs["taps"] = taps
    fs = store.create_features(name, (x.shape[1],), np.float32, attrs=attrs, block_rows=block_rows)
    for b in fs.blocks():
        fs.write_block(b, x[b.start:b.stop], status[b.start:b.stop])
    if np.any(status == FAILED):
        fs.record_errors({int(r): "unreadable image" for r in np.flatnonzero(status == FAILED)})
    return store


def reference(x, status, rows):
    """Independent numpy reference: population stats over the done rows of ``rows``."""
    use = np.zeros(len(x), bool)
    use[rows] = True
    use &= status == DONE
    sel = x[use].astype(np.float64)
    mean, std = sel.mean(axis=0), sel.std(axis=0)
    z = np.where(std > 0, (x.astype(np.float64) - mean) / np.where(std > 0, std, 1), 0.0).astype(np.float32)
    z[status == FAILED] = 0
    return mean, std, int(use.sum()), z


def ternary(z, lo=-0.25, hi=0.15):
    return np.where(z > np.float32(hi), 1, np.where(z < np.float32(lo), -1, 0)).astype(np.int8)


@pytest.fixture()
def small_stats_blocks(monkeypatch):
    """Statistics blocks of 5 rows, so the Chan merge runs across many blocks even on tiny data."""
    monkeypatch.setattr(st, "CANONICAL_BYTES", 5 * 8 * 9)


# --- standardize -------------------------------------------------------------------------------------
def test_standardize_matches_numpy_reference(tmp_path, small_stats_blocks):
    x, status = make_data()
    store = make_store(tmp_path / "s.zarr", x, status)
    result = standardize(store, "feat")

    mean, std, n, z = reference(x, status, np.flatnonzero(SPLITS == "train"))
    zs = store.features("feat.z")
    np.testing.assert_allclose(zs.array("mean")[:], mean, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(zs.array("std")[:], std, rtol=1e-12, atol=1e-12)
    np.testing.assert_array_equal(zs.array("count")[:], np.full(9, n))
    assert n == 38  # 40 train rows, 2 failed
    np.testing.assert_allclose(zs.data[:], z, rtol=1e-6, atol=1e-6)
    assert zs.data.dtype == np.float32
    # zero-std columns are exactly 0 everywhere, including val/test rows where column 6 varies
    assert not zs.data[:, 2].any() and not zs.data[:, 6].any() and x[40:, 6].std() > 0
    # failed rows stay failed, with zero data and their reason carried over
    np.testing.assert_array_equal(zs.status[:], status)
    assert not zs.data[[3, 11]].any()
    assert "unreadable image" in zs.errors()[3]
    a = zs.attrs
    assert (a["parent"], a["kind"], a["taps"], a["split"]) == ("feat", "fne", TAPS, "train")
    assert (a["zero_std_features"], a["stats_rows"], a["stats_failed_excluded"]) == (2, 38, 2)
    assert result.blocks_written == 4 and result.failed_rows == 2


def test_stats_come_from_the_chosen_split_only(tmp_path):
    x, status = make_data(seed=1)
    store = make_store(tmp_path / "s.zarr", x, status)
    standardize(store, "feat", split="val", name="feat.zval")
    mean, std, n, z = reference(x, status, np.flatnonzero(SPLITS == "val"))
    zs = store.features("feat.zval")
    np.testing.assert_allclose(zs.array("mean")[:], mean, rtol=1e-12)
    np.testing.assert_allclose(zs.array("std")[:], std, rtol=1e-12)
    assert n == 12 and zs.attrs["stats_failed_excluded"] == 0
    np.testing.assert_allclose(zs.data[:], z, rtol=1e-6, atol=1e-6)
    # column 6 varies over val, so it is not zeroed this time
    assert zs.data[:, 6].any()


def test_chan_merge_is_stable_where_the_naive_formula_cancels():
    rng = np.random.default_rng(2)
    x = 1e9 + rng.uniform(0, 1, size=(1000, 3))
    states = [st.block_state(x[i:i + 37], np.full(len(x[i:i + 37]), st.USE | st.CHECK, np.uint8))
              for i in range(0, 1000, 37)]
    mean, std, count = st.finalize(st.merge_stacked(np.concatenate(states)))
    naive = np.sqrt(np.abs((x ** 2).mean(0) - x.mean(0) ** 2))
    np.testing.assert_allclose(std, x.std(0), rtol=1e-6)
    np.testing.assert_allclose(mean, x.mean(0), rtol=1e-15)
    assert np.all(count == 1000)
    assert np.max(np.abs(naive - x.std(0))) > 1e-3  # the naive formula really is wrong here


def test_results_do_not_depend_on_chunking(tmp_path, small_stats_blocks):
    x, status = make_data(seed=3)
    outs = []
    for rows in (7, 16, 60):
        store = make_store(tmp_path / f"c{rows}.zarr", x, status, block_rows=rows)
        assert store.features("feat").data.chunks[0] == rows
        fne(store, "feat")
        z, q = store.features("feat.z"), store.features("feat.z.fne")
        outs.append((z.array("mean")[:], z.array("std")[:], z.data[:], q.data[:], q.status[:]))
    for other in outs[1:]:
        for a, b in zip(outs[0], other):
            assert a.dtype == b.dtype and np.array_equal(a, b)


def test_resume_rewrites_only_pending_blocks_and_refuses_other_settings(tmp_path):
    x, status = make_data(seed=4)
    store = make_store(tmp_path / "s.zarr", x, status)
    standardize(store, "feat")
    zs = store.features("feat.z")
    good = zs.data[:]
    zs.data[16:32] = 99.0
    zs.status[16:32] = 0                    # an interrupted block
    again = standardize(store, "feat")
    assert again.blocks_written == 1 and again.blocks_total == 4
    np.testing.assert_array_equal(store.features("feat.z").data[:], good)
    assert standardize(store, "feat").blocks_written == 0
    with pytest.raises(ProvenanceError, match="different settings"):
        standardize(store, "feat", split="val")
    assert standardize(store, "feat", split="val", overwrite=True).details["split"] == "val"


def test_pending_parent_rows_are_refused(tmp_path):
    x, status = make_data()
    status[20] = 0
    store = make_store(tmp_path / "s.zarr", x, status)
    with pytest.raises(StoreError, match="1 of 60 rows are pending"):
        standardize(store, "feat")


def test_nonfinite_values_are_refused_with_rows_and_columns(tmp_path):
    x, status = make_data()
    x[5, 2], x[50, 0], x[50, 7] = np.nan, np.inf, -np.inf
    x[3, 4] = np.nan                        # in a failed row: ignored
    store = make_store(tmp_path / "s.zarr", x, status)
    with pytest.raises(StoreError) as err:
        standardize(store, "feat")
    msg = str(err.value)
    assert "3 non-finite" in msg and "rows [5, 50]" in msg and "columns [0, 2, 7]" in msg
    assert "row 5 column 2 = nan" in msg
    assert not store.has_features("feat.z")  # refused before anything was written
    # discretize finds them in its single pass
    with pytest.raises(StoreError, match=r"rows \[5, 50\] and columns \[0, 2, 7\]"):
        discretize(store, "feat", allow_raw=True)


# --- stats from elsewhere ---------------------------------------------------------------------------
def test_stats_from_another_store_and_its_refusals(tmp_path):
    x, status = make_data(seed=5)
    train = make_store(tmp_path / "train.zarr", x, status)
    standardize(train, "feat")
    y, ystatus = make_data(seed=6, n=20)
    new = make_store(tmp_path / "new.zarr", y, ystatus)
    res = standardize(new, "feat", stats_from=f"{tmp_path / 'train.zarr'}::feat")  # finds feat.z
    src, zs = train.features("feat.z"), new.features("feat.z")
    np.testing.assert_array_equal(zs.array("mean")[:], src.array("mean")[:])
    np.testing.assert_array_equal(zs.array("std")[:], src.array("std")[:])
    mean, std = src.array("mean")[:], src.array("std")[:]
    want = np.where(std > 0, (y.astype(np.float64) - mean) / np.where(std > 0, std, 1), 0).astype(np.float32)
    want[ystatus == FAILED] = 0
    np.testing.assert_allclose(zs.data[:], want, rtol=1e-6, atol=1e-6)
    assert zs.attrs["stats_from"].endswith("::feat") and res.details["split"] is None

    wide = make_store(tmp_path / "wide.zarr", np.zeros((20, 10), np.float32), np.ones(20, np.uint8), taps=None)
    with pytest.raises(StoreError, match="width 9, but feature set 'feat' has width 10"):
        standardize(wide, "feat", stats_from=f"{tmp_path / 'train.zarr'}::feat.z")
    other_taps = [dict(TAPS[0], stop=4, width=4), dict(TAPS[1], start=4, width=5)]
    moved = make_store(tmp_path / "moved.zarr", y, ystatus, taps=other_taps)
    with pytest.raises(StoreError, match="tap layout differs"):
        standardize(moved, "feat", stats_from=f"{tmp_path / 'train.zarr'}::feat.z")
    with pytest.raises(ValueError, match="expected STORE::NAME"):
        standardize(moved, "feat", stats_from=str(tmp_path / "train.zarr"))
    with pytest.raises(StoreError, match="holds no mean/std"):
        standardize(new, "feat", name="again", stats_from=f"{tmp_path / 'moved.zarr'}::feat")


# --- discretize and packing --------------------------------------------------------------------------
def test_discretize_thresholds_are_strict(tmp_path):
    lo, hi = np.float32(-0.25), np.float32(0.15)
    vals = np.array([lo, hi, np.nextafter(lo, -1), np.nextafter(hi, 1), np.nextafter(lo, 0),
                     np.nextafter(hi, 0), 0, -3, 3, 0.15, -0.25, 0.2], np.float32)
    want = np.array([0, 0, -1, 1, 0, 0, 0, -1, 1, 0, 0, 1], np.int8)
    x = np.tile(vals, (24, 1))
    x[1] = -x[1]
    status = np.full(24, DONE, np.uint8)
    status[4] = FAILED
    store = make_store(tmp_path / "s.zarr", x, status, taps=None, splits=SPLITS[:24])
    res = discretize(store, "feat", allow_raw=True)   # the thresholds are checked on the values as given
    q = store.features("feat.fne")
    assert q.data.dtype == np.int8 and res.name == "feat.fne"
    np.testing.assert_array_equal(q.data[0], want)
    np.testing.assert_array_equal(q.data[:], np.where((status == FAILED)[:, None], 0, ternary(x)))
    np.testing.assert_array_equal(q.status[:], status)
    assert q.attrs["thresholds"] == [-0.25, 0.15] and q.attrs["parent"] == "feat"

    discretize(store, "feat", thresholds=(-0.5, 0.5), pack=True, name="feat.p", allow_raw=True)
    p = store.features("feat.p")
    assert p.data.dtype == np.uint8 and p.shape == (24, 3)
    assert p.attrs["packed"] is True and p.attrs["n_features"] == 12 and p.attrs["thresholds"] == [-0.5, 0.5]
    got = unpack(p.data[:], p.attrs["n_features"])
    np.testing.assert_array_equal(got, np.where((status == FAILED)[:, None], 0, ternary(x, -0.5, 0.5)))
    with pytest.raises(ValueError, match="LO <= HI"):
        discretize(store, "feat", thresholds=(0.2, 0.1), allow_raw=True)


def test_fne_packed_equals_separate_stages(tmp_path):
    x, status = make_data(seed=7)
    a = make_store(tmp_path / "a.zarr", x, status)
    b = make_store(tmp_path / "b.zarr", x, status)
    fne(a, "feat", pack=True)
    standardize(b, "feat")
    discretize(b, "feat.z")
    za, zb = a.features("feat.z").data[:], b.features("feat.z").data[:]
    assert np.array_equal(za, zb)
    packed = a.features("feat.z.fne")
    np.testing.assert_array_equal(unpack(packed.data[:], 9), b.features("feat.z.fne").data[:])
    np.testing.assert_array_equal(b.features("feat.z.fne").data[:], ternary(zb))
    assert packed.attrs["parent"] == "feat.z" and packed.attrs["taps"] == TAPS
    assert store_lineage(a) == ["feat.z.fne", "feat.z", "feat"]


def store_lineage(store):
    return store.features("feat.z.fne").lineage()


@settings(max_examples=60, deadline=None)
@given(hnp.arrays(np.int8, hnp.array_shapes(min_dims=1, max_dims=3, max_side=13), elements=hst.integers(-1, 1)))
def test_pack_unpack_round_trip(values):
    import torch

    packed = pack(values)
    d = values.shape[-1]
    assert packed.dtype == np.uint8 and packed.shape == (*values.shape[:-1], packed_width(d))
    np.testing.assert_array_equal(unpack(packed, d), values)
    back = unpack_torch(torch.from_numpy(packed), d)
    assert back.dtype == torch.int8
    np.testing.assert_array_equal(back.numpy(), values)


def test_pack_layout_and_bad_input():
    # feature j at bits 2*(j%4) of byte j//4; codes 0 -> 00, 1 -> 01, -1 -> 11
    assert pack(np.array([1, -1, 0, 1, -1], np.int8)).tolist() == [0b01_00_11_01, 0b11]
    with pytest.raises(ValueError, match="not in"):
        pack(np.array([0, 2]))
    with pytest.raises(ValueError, match="does not fit"):
        unpack(np.zeros((2, 3), np.uint8), 20)


# --- cluster and CLI ---------------------------------------------------------------------------------
@pytest.mark.slow
def test_cluster_path_matches_in_process(tmp_path):
    x, status = make_data(seed=8)
    local = make_store(tmp_path / "l.zarr", x, status)
    dist = make_store(tmp_path / "d.zarr", x, status)
    fne(local, "feat", pack=True)
    z, q = fne(dist, "feat", pack=True, cluster="local:2")
    assert z.blocks_written == 4 and q.blocks_written == 4
    for name in ("feat.z", "feat.z.fne"):
        assert np.array_equal(local.features(name).data[:], dist.features(name).data[:])
        assert np.array_equal(local.features(name).status[:], dist.features(name).status[:])


def test_cli_commands(tmp_path):
    x, status = make_data(seed=9)
    path = tmp_path / "s.zarr"
    make_store(path, x, status)
    runner = CliRunner()
    r = runner.invoke(main, ["standardize", "--store", str(path), "--features", "feat"])
    assert r.exit_code == 0, r.output
    assert "feat -> feat.z" in r.output and "zero std features 2" in r.output
    r = runner.invoke(main, ["discretize", "--store", str(path), "--features", "feat.z",
                             "--thresholds", "-0.3", "0.2", "--pack"])
    assert r.exit_code == 0, r.output
    store = FeatureStore.open(path)
    q = store.features("feat.z.fne")
    assert q.attrs["thresholds"] == [-0.3, 0.2] and q.attrs["packed"] is True
    np.testing.assert_array_equal(unpack(q.data[:], 9), ternary(store.features("feat.z").data[:], -0.3, 0.2))
    r = runner.invoke(main, ["fne", "--store", str(path), "--features", "feat", "--pack",
                             "--thresholds", "-0.3", "0.2"])
    assert r.exit_code == 0, r.output
    assert "wrote 0 of 4 blocks (4 already done)" in r.output  # both sets were complete

    r = runner.invoke(main, ["standardize", "--store", str(path), "--features", "nope"])
    assert r.exit_code == 1 and "no feature set 'nope'" in r.output
    r = runner.invoke(main, ["standardize", "--store", str(path), "--features", "feat", "--split", "dev",
                             "--name", "x"])
    assert r.exit_code == 1 and "unknown split 'dev'" in r.output
    r = runner.invoke(main, ["fne", "--store", str(path), "--features", "feat", "--cluster", "local:0"])
    assert r.exit_code == 1 and "local:N with N >= 1" in r.output
