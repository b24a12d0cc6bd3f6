"""Damaged feature sets: a deleted, truncated or altered chunk file (made by hand) is detected,
reported with the command that repairs it, refused by train, and the repair ends with the same bytes
as an undamaged run."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from vsekit.cli import main
from vsekit.storage import FeatureStore

torch = pytest.importorskip("torch")
torch.set_num_threads(1)

from vsekit.extract import extract  # noqa: E402
from vsekit.storage import integrity  # noqa: E402

KW = dict(weights="none", input_size=32, resize=36, batch_size=4, block_rows=4, workers=0, progress=False)



def _raw(fs) -> dict:
    return {k: np.asarray(fs.group[k][:]).tobytes() for k in sorted(fs.group.array_keys())}


@pytest.fixture()
def extracted(demo_store, tmp_path):
    """A finished extraction and a byte copy of the store made before any damage."""
    extract(demo_store, "test_resnet", "global", name="g", **KW)
    ref = tmp_path / "ref.zarr"
    shutil.copytree(demo_store.path, ref)
    return demo_store.path, _raw(FeatureStore.open(ref).features("g"))


def _chunk(path: Path, name: str, array: str, index: int) -> Path:
    fs = FeatureStore.open(path).features(name)
    return integrity._chunk_file(fs, array, index)


def test_deleted_data_chunk_is_detected_refused_by_train_and_reextracted(extracted):
    from vsekit.train.data import open_features

    path, ref = extracted
    _chunk(path, "g", "data", 2).unlink()
    r = CliRunner().invoke(main, ["info", str(path), "g", "--verify"])
    assert r.exit_code == 1 and "block 2: data chunk file missing" in r.output
    assert f"vsekit info {path} g --verify --repair" in r.output
    store = FeatureStore.open(path)
    with pytest.raises(Exception, match=r"(?s)damaged.*vsekit info .* --verify --repair.*vsekit extract --store"):
        open_features(store, "g", np.arange(store.n_images))
    extract(path, "test_resnet", "global", name="g", **KW)   # the rerun re-extracts block 2 only
    assert _raw(FeatureStore.open(path).features("g")) == ref
    assert CliRunner().invoke(main, ["info", str(path), "g", "--verify"]).exit_code == 0


def test_truncated_status_chunk_is_a_clear_error_and_repairable(extracted):
    path, ref = extracted
    f = _chunk(path, "g", "status", 1)
    f.write_bytes(f.read_bytes()[:3])
    r = CliRunner().invoke(main, ["info", str(path)])
    assert r.exit_code == 0 and "DAMAGED: status unreadable" in r.output and r.exception is None
    r = CliRunner().invoke(main, ["info", str(path), "g", "--verify"])
    assert r.exit_code == 1 and "block 1: status chunk unreadable" in r.output
    res = extract(path, "test_resnet", "global", name="g", **KW)
    assert res.blocks_run == 1
    assert _raw(FeatureStore.open(path).features("g")) == ref


def test_altered_bytes_need_the_full_check_then_repair(extracted):
    path, ref = extracted
    f = _chunk(path, "g", "data", 3)
    b = bytearray(f.read_bytes())
    b[100] ^= 0xFF
    f.write_bytes(bytes(b))
    fs = FeatureStore.open(path).features("g")
    assert integrity.verify(fs, quick=True).ok               # same size: only the CRC sees it
    r = CliRunner().invoke(main, ["info", str(path), "g", "--verify", "--repair"])
    assert "block 3: data chunk file's CRC-32" in r.output and "marked pending" in r.output
    assert "vsekit extract --store" in r.output and "--name g" in r.output
    assert FeatureStore.open(path).features("g").counts()["pending"] == 4
    extract(path, "test_resnet", "global", name="g", **KW)
    assert _raw(FeatureStore.open(path).features("g")) == ref


def test_repair_command_in_the_message_rebuilds_the_same_config(extracted):
    """The extract command quoted by the repair message resumes the set (same config hash)."""
    from vsekit.storage.remake import remake_command

    path, ref = extracted
    cmd = remake_command(FeatureStore.open(path), "g")
    args = cmd.split()[1:] + ["--no-progress", "--workers", "0"]
    r = CliRunner().invoke(main, args)
    assert r.exit_code == 0, r.output
    assert "ran 0 blocks, skipped 6 already done" in r.output
