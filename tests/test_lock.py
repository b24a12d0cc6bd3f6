"""The writer lock (issue 23, findings 1 and 3): a lock file is complete or absent; an empty or torn
one, a reused pid and a lock not refreshed are recognised; a live holder refreshes its lock."""

from __future__ import annotations

import os
import socket
import time

import pytest

from vsekit.storage import lock
from vsekit.storage.lock import LockHeld, holder, lock_path, writer_lock


def _store(tmp_path):
    store = tmp_path / "s.zarr"
    store.mkdir()
    return store


@pytest.mark.parametrize("content", [b"", b'{"host": "h", "pid": 12', b"[]", b"\x00\x00\x00"],
                         ids=["empty", "torn-json", "not-an-object", "zeros"])
def test_empty_or_torn_lock_is_broken_at_once(tmp_path, content):
    store = _store(tmp_path)
    p = lock_path(store, "a")
    p.parent.mkdir(parents=True)
    p.write_bytes(content)             # just written: fresh, so only its content can tell it is dead
    assert holder(store, "a") is None
    with writer_lock(store, "a", stage="vsekit extract"):
        info = lock._read(p)
        assert info["pid"] == os.getpid() and info["stage"] == "vsekit extract"
    assert not p.exists()


def test_lock_file_appears_complete_and_leaves_no_temporary_file(tmp_path):
    store = _store(tmp_path)
    with writer_lock(store, "a"):
        p = lock_path(store, "a")
        assert lock._read(p)["host"] == socket.gethostname()
        assert os.stat(p).st_nlink == 1      # the temporary name it was linked from is gone
        assert sorted(x.name for x in p.parent.iterdir()) == ["a.lock"]


def test_reused_pid_is_stale_but_the_same_process_is_not(tmp_path):
    store = _store(tmp_path)
    p = lock_path(store, "a")
    here = socket.gethostname()
    start = lock._proc_start(os.getpid())
    assert start is not None
    lock._ensure_dir(store)
    # our own pid with our start time: a live holder
    p.write_text(f'{{"host": "{here}", "pid": {os.getpid()}, "proc_start": "{start}", "token": "x"}}')
    with pytest.raises(LockHeld, match=rf"pid {os.getpid()} on host"):
        with writer_lock(store, "a"):
            pass
    # the same pid, another start time: the pid was reused by another process, so the lock is stale
    p.write_text(f'{{"host": "{here}", "pid": {os.getpid()}, "proc_start": "1", "token": "x"}}')
    assert "now belongs to another process" in lock.stale_reason(p, lock._read(p))
    with writer_lock(store, "a"):
        assert lock._read(p)["proc_start"] == start


def test_heartbeat_refreshes_a_held_lock_so_other_hosts_keep_waiting(tmp_path, monkeypatch):
    store = _store(tmp_path)
    monkeypatch.setattr(lock, "HEARTBEAT_S", 0.05)
    monkeypatch.setenv(lock.STALE_ENV, "600")
    p = lock_path(store, "a")
    with writer_lock(store, "a"):
        old = time.time() - 7200
        os.utime(p, (old, old))                 # as if not refreshed for two hours
        seen_from_elsewhere = {**lock._read(p), "host": "elsewhere.invalid"}
        assert lock.stale_reason(p, seen_from_elsewhere) is not None
        deadline = time.monotonic() + 30
        while os.stat(p).st_mtime < time.time() - 600:
            assert time.monotonic() < deadline, "the holder never refreshed its lock"
            time.sleep(0.02)
        assert lock.stale_reason(p, seen_from_elsewhere) is None   # refreshed: another host waits
    assert not p.exists()


def test_filesystem_without_hard_links_still_locks(tmp_path, monkeypatch):
    import errno

    def no_link(src, dst):
        raise OSError(errno.EPERM, "Operation not permitted")

    monkeypatch.setattr(lock.os, "link", no_link)
    store = _store(tmp_path)
    with writer_lock(store, "a", stage="vsekit extract"):
        p = lock_path(store, "a")
        assert lock._read(p)["pid"] == os.getpid()
        assert sorted(x.name for x in p.parent.iterdir()) == ["a.lock"]
        with pytest.raises(LockHeld):
            lock.acquire(store, "a", "another run")
    assert not p.exists()


def test_every_guard_has_one_ttl_and_one_takeover_rule(tmp_path, monkeypatch):
    """Issue 44 item 2: the set's lock file, a block's lease (on a disk and as an object) and the set's
    lease on object storage expire after the same ttl (it was 300 s for block leases, 60 s for the set
    lease, an hour for a lock file held from another host) and are taken over by one rule: expired, or
    its holder gone from this host."""
    import json

    from vsekit.storage import leases, objleases, objstore
    from vsekit.storage.leases import LeaseDir

    assert objstore.DEFAULT_TTL_S == leases.DEFAULT_TTL_S == 60.0 and lock.HEARTBEAT_S <= 60.0 / 3
    monkeypatch.setenv("VSEKIT_LEASE_TTL_S", "30")
    assert LeaseDir(tmp_path / "b").ttl == objleases.ObjectLeaseDir(None, "x").ttl == 30.0
    store = _store(tmp_path)
    p = lock_path(store, "a")
    p.parent.mkdir(parents=True)
    p.write_text(json.dumps({"host": "elsewhere.invalid", "pid": 1, "token": "t", "ttl": 30}))
    for age, held in ((20, True), (31, False)):       # another host's lock: held until a ttl unrenewed
        os.utime(p, (time.time() - age, time.time() - age))
        assert (holder(store, "a") is not None) is held, age
    assert "expired" in lock.stale_reason(p, lock._read(p))
    here = socket.gethostname()
    gone = {"host": here, "pid": 2 ** 22 + 7, "token": "t"}   # no such pid: gone from this host
    assert leases.free_reason(gone, time.time() + 3600) == f"process {2 ** 22 + 7} on {here} is gone"
    assert leases.free_reason({"host": here, "pid": os.getpid()}, time.time() + 10) is None
    assert leases.free_reason({"host": here, "pid": os.getpid()}, time.time() - 1) is not None
    blocks = LeaseDir(tmp_path / "b", owner=gone)
    assert blocks.claim(0) is not None
    taker = LeaseDir(tmp_path / "b", owner={"host": here, "pid": os.getpid()})
    assert taker.claim(0).stolen_from["pid"] == gone["pid"]   # the same rule: taken at once, not after a ttl


def test_a_disk_writer_whose_lock_another_run_took_over_writes_no_more_blocks(tmp_path):
    """The one check of every guard before a block is written, on a disk too (issue 44 item 2): a
    writer whose lock was taken over (it expired while the writer was paused) writes neither the data
    nor the checksums nor the status of its next block."""
    import json

    import numpy as np

    from vsekit.storage.objstore import LeaseLost
    from vsekit.storage.store import FeatureStore

    st = FeatureStore.create(tmp_path / "s.zarr", dataset="t")
    st.write_images(["a", "b", "c", "d"], [f"{i}.jpg" for i in "abcd"], ["train"] * 4)
    with st.writer("f", stage="A"):
        fs = st.create_features("f", (3,), "float32", attrs={"kind": "global"}, block_rows=2)
        fs.write_block(0, np.ones((2, 3), np.float32))
        p = lock_path(st.path, "f")
        p.write_text(json.dumps(dict(json.loads(p.read_text()), token="another-run", pid=1, stage="B")))
        with pytest.raises(LeaseLost, match="lost the writer lock of feature set 'f'"):
            fs.write_block(1, np.full((2, 3), 7, np.float32))
        again = FeatureStore.open(st.path).features("f")
        assert again.status[:].tolist() == [1, 1, 0, 0]
        assert not (st.path / "features" / "f" / "data" / "c" / "1").exists()   # no chunk file of block 1
        p.unlink()


def test_a_live_holder_on_this_host_keeps_its_lock_past_its_expiry(tmp_path):
    """On a disk, a lock whose holder runs on this host now (a process stopped with Ctrl-Z, suspended
    past its ttl) is not broken: tokenize, split and info --repair write without checking their guard
    before each block, so a takeover there would let two writers write. Once the holder is gone, the
    lock is taken at once."""
    import json

    store = _store(tmp_path)
    p = lock_path(store, "a")
    p.parent.mkdir(parents=True)
    here = socket.gethostname()
    p.write_text(json.dumps({"host": here, "pid": os.getpid(), "token": "t", "ttl": 30, "stage": "held"}))
    old = time.time() - 7200
    os.utime(p, (old, old))                               # not refreshed for two hours: expired
    assert lock.stale_reason(p, lock._read(p)) is None and holder(store, "a")["stage"] == "held"
    with pytest.raises(lock.LockHeld, match="held"):
        lock.acquire(store, "a", "second")
    p.write_text(json.dumps({"host": here, "pid": 2 ** 22 + 7, "token": "t", "ttl": 30}))   # gone
    assert "is gone" in lock.stale_reason(p, lock._read(p))
