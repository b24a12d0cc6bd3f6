"""A filesystem that refuses writes (issue 23, finding 1): full, read-only.

Each test mounts a small tmpfs of its own (root is needed; the test is skipped with the reason
where mounting is not allowed), fills it while an extraction is held at a pause point, and checks
that the run ends with one ``Error:`` line naming the path, that the lock it held is gone, and that
the rerun after freeing space gives the same bytes as an uninterrupted run.
"""

from __future__ import annotations

import shutil
import subprocess
import time
from pathlib import Path

import pytest

from vsekit.storage import FeatureStore
from vsekit.storage.lock import lock_path, writer_lock

from test_crash_rerun import FAST, NAME, assert_same, base_store, env_for, reference, run, snapshot, vsekit_cmd  # noqa: F401


# end to end (CLI runs, extraction, training, subprocesses): in `make test`, not in `make test-fast`
pytestmark = pytest.mark.e2e


@pytest.fixture()
def small_fs(tmp_path):
    """A 4 MiB tmpfs mounted for this test (the store and the filler file live there)."""
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    try:
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mnt)],
                           capture_output=True, text=True, timeout=30)
    except (FileNotFoundError, PermissionError) as exc:
        pytest.skip(f"cannot mount a small tmpfs to fill ({exc}); needs root")
    if r.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs to fill (needs root and mount permission): {r.stderr.strip()}")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], capture_output=True, timeout=30)


def fill(mnt: Path) -> Path:
    """Write a file until the filesystem is full; removing it frees the space again."""
    filler = mnt / "filler"
    block = b"\0" * 65536
    with open(filler, "wb", buffering=0) as f:
        for size in (65536, 4096, 512, 1):
            try:
                while True:
                    f.write(block[:size])
            except OSError:
                continue
    return filler


def one_error_line(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert "Traceback" not in stderr, stderr
    assert len(lines) == 1 and lines[0].startswith("Error: "), stderr
    return lines[0]


@pytest.mark.slow
def test_disk_full_during_extract_is_one_error_line_and_the_rerun_equals_uninterrupted(
        small_fs, base_store, reference, tmp_path):
    store = small_fs / "s.zarr"
    shutil.copytree(base_store, store)
    flag = tmp_path / "go"
    proc = subprocess.Popen(vsekit_cmd("extract", "--store", str(store), *FAST),
                            env=env_for(VSEKIT_PAUSE="write_block:data@3", VSEKIT_PAUSE_FILE=str(flag)),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 240
    while not Path(f"{flag}.reached").exists():   # two blocks written, the third about to be
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline
        time.sleep(0.02)
    filler = fill(small_fs)
    flag.touch()
    _, err = proc.communicate(timeout=240)
    assert proc.returncode == 1, err
    line = one_error_line(err)
    assert "No space left on device" in line and str(store) in line and "rerun" in line
    assert not lock_path(store, NAME).exists()            # released, not left behind
    counts = FeatureStore.open(store).features(NAME).counts()
    assert counts["done"] + counts["failed"] == 8 and counts["pending"] == 17   # two blocks kept
    filler.unlink()
    again = run("extract", "--store", str(store), *FAST)
    assert again.returncode == 0, again.stderr
    assert_same(snapshot(store, NAME), reference)


@pytest.mark.slow
def test_disk_full_before_the_lock_is_written_leaves_no_lock(small_fs, base_store, reference):
    store = small_fs / "s.zarr"
    shutil.copytree(base_store, store)
    with writer_lock(store, "another"):   # the lock folder exists: the lock file is what cannot be written
        pass
    filler = fill(small_fs)
    r = run("extract", "--store", str(store), *FAST)
    assert r.returncode == 1, r.stderr
    line = one_error_line(r.stderr)
    assert "No space left on device" in line and str(lock_path(store, NAME)) in line
    assert not lock_path(store, NAME).exists()            # no 0-byte lock refusing every later run
    assert list((store / ".vsekit" / "locks").iterdir()) == []
    filler.unlink()
    again = run("extract", "--store", str(store), *FAST)
    assert again.returncode == 0, again.stderr
    assert_same(snapshot(store, NAME), reference)


@pytest.mark.slow
def test_read_only_filesystem_is_one_error_line(small_fs, base_store):
    store = small_fs / "s.zarr"
    shutil.copytree(base_store, store)
    r = subprocess.run(["mount", "-o", "remount,ro", str(small_fs)], capture_output=True, text=True, timeout=30)
    if r.returncode != 0:
        pytest.skip(f"cannot remount the tmpfs read-only: {r.stderr.strip()}")
    try:
        r = run("extract", "--store", str(store), *FAST)
    finally:
        subprocess.run(["mount", "-o", "remount,rw", str(small_fs)], capture_output=True, timeout=30)
    assert r.returncode == 1, r.stderr
    line = one_error_line(r.stderr)
    assert "Read-only file system" in line and str(store) in line


@pytest.mark.slow
def test_disk_full_during_tokenize_names_the_store(small_fs, demo_dir, tmp_path):
    from vsekit.storage.sources.karpathy import ingest_karpathy

    store, _ = ingest_karpathy(demo_dir / "dataset_demo.json", demo_dir, small_fs / "s.zarr")
    flag = tmp_path / "go"
    proc = subprocess.Popen(vsekit_cmd("tokenize", "--store", str(store.path)),
                            env=env_for(VSEKIT_PAUSE="tokenize:staging", VSEKIT_PAUSE_FILE=str(flag)),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 240
    while not Path(f"{flag}.reached").exists():   # the lock is taken, the token arrays not written
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline
        time.sleep(0.02)
    filler = fill(small_fs)
    flag.touch()
    _, err = proc.communicate(timeout=240)
    assert proc.returncode == 1, err
    line = one_error_line(err)
    assert "No space left on device" in line and str(store.path) in line
    filler.unlink()
    again = run("tokenize", "--store", str(store.path))
    assert again.returncode == 0, again.stderr
    assert FeatureStore.open(store.path).has_tokens


def test_unretrieved_write_errors_after_a_full_disk_stay_out_of_the_output(caplog):
    """After one zarr write fails, zarr's other concurrent writes fail too and are never awaited;
    asyncio would print each traceback when it is collected, after the one ``Error:`` line (seen on a
    clean clone: ``Future exception was never retrieved ... FileExistsError``). The CLI drops those
    for OSErrors only; any other unretrieved exception is still reported."""
    import asyncio
    import gc
    import logging

    from vsekit.storage.fserrors import _quiet_unretrieved_write_errors

    async def fails(exc):
        raise exc

    def unretrieved(*excs):
        loop = asyncio.new_event_loop()
        tasks = [loop.create_task(fails(e)) for e in excs]
        loop.run_until_complete(asyncio.sleep(0.01))
        del tasks
        gc.collect()
        loop.close()

    caplog.set_level(logging.ERROR, logger="asyncio")
    unretrieved(FileExistsError(17, "File exists"))
    assert "never retrieved" in caplog.text   # what asyncio does by itself
    caplog.clear()
    _quiet_unretrieved_write_errors()
    unretrieved(FileExistsError(17, "File exists"), OSError(28, "No space left on device"), ValueError("kept"))
    assert "FileExistsError" not in caplog.text and "No space" not in caplog.text
    assert "ValueError: kept" in caplog.text
