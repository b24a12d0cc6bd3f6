"""Generations and overwrites (issue 23, findings 7, 8 and 9).

* A derived stage reading a set that ``extract --overwrite`` makes again stops with one ``Error:``
  line and writes nothing (it used to write the new data standardized with the old statistics).
* A failed ``--overwrite`` leaves the old set exactly as it was (it used to delete it), and a
  checkpoint torch refuses is one ``Error:`` line.
* The detector checkpoint's content is part of the settings: the same path holding another file
  is refused on resume.

The concurrent case is deterministic: the reader is held at a named point (``VSEKIT_PAUSE``) while
the overwrite runs to its end, then let go.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from vsekit.cli import main
from vsekit.storage import FeatureStore
from vsekit.storage.store import ProvenanceError

torch = pytest.importorskip("torch")
torch.set_num_threads(1)

from vsekit.extract import extract  # noqa: E402

SRC = Path(__file__).resolve().parents[1] / "src"
KW = dict(weights="none", input_size=32, resize=36, batch_size=4, block_rows=4, workers=0, progress=False)
FAST = ["--model", "test_resnet", "--weights", "none", "--input-size", "32", "--resize", "36",
        "--batch-size", "4", "--block-rows", "4", "--no-progress", "--workers", "0"]


# end to end (CLI runs, extraction, training, subprocesses): in `make test`, not in `make test-fast`
pytestmark = pytest.mark.e2e


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("VSEKIT_")}
    env.update(PYTHONPATH=f"{SRC}{os.pathsep}{env.get('PYTHONPATH', '')}", OMP_NUM_THREADS="1", **extra)
    return env


def _cmd(*args: str) -> list[str]:
    return [sys.executable, "-c", "import sys; from vsekit.cli import main; sys.exit(main())", *args]


def _held(args: list[str], point: str, flag: Path) -> subprocess.Popen:
    """Start ``vsekit ARGS`` and wait until it is held at ``point``."""
    proc = subprocess.Popen(_cmd(*args), env=_env(VSEKIT_PAUSE=point, VSEKIT_PAUSE_FILE=str(flag)),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    reached = Path(f"{flag}.reached")
    deadline = time.monotonic() + 120
    while not reached.exists():
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "the run never reached its pause point"
        time.sleep(0.02)
    return proc


def _snapshot(path: Path, name: str) -> dict:
    """Every array's bytes and every attr (the generation included) of set ``name``."""
    fs = FeatureStore.open(path).features(name)
    out = {"attrs": fs.attrs}
    for key in sorted(fs.group.array_keys()):
        out[key] = np.asarray(fs.group[key][:]).tobytes()
    return out


def _hidden(path: Path) -> list[str]:
    return sorted(p.name for p in (path / "features").iterdir() if p.name.startswith("."))


@pytest.fixture()
def r18(demo_store):
    """A finished extraction ``r18`` (24 rows in blocks of 4)."""
    extract(demo_store, "test_resnet", "global", name="r18", **KW)
    return demo_store.path


def _numpy_standardize(path: Path, name: str) -> np.ndarray:
    store = FeatureStore.open(path)
    x = np.asarray(store.features(name).data[:], np.float64)
    train = store.split_rows("train")
    mean, std = x[train].mean(0), x[train].std(0)
    return ((x - mean) / np.where(std > 0, std, 1)).astype(np.float32)


# finding 7 ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("point", ["standardize:stats", "write_block:data"])
def test_standardize_reading_a_set_remade_by_overwrite_errors_and_writes_nothing(r18, tmp_path, point):
    """Held after its statistics (``standardize:stats``) or while writing its first block, the
    standardize of ``r18`` sees ``r18`` made again with other settings, then goes on."""
    flag = tmp_path / "go"
    reader = _held(["standardize", "--store", str(r18), "--features", "r18"], point, flag)
    try:
        extract(r18, "test_resnet", "global", name="r18", overwrite=True, **{**KW, "resize": 40})
    finally:
        flag.touch()
        out, err = reader.communicate(timeout=300)
    assert reader.returncode == 1, (out, err)
    lines = [x for x in err.splitlines() if x.strip()]
    assert len(lines) == 1 and lines[0].startswith("Error: feature set 'r18'"), err
    assert "made again (--overwrite) while standardize was reading it; nothing was written" in lines[0]
    store = FeatureStore.open(r18)
    assert not store.has_features("r18.z") and _hidden(r18) == []
    # the rerun standardizes the new r18 with its own statistics
    r = subprocess.run(_cmd("standardize", "--store", str(r18), "--features", "r18"), env=_env(),
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    z = FeatureStore.open(r18).features("r18.z")
    np.testing.assert_allclose(np.asarray(z.data[:]), _numpy_standardize(r18, "r18"), rtol=1e-5, atol=1e-5)


def test_a_derived_set_of_an_earlier_parent_is_not_resumed(r18):
    """Same settings, but the parent was made again since (its bytes may differ: images replaced,
    another library version): the old .z is refused, not reused."""
    from vsekit.fne import standardize

    standardize(r18, "r18")
    extract(r18, "test_resnet", "global", name="r18", overwrite=True, **KW)
    with pytest.raises(ProvenanceError, match=r"'r18.z' .* was made from an earlier 'r18' .*--overwrite"):
        standardize(r18, "r18")
    standardize(r18, "r18", overwrite=True)
    z = FeatureStore.open(r18).features("r18.z")
    np.testing.assert_allclose(np.asarray(z.data[:]), _numpy_standardize(r18, "r18"), rtol=1e-5, atol=1e-5)


# finding 8 ----------------------------------------------------------------------------------------
class _Evil:
    def __reduce__(self):
        return (print, ("this ran",))


def test_failed_extract_overwrite_keeps_the_old_set_and_says_why_in_one_line(r18, tmp_path):
    before = _snapshot(r18, "r18")
    bad = tmp_path / "bad.pt"
    torch.save({"w": _Evil()}, bad)
    r = CliRunner().invoke(main, ["extract", "--store", str(r18), "--name", "r18", "--overwrite",
                                  *FAST[:2], "--weights", str(bad), *FAST[4:]])
    assert r.exit_code == 1
    lines = [x for x in r.output.splitlines() if x.strip()]
    assert len(lines) == 1 and lines[0].startswith(f"Error: --weights {bad}: cannot load it"), r.output
    assert "weights_only=False" not in r.output and "Unsupported global" in lines[0]
    assert _snapshot(r18, "r18") == before and _hidden(r18) == []
    # a successful overwrite swaps the new set in
    r = CliRunner().invoke(main, ["extract", "--store", str(r18), "--name", "r18", "--overwrite", *FAST,
                                  "--seed", "1"])
    assert r.exit_code == 0, r.output
    after = _snapshot(r18, "r18")
    assert after["attrs"]["generation"] != before["attrs"]["generation"] and after["data"] != before["data"]
    assert _hidden(r18) == []


@pytest.mark.slow
def test_killed_overwrite_leaves_the_old_set_and_the_rerun_replaces_it(r18):
    """Killed mid-overwrite (second block written): the old set is whole; the rerun overwrites."""
    before = _snapshot(r18, "r18")
    args = ["extract", "--store", str(r18), "--name", "r18", "--overwrite", *FAST, "--seed", "1"]
    killed = subprocess.run(_cmd(*args), env=_env(VSEKIT_FAULT="write_block:status@2"),
                            capture_output=True, text=True, timeout=300)
    assert killed.returncode == 137, killed.stderr
    assert _snapshot(r18, "r18") == before
    assert subprocess.run(_cmd(*args), env=_env(), capture_output=True, text=True, timeout=300).returncode == 0
    assert _snapshot(r18, "r18")["attrs"]["seed"] == 1 and _hidden(r18) == []


def test_failed_standardize_overwrite_keeps_the_old_set(r18):
    from vsekit.fne import standardize

    standardize(r18, "r18")
    before = _snapshot(r18, "r18.z")
    args = ["standardize", "--store", str(r18), "--features", "r18", "--split", "train,test", "--overwrite"]
    killed = subprocess.run(_cmd(*args), env=_env(VSEKIT_FAULT="write_block:status@2"),
                            capture_output=True, text=True, timeout=300)
    assert killed.returncode == 137, killed.stderr
    assert _snapshot(r18, "r18.z") == before


# finding 9 ----------------------------------------------------------------------------------------
def test_detector_checkpoint_swapped_at_the_same_path_is_another_setting(demo_store, tmp_path):
    from vsekit.extract.plan import make_plan
    from vsekit.extract.regions import region_arrays

    ckpt = tmp_path / "detector.pt"
    torch.save({"a": torch.zeros(3)}, ckpt)
    opts = dict(weights="none", input_size=32, boxes="detector", detector="coco-frcnn",
                detector_weights=str(ckpt), max_regions=4)
    plan = make_plan("test_resnet", "regions", **opts)
    assert plan.attrs()["detector_sha256"].startswith("sha256:")
    # what the first run's creation leaves (rows 0-1 were done with the first detector)
    fs = demo_store.create_features("r", plan.row_shape, plan.store_dtype, attrs=plan.attrs(),
                                    block_rows=4, extra=region_arrays(plan))
    torch.save({"a": torch.ones(3)}, ckpt)   # another detector at the same path
    with pytest.raises(ProvenanceError, match="'r' already exists .* with different settings"):
        extract(demo_store, "test_resnet", "regions", name="r", batch_size=4, block_rows=4, workers=0,
                progress=False, **opts)
    assert FeatureStore.open(demo_store.path).features("r").attrs == fs.attrs
    # BUTD's checkpoint too
    butd = dict(detector="butd-r101", detector_weights=str(ckpt), boxes="detector", max_regions=4)
    a = make_plan("x", "regions", **butd).attrs()
    torch.save({"a": torch.zeros(3)}, ckpt)
    assert make_plan("x", "regions", **butd).attrs()["detector_sha256"] != a["detector_sha256"]


def test_train_reader_refuses_a_set_made_again_while_it_reads(tmp_path):
    """``FeatureSource`` (train, evaluate, embed) opened on one making of a set stops at the next
    block it reads once the set was made again, instead of mixing the two."""
    from vsekit.train.data import FeatureSource

    store = FeatureStore.create(tmp_path / "s.zarr", dataset="t")
    store.write_images([f"i{k}" for k in range(16)], [f"{k}.jpg" for k in range(16)], ["train"] * 16)

    def make(value: float, overwrite: bool):
        fs = store.create_features("f", (4,), "float32", attrs={"kind": "global"}, block_rows=8,
                                   overwrite=overwrite, beside=True)
        for b in fs.blocks():
            fs.write_block(b, np.full((len(b), 4), value, np.float32))
        return store.commit(fs)

    make(1.0, False)
    src = FeatureSource(store.features("f"))
    out = np.empty((8, 4), np.float32)
    src.read_into(0, 8, out)
    assert np.all(out == 1.0)
    make(2.0, True)
    with pytest.raises(Exception, match="'f' .* was replaced .* while this command was reading it"):
        src.read_into(8, 16, out)
    with pytest.raises(Exception, match="was replaced"):
        src.read(0, 8)
    assert np.all(FeatureSource(store.features("f")).read(0, 16)[0] == 2.0)
