"""standardize, discretize, fne and tokenize on dask clusters and worker processes into an ``s3://``
store (issue 35), against the local S3 server (the ``s3`` fixture): the tasks open the URL with the
storage options handed to them in memory and commit each block with one create-if-absent record
under their driver's lease token. The results equal the in-process stages on a local disk bit for
bit; a worker killed mid-pass loses nothing and writes nothing twice; a provider that ignores
conditional writes refuses the multi-writer run in one line.

The references are the same stages in-process on disk (their own tests check them against numpy:
tests/test_fne.py, tests/test_tokenize.py).
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys

import numpy as np
import pytest

pytest.importorskip("obstore")
pytest.importorskip("moto")

from click.testing import CliRunner  # noqa: E402

from vsekit.cli import main  # noqa: E402
from vsekit.fne import discretize, fne, standardize  # noqa: E402
from vsekit.storage import integrity, objcommit  # noqa: E402
from vsekit.storage.ref import StoreRef  # noqa: E402
from vsekit.storage.store import DONE, FAILED, FeatureStore  # noqa: E402

from conftest import S3_TEST_SECRET  # noqa: E402
from test_fne import SPLITS, TAPS, make_data, make_store  # noqa: E402
from test_objstore import overwriting  # noqa: E402

pytestmark = pytest.mark.e2e

BLOCK_ROWS = 8     # 60 rows: 8 blocks


def _s3_store(url: str, x: np.ndarray, status: np.ndarray, name: str = "feat") -> str:
    """The store of tests/test_fne.py's ``make_store``, built on object storage (under its ingest's leases)."""
    n = len(x)
    with FeatureStore.building(url, dataset="t") as st:
        st.write_images([f"i{i}" for i in range(n)], [f"{i}.jpg" for i in range(n)], list(SPLITS[:n]))
        fs = st.create_features(name, (x.shape[1],), np.float32, block_rows=BLOCK_ROWS,
                                attrs={"kind": "fne", "model": "vgg19", "weights": "none", "taps": TAPS})
        for b in fs.blocks():
            fs.write_block(b, x[b.start:b.stop], status[b.start:b.stop])
        fs.record_errors({int(r): "unreadable image" for r in np.flatnonzero(status == FAILED)})
    return url


@pytest.fixture(scope="module")
def data():
    return make_data(seed=21)


@pytest.fixture(scope="module")
def on_disk(tmp_path_factory, data):
    """standardize, then discretize --pack, in-process on a local disk: the reference."""
    x, status = data
    store = make_store(tmp_path_factory.mktemp("disk") / "d.zarr", x, status, block_rows=BLOCK_ROWS)
    standardize(store, "feat")
    discretize(store, "feat.z", pack=True)
    return {name: {arr: store.features(name).group[arr][:] for arr in arrays}
            for name, arrays in (("feat.z", ("data", "status", "mean", "std", "count")),
                                 ("feat.z.fne", ("data", "status")))}


def _records(s3, name: str) -> dict[int, int]:
    """Commit records per block of set ``name``, counted on the server."""
    counts: dict[int, int] = {}
    for key in s3.keys():
        if f"/.vsekit/commits/{name}/" in key:
            block = int(key.rsplit("/", 1)[1].split(".")[0])
            counts[block] = counts.get(block, 0) + 1
    return counts


def _check_equal(url: str, on_disk: dict, names=("feat.z", "feat.z.fne")) -> None:
    store = FeatureStore.open(url)
    for name in names:
        fs = store.features(name)
        for arr, want in on_disk[name].items():
            got = fs.group[arr][:]
            assert got.dtype == want.dtype and np.array_equal(got, want), (name, arr)
        assert integrity.verify(fs).ok


def _errors(output: str) -> list[str]:
    return [line for line in output.splitlines() if line.startswith("Error:")]


# --- the handle a task carries ---------------------------------------------------------------------
def test_a_store_ref_carries_the_options_in_memory_and_shows_none_of_them(s3, data):
    from vsekit.fne.derived import Pin

    url = _s3_store(s3.url(), *data)
    store = FeatureStore.open(url, mode="r+", storage_options={"secret_access_key": S3_TEST_SECRET})
    with store.writer("other", stage="test"):
        ref = StoreRef.of(store)
        assert ref.token == store.lease_token and ref.token is not None
        pin = Pin.of(store.features("feat"), "standardize")
    for shown in (repr(ref), repr(pin), str(pin)):
        assert S3_TEST_SECRET not in shown and url in shown
    back = pickle.loads(pickle.dumps(ref))   # what dask sends a worker
    opened = back.open()
    assert opened.lease_token == ref.token and opened.objects.options["secret_access_key"] == S3_TEST_SECRET
    assert np.array_equal(opened.features("feat").data[:], data[0])
    pin2 = pickle.loads(pickle.dumps(pin))
    pin2.check()   # reads the parent's generation with the carried options


# --- standardize / discretize / fne on a cluster ------------------------------------------------------
@pytest.mark.slow
def test_standardize_and_discretize_on_local_2_into_s3_equal_disk_with_one_record_per_block(s3, data, on_disk):
    url = _s3_store(s3.url(), *data)
    r = CliRunner().invoke(main, ["standardize", "--store", url, "--features", "feat", "--cluster", "local:2"])
    assert r.exit_code == 0 and "wrote 8 of 8 blocks" in r.output, r.output
    r = CliRunner().invoke(main, ["discretize", "--store", url, "--features", "feat.z", "--pack",
                                  "--cluster", "local:2"])
    assert r.exit_code == 0 and "wrote 8 of 8 blocks" in r.output, r.output
    _check_equal(url, on_disk)
    for name in ("feat.z", "feat.z.fne"):
        assert _records(s3, name) == {i: 1 for i in range(8)}
        tokens = {rec["token"] for rec in objcommit.records(FeatureStore.open(url).features(name)).values()}
        assert len(tokens) == 1          # every block committed under the one driver's lease
    assert not [k for k in s3.keys() if "/.vsekit/leases/" in k]
    # fne (both sets in one pass, one token for both leases) on local:2 gives the same sets again
    store = FeatureStore.open(url, mode="r+")
    z, q = fne(store, "feat", pack=True, cluster="local:2")
    assert (z.blocks_written, q.blocks_written) == (0, 0)     # both complete: nothing written twice
    assert _records(s3, "feat.z") == {i: 1 for i in range(8)}


@pytest.mark.slow
def test_fne_on_local_2_into_s3_survives_a_killed_worker_with_nothing_written_twice(s3, data, on_disk):
    """Every dask worker dies in its second task, between the block's two commit records (its .z
    block committed, its .z.fne chunks written and not committed): the scheduler runs the task again
    elsewhere, which leaves the committed .z block alone and commits the .z.fne one; each block ends
    with one record per set and the bits of the in-process stages on disk."""
    url = _s3_store(s3.url(), *data)
    # each task writes two records: the 4th a worker reaches is its second task's .z.fne record
    env = dict(os.environ, OMP_NUM_THREADS="1", VSEKIT_FAULT="objstore:record@4",
               DASK_DISTRIBUTED__SCHEDULER__ALLOWED_FAILURES="20")
    proc = subprocess.run([sys.executable, "-c", "from vsekit.cli import main; main()", "fne", "--store", url,
                           "--features", "feat", "--pack", "--cluster", "local:2"], env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=400)
    out = proc.stdout.decode()
    assert proc.returncode == 0, out
    assert S3_TEST_SECRET not in out
    assert "died during the run" in out, out              # the fault did kill workers
    _check_equal(url, on_disk)
    for name in ("feat.z", "feat.z.fne"):
        assert _records(s3, name) == {i: 1 for i in range(8)}
        assert FeatureStore.open(url).features(name).counts() == {"pending": 0, "done": 58, "failed": 2}


@pytest.mark.slow
def test_a_block_with_its_record_and_no_status_is_done_on_a_cluster_and_never_rewritten(s3, data, on_disk):
    """What a task killed right after its commit record (before the status chunk) leaves: the task
    run again on a dask worker finds the record and writes nothing; the driver takes the block's
    status from the record."""
    from vsekit.fne import passes

    url = _s3_store(s3.url(), *data)
    store = FeatureStore.open(url, mode="r+")
    standardize(store, "feat")
    fs = store.features("feat.z")
    gone = fs.blocks()[3]
    before = fs.data[gone.start:gone.stop]
    with store.writer("feat.z", stage="test"):
        fs.status[gone.start:gone.stop] = np.zeros(len(gone), np.uint8)   # the status chunk never written
        stamp = s3.client.head_object(Bucket=s3.bucket, Key=f"x.zarr/features/feat.z/data/c/3/0")["ETag"]
        from vsekit.fne.standardize import Standardize

        fn = Standardize(np.asarray(fs.array("mean")[:]), np.asarray(fs.array("std")[:]))
        out = passes.Output("feat.z", fn, frozenset({3}))
        from vsekit.clusters import cluster_client

        with cluster_client("local:1") as client:
            assert passes.write_pass(store.features("feat"), [out], client, check=False) == 1
    assert fs.counts() == {"pending": 0, "done": 58, "failed": 2}
    assert np.array_equal(fs.data[gone.start:gone.stop], before)
    assert s3.client.head_object(Bucket=s3.bucket, Key="x.zarr/features/feat.z/data/c/3/0")["ETag"] == stamp
    assert _records(s3, "feat.z") == {i: 1 for i in range(8)}
    _check_equal(url, on_disk, names=("feat.z",))


def test_a_provider_that_overwrites_refuses_the_cluster_run_in_one_line(s3, data, monkeypatch):
    url = _s3_store(s3.url(), *data)
    overwriting(monkeypatch)
    for args in (["standardize", "--features", "feat"], ["fne", "--features", "feat"],
                 ["tokenize", "--workers", "2"]):
        r = CliRunner().invoke(main, [*args, "--store", url, *([] if args[0] == "tokenize" else
                                                               ["--cluster", "local:2"])])
        errors = _errors(r.output)
        assert r.exit_code == 1 and len(errors) == 1, (args, r.output)
        assert "cannot keep two writers apart" in errors[0] and "without --cluster (in one process)" in errors[0]
    assert not [k for k in s3.keys() if "feat.z" in k]       # refused before any work


def test_executors_that_do_not_serve_object_storage_are_refused_by_the_fne_stages_and_tokenize(s3, data):
    url = _s3_store(s3.url(), *data)
    for stage in (["standardize", "--features", "feat"], ["fne", "--features", "feat"], ["tokenize"]):
        for cluster in ("slurm-array:2", "sge-array:1"):   # every other --cluster serves them
            r = CliRunner().invoke(main, [*stage, "--store", url, "--cluster", cluster])
            errors = _errors(r.output)
            assert r.exit_code == 1 and len(errors) == 1, (stage, cluster, r.output)
            assert "local:N / tcp:// / slurm:N / sge:N / pbs:N / lsf:N / htcondor:N for" in errors[0], errors
            assert url in errors[0]
    mem = _s3_store("memory://vsekit-cluster-test", *data)   # lives in this process only
    for args in (["standardize", "--features", "feat", "--cluster", "local:2"], ["tokenize", "--workers", "2"]):
        r = CliRunner().invoke(main, [*args, "--store", mem])
        errors = _errors(r.output)
        assert r.exit_code == 1 and len(errors) == 1 and "lives in this process only" in errors[0], r.output


# --- tokenize -----------------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("how", [["--workers", "2"], ["--cluster", "local:2"]])
def test_tokenize_with_workers_on_s3_equals_in_process_on_disk(s3, demo_dir, tmp_path, how):
    disk, url = str(tmp_path / "d.zarr"), s3.url()
    for st in (disk, url):
        r = CliRunner().invoke(main, ["ingest", "karpathy", str(demo_dir / "dataset_demo.json"), "--store", st])
        assert r.exit_code == 0, r.output
    r = CliRunner().invoke(main, ["tokenize", "--store", disk, "--min-count", "1"])
    assert r.exit_code == 0, r.output
    # small chunks: 120 captions in 8 count tasks, spread over the two workers
    from vsekit.tokenize import tokenize

    kw = {"workers": 2} if how[0] == "--workers" else {"cluster": "local:2"}
    summary = tokenize(url, min_count=1, chunk_captions=16, **kw)
    assert summary.captions == 120
    a, b = FeatureStore.open(url), FeatureStore.open(disk)
    for key in ("tokens/ids", "tokens/offsets"):
        got, want = a.root[key][:], b.root[key][:]
        assert got.dtype == want.dtype and np.array_equal(got, want), key
    for attr in ("vocabulary", "counts", "n_tokens", "n_unknown", "config_hash"):
        assert a.root["tokens"].attrs[attr] == b.root["tokens"].attrs[attr], attr
    assert not [k for k in s3.keys() if "tokens_partial" in k or "/.vsekit/leases/" in k]
    r = CliRunner().invoke(main, ["tokenize", "--store", url, "--min-count", "1", *how])   # the CLI path
    assert r.exit_code == 0 and "tokenized 120 captions" in r.output, r.output
    assert np.array_equal(FeatureStore.open(url).root["tokens/ids"][:], b.root["tokens/ids"][:])


# --- statistics from a store on object storage ----------------------------------------------------------
def test_stats_from_a_set_on_s3_give_what_the_same_statistics_give_on_disk(s3, data, on_disk, tmp_path):
    url = _s3_store(s3.url(), *data)
    standardize(url, "feat")
    disk = make_store(tmp_path / "d.zarr", *data, block_rows=BLOCK_ROWS)
    res = standardize(disk, "feat", stats_from=f"{url}::feat", name="via_s3")   # feat: its .z set is found
    fs = disk.features("via_s3")
    assert np.array_equal(fs.data[:], on_disk["feat.z"]["data"])
    assert np.array_equal(fs.array("mean")[:], on_disk["feat.z"]["mean"])
    assert fs.attrs["stats_source"] == f"{url}::feat.z" and res.details["stats_from"] == f"{url}::feat"


# --- info --verify --repair on object storage --------------------------------------------------------------
FAST = ["--model", "test_resnet", "--weights", "none", "--kind", "fne", "--crops", "1", "--input-size", "48",
        "--resize", "56", "--batch-size", "4", "--block-rows", "8", "--workers", "0", "--no-progress"]


def test_info_verify_repair_on_s3_finds_a_chunk_changed_on_the_server_and_the_rerun_refills_it(s3, demo_dir):
    """A chunk object replaced on the server by one of the same size (only its CRC-32 tells): `info
    --verify` names the block (exit 1); `--repair` marks it pending and drops its commit record; the
    command it prints refills the block with the bits it had, under one new record."""
    import shlex

    url, name = s3.url(), "test_resnet_fne"
    run = CliRunner()
    assert run.invoke(main, ["ingest", "karpathy", str(demo_dir / "dataset_demo.json"), "--store", url]).exit_code == 0
    assert run.invoke(main, ["extract", "--store", url, *FAST]).exit_code == 0
    before = FeatureStore.open(url).features(name).data[:]
    key = f"x.zarr/features/{name}/data/c/1/0"
    body = bytearray(s3.client.get_object(Bucket=s3.bucket, Key=key)["Body"].read())
    body[len(body) // 2] ^= 0xFF
    s3.client.put_object(Bucket=s3.bucket, Key=key, Body=bytes(body))

    r = run.invoke(main, ["info", url, name, "--verify"])
    assert r.exit_code == 1 and "block 1: data chunk object's CRC-32" in r.output, r.output
    r = run.invoke(main, ["info", url, name, "--verify", "--repair"])
    assert r.exit_code == 0, r.output
    assert f"repaired: 1 block(s) of {name} marked pending; now run: vsekit extract --store {url}" in r.output
    fs = FeatureStore.open(url).features(name)
    assert fs.counts()["pending"] == 8 and sorted(objcommit.records(fs)) == [0, 2]
    assert not [k for k in s3.keys() if "/.vsekit/leases/" in k]            # the repair's lease released
    command = shlex.split(r.output.split("now run: ", 1)[1].strip().splitlines()[0])
    assert command[0] == "vsekit"
    r = run.invoke(main, [*command[1:], "--workers", "0", "--no-progress"])
    assert r.exit_code == 0 and "ran 1 block" in r.output, r.output
    fs = FeatureStore.open(url).features(name)
    assert np.array_equal(fs.data[:], before) and fs.counts()["pending"] == 0
    assert _records(s3, name) == {0: 1, 1: 1, 2: 1}
    r = run.invoke(main, ["info", url, name, "--verify"])
    assert r.exit_code == 0 and "no damage found" in r.output, r.output
