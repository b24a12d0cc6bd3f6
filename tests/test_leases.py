"""Block leases (vsekit.storage.leases): one holder per block, expired leases taken over by exactly one
contender (20 rounds of 8 threads racing for one expired lease), and blocks committed exactly once
by processes racing for them, some of which die while holding a lease. Commits are counted from
what reached the disk (one appended line per commit)."""

from __future__ import annotations

import multiprocessing as mp
import os
import random
import threading
import time
from pathlib import Path

from vsekit.storage.leases import LeaseDir


def test_a_lease_has_one_holder_until_released(tmp_path):
    a, b = LeaseDir(tmp_path, ttl=60, owner={"task": "a"}), LeaseDir(tmp_path, ttl=60, owner={"task": "b"})
    la = a.claim(3)
    assert la is not None and b.claim(3) is None
    assert a.held(la)
    state = b.state(3)
    assert state.owner["task"] == "a" and not state.expired and state.owner["token"] == la.token
    a.release(la)
    assert b.state(3).free and not list(b.states())
    lb = b.claim(3)
    assert lb is not None and not a.held(la) and b.held(lb) and b.state(3).owner["task"] == "b"
    assert all(n.endswith(".lease") for n in os.listdir(tmp_path))  # no temporary file is left


def test_renewal_keeps_a_lease_live_and_a_lapsed_one_is_taken_over(tmp_path):
    a, b = LeaseDir(tmp_path, ttl=0.6, owner={"task": "a"}), LeaseDir(tmp_path, ttl=0.6, owner={"task": "b"})
    la = a.claim(0)
    for _ in range(6):           # 1.2 s of renewals: twice the ttl, never expired
        time.sleep(0.2)
        a.renew(la)
        assert b.claim(0) is None
    time.sleep(0.8)              # no renewal: it expires
    assert b.state(0).expired
    lb = b.claim(0)
    assert lb is not None and lb.stolen_from["task"] == "a"
    assert not a.held(la, margin=0) and b.held(lb, margin=0)
    a.renew(la)                  # the old holder's renewal touches only its own (orphaned) file
    a.release(la)                # and its release leaves the new holder's lease in place
    assert b.held(lb, margin=0) and b.state(0).owner["token"] == lb.token


def test_an_expired_lease_is_taken_over_by_exactly_one_of_many_contenders(tmp_path):
    for round_ in range(20):
        key = round_
        dead = LeaseDir(tmp_path, ttl=0.05, owner={"task": "dead"})
        assert dead.claim(key) is not None
        time.sleep(0.08)
        dirs = [LeaseDir(tmp_path, ttl=30, owner={"task": str(i)}) for i in range(8)]
        won: list = [None] * len(dirs)
        barrier = threading.Barrier(len(dirs))

        def contend(i):
            barrier.wait()
            won[i] = dirs[i].claim(key)

        threads = [threading.Thread(target=contend, args=(i,)) for i in range(len(dirs))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        winners = [i for i, lease in enumerate(won) if lease is not None]
        assert len(winners) == 1, f"round {round_}: {winners} all took the lease"
        w = winners[0]
        assert dirs[w].held(won[w]) and dirs[w].state(key).owner["task"] == str(w)
        assert not any(d.held(lease) for d, lease in zip(dirs, won) if lease is not None and lease is not won[w])
    assert not [n for n in os.listdir(tmp_path) if not n.endswith(".lease")]  # nothing left aside


# --- processes racing for blocks, following the array tasks' protocol -------------------------------
N_BLOCKS = 40


def _worker(root: str, me: int, ttl: float, die_after: int | None, seed: int) -> None:
    """Claim → status check → work → renew + held + status check → commit (append a line) → done
    marker → release. With ``die_after``, end the process (os._exit) while holding a lease."""
    rnd = random.Random(seed)
    root_p = Path(root)
    leases = LeaseDir(root_p / "leases", ttl=ttl, owner={"task": str(me)})
    done_dir = root_p / "done"
    committed = 0
    while True:
        pending = [k for k in range(N_BLOCKS) if not (done_dir / str(k)).exists()]
        if not pending:
            return
        rnd.shuffle(pending)
        got = None
        for k in pending:
            lease = leases.claim(k)
            if lease is None:
                continue
            if (done_dir / str(k)).exists():
                leases.release(lease)
                continue
            got = (k, lease)
            break
        if got is None:
            time.sleep(0.02)
            continue
        k, lease = got
        if die_after is not None and committed >= die_after:
            os._exit(9)          # killed while holding block k's lease
        time.sleep(rnd.uniform(0, 0.01))
        leases.renew(lease)
        if leases.held(lease) and not (done_dir / str(k)).exists():
            fd = os.open(root_p / "commits.log", os.O_WRONLY | os.O_APPEND | os.O_CREAT)
            os.write(fd, f"{k} {me}\n".encode())
            os.close(fd)
            (done_dir / str(k)).touch()
            committed += 1
        leases.release(lease)


def test_processes_racing_for_blocks_commit_every_block_exactly_once(tmp_path):
    (tmp_path / "done").mkdir()
    ctx = mp.get_context("fork")
    procs = [ctx.Process(target=_worker, args=(str(tmp_path), i, 0.5, 2 if i < 2 else None, i))
             for i in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    assert [p.exitcode for p in procs] == [9, 9, 0, 0]   # two died holding a lease, two finished
    lines = (tmp_path / "commits.log").read_text().split()
    blocks = [int(x) for x in lines[0::2]]
    assert sorted(blocks) == list(range(N_BLOCKS))        # every block committed, none twice
    by = [int(x) for x in lines[1::2]]
    assert by.count(0) == 2 and by.count(1) == 2           # the dead ones' commits count once
    assert not list(LeaseDir(tmp_path / "leases").states())  # every lease released or taken over
