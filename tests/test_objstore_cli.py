"""The commands on an ``s3://`` store (issue 35), through the CLI against the local S3 server: what
works, what is refused in one Error line before any work, and that no secret is written anywhere."""

from __future__ import annotations

import pytest

pytest.importorskip("obstore")
pytest.importorskip("moto")

from click.testing import CliRunner  # noqa: E402

from vsekit.cli import main  # noqa: E402

from conftest import S3_TEST_SECRET  # noqa: E402

pytestmark = pytest.mark.e2e

FAST = ["--model", "test_resnet", "--weights", "none", "--kind", "fne", "--crops", "1", "--input-size", "48",
        "--resize", "56", "--batch-size", "4", "--block-rows", "8", "--workers", "0", "--no-progress"]


def _errors(output: str) -> list[str]:
    return [line for line in output.splitlines() if line.startswith("Error:")]


def _run(args):
    return CliRunner().invoke(main, args)


def test_ingest_extract_info_verify_on_s3_and_no_secret_is_written_anywhere(s3, demo_dir, tmp_path):
    url = s3.url("stores/demo.zarr")
    secret_opt = ["--storage-option", f"secret_access_key={S3_TEST_SECRET}",
                  "--storage-option", "region=us-east-1"]
    r = _run(["ingest", "karpathy", str(demo_dir / "dataset_demo.json"), "--store", url, *secret_opt])
    assert r.exit_code == 0, r.output
    r2 = _run(["extract", "--store", url, *FAST, *secret_opt])
    assert r2.exit_code == 0, r2.output
    assert "24 done, 0 failed, 0 pending" in r2.output
    r3 = _run(["info", url, *secret_opt])
    assert r3.exit_code == 0 and "done 24 / failed 0 / pending 0" in r3.output, r3.output
    r4 = _run(["info", url, "test_resnet_fne", "--verify", *secret_opt])
    assert r4.exit_code == 0 and "checksums verified, no damage found" in r4.output, r4.output
    # the secret (given both in the environment and as --storage-option) is in no object and no output
    keys = s3.keys()
    assert any(k.endswith("features/test_resnet_fne/zarr.json") for k in keys)
    for key in keys:
        body = s3.client.get_object(Bucket=s3.bucket, Key=key)["Body"].read()
        assert S3_TEST_SECRET.encode() not in body, key
        assert b"vsekit-test-key" not in body, key
    for res in (r, r2, r3, r4):
        assert S3_TEST_SECRET not in res.output
    # damage to a chunk object: --verify names the block (exit 1), --repair marks it pending
    chunk = next(k for k in keys if k.endswith("features/test_resnet_fne/data/c/1/0"))
    body = s3.client.get_object(Bucket=s3.bucket, Key=chunk)["Body"].read()
    s3.client.put_object(Bucket=s3.bucket, Key=chunk, Body=body[:-1])
    r5 = _run(["info", url, "test_resnet_fne", "--verify"])
    assert r5.exit_code == 1 and "block 1: data chunk object" in r5.output, r5.output
    r6 = _run(["info", url, "test_resnet_fne", "--verify", "--repair"])
    assert r6.exit_code == 0 and "repaired: 1 block(s) of test_resnet_fne marked pending" in r6.output, r6.output
    r7 = _run(["extract", "--store", url, *FAST])
    assert r7.exit_code == 0 and "ran 1 block" in r7.output, r7.output
    assert _run(["info", url, "test_resnet_fne", "--verify"]).exit_code == 0


def test_a_store_option_that_does_not_serve_object_storage_refuses_it_in_one_line(s3, tmp_path, monkeypatch):
    """Every command's --store serves a URL now (docs/store.md's table); the option type still refuses
    one where a command does not (url_ok=False), in one line naming what does, before any work."""
    import click

    from vsekit.cli.options import StorePath

    @click.command("local-only")
    @click.option("--store", type=StorePath())
    def local_only(store):
        (tmp_path / "ran").write_text(store)

    monkeypatch.chdir(tmp_path)
    url = s3.url()
    r = CliRunner().invoke(local_only, ["--store", url])
    assert r.exit_code == 2, r.output
    errors = _errors(r.output)
    assert len(errors) == 1 and url in errors[0] and "does not serve stores on object storage yet" in errors[0], r.output
    assert "every `ingest`, `split`, `extract`" in errors[0] and "`report`" in errors[0]   # and what does
    assert s3.keys() == [] and list(tmp_path.iterdir()) == []


def test_a_missing_bucket_is_one_error_line_naming_the_url_before_any_work(s3, demo_dir):
    url = "s3://no-such-bucket-vsekit/x.zarr"
    r = _run(["ingest", "karpathy", str(demo_dir / "dataset_demo.json"), "--store", url])
    errors = _errors(r.output)
    assert r.exit_code == 1 and len(errors) == 1, r.output
    assert url in errors[0] and "the bucket does not exist" in errors[0]
    for argv in (["extract", "--store", url, *FAST], ["info", url]):
        r = _run(argv)
        errors = _errors(r.output)
        assert r.exit_code == 1 and len(errors) == 1 and url in errors[0], r.output


def test_missing_credentials_are_worded_as_such_in_one_line_naming_no_internal_object(s3, demo_dir, monkeypatch):
    """Issue 45: with no credentials at all the SDK asks the instance-metadata service for some and
    fails there; the user gets one line saying credentials are missing (not the SDK's PUT to an
    address they never gave, nor a key of vsekit's own bookkeeping), and nothing reaches the bucket."""
    for var in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("AWS_METADATA_ENDPOINT", "http://127.0.0.1:9")   # no metadata service answers here
    url = s3.url()
    for argv in (["ingest", "karpathy", str(demo_dir / "dataset_demo.json"), "--store", url,
                  "--storage-option", "max_retries=0"], ["info", url, "--storage-option", "max_retries=0"]):
        r = _run(argv)
        errors = _errors(r.output)
        assert r.exit_code == 1 and len(errors) == 1, r.output
        assert url in errors[0] and "no credentials were found: set AWS_ACCESS_KEY_ID" in errors[0], errors
        for internal in ("latest/api/token", "127.0.0.1:9", ".vsekit", "zarr.json", "Generic S3 error"):
            assert internal not in r.output, (internal, r.output)
    assert s3.keys() == []


def test_an_unreachable_endpoint_is_one_error_line_after_bounded_retries(s3, demo_dir, monkeypatch):
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")    # nothing listens there
    url = s3.url()
    r = _run(["ingest", "karpathy", str(demo_dir / "dataset_demo.json"), "--store", url,
              "--storage-option", "max_retries=1", "--storage-option", "retry_timeout=2"])
    errors = _errors(r.output)
    assert r.exit_code == 1 and len(errors) == 1 and url in errors[0], r.output
    assert "cannot" in errors[0] and S3_TEST_SECRET not in r.output


def test_a_second_driver_on_one_set_is_refused(s3, demo_dir):
    from vsekit.storage import objstore
    from vsekit.storage.store import FeatureStore

    url = s3.url()
    assert _run(["ingest", "karpathy", str(demo_dir / "dataset_demo.json"), "--store", url]).exit_code == 0
    first = FeatureStore.open(url, mode="r+")
    lease = objstore.SetLease(first.objects, "test_resnet_fne", "vsekit extract", ttl=60).acquire()
    try:
        r = _run(["extract", "--store", url, *FAST])
        errors = _errors(r.output)
        assert r.exit_code == 1 and len(errors) == 1, r.output
        assert "is being written by another run (vsekit extract" in errors[0]
        assert FeatureStore.open(url).feature_names() == []      # it did nothing
    finally:
        lease.release()


def test_multi_writer_runs_are_refused_on_a_provider_that_ignores_conditions(s3, demo_dir, monkeypatch):
    from test_objstore import overwriting

    url = s3.url()
    assert _run(["ingest", "karpathy", str(demo_dir / "dataset_demo.json"), "--store", url]).exit_code == 0
    overwriting(monkeypatch)
    r = _run(["extract", "--store", url, *FAST, "--cluster", "local:2"])
    errors = _errors(r.output)
    assert r.exit_code == 1 and len(errors) == 1, r.output
    assert "cannot keep two writers apart" in errors[0] and "without --cluster (in one process)" in errors[0]
    # every writer, in-process too, is refused there unless the user says it is the only one (issue 44
    # item 4: two in-process writers both "held" the lease and one's repair deleted the other's records)
    for argv in (["extract", "--store", url, *FAST], ["tokenize", "--store", url],
                 ["ingest", "karpathy", str(demo_dir / "dataset_demo.json"), "--store", s3.url("new.zarr")]):
        r = _run(argv)
        errors = _errors(r.output)
        assert r.exit_code == 1 and len(errors) == 1, (argv, r.output)
        assert "cannot keep two writers apart" in errors[0] and "--storage-option single_writer=true" in errors[0]
    assert not [k for k in s3.keys() if "/features/" in k or "/tokens" in k or k.startswith("new.zarr")]
    # the word is one storage option, the same for every command; it never opens a multi-writer run
    single = ["--storage-option", "single_writer=true"]
    r = _run(["extract", "--store", url, *FAST, "--cluster", "local:2", *single])
    assert r.exit_code == 1 and "without --cluster (in one process)" in _errors(r.output)[0], r.output
    r = _run(["extract", "--store", url, *FAST, *single])
    assert r.exit_code == 0 and "24 done" in r.output, r.output
    assert len(s3.keys("x.zarr/.vsekit/commits/test_resnet_fne/")) == 3      # one record per block
    assert _run(["tokenize", "--store", url, *single]).exit_code == 0


def test_executors_that_do_not_serve_object_storage_refuse_it(s3, demo_dir):
    """Every --cluster serves extraction into a store on object storage (local:N, tcp://: here and
    tests/test_objstore_cluster.py; slurm:N, sge:N and their arrays: tests/test_objstore_slurm.py,
    test_objstore_array.py; pbs:N, lsf:N, htcondor:N on stand-ins: tests/test_jobqueue_standins.py). What is refused, in one Error line before any work: a job array for
    a stage other than extract, and any --cluster with a memory:// store (no worker reaches it)."""
    url = s3.url()
    assert _run(["ingest", "karpathy", str(demo_dir / "dataset_demo.json"), "--store", url]).exit_code == 0
    for cluster in ("slurm-array:2", "sge-array:2"):
        r = _run(["standardize", "--store", url, "--features", "test_resnet_fne", "--cluster", cluster])
        errors = _errors(r.output)
        assert r.exit_code == 1 and len(errors) == 1, (cluster, r.output)
        assert ("in-process or on --cluster local:N / tcp:// / slurm:N / sge:N / pbs:N / lsf:N / htcondor:N for now"
                in errors[0]), errors
        assert url in errors[0]
    assert not [k for k in s3.keys() if "/features/" in k]
    mem = "memory://vsekit-cli-refusal/x.zarr"   # lives in this process (the CLI runs in it here)
    assert _run(["ingest", "karpathy", str(demo_dir / "dataset_demo.json"), "--store", mem]).exit_code == 0
    for cluster in ("lsf:2", "htcondor:2", "local:2"):
        r = _run(["extract", "--store", mem, *FAST, "--cluster", cluster])
        errors = _errors(r.output)
        assert r.exit_code == 1 and len(errors) == 1, (cluster, r.output)
        assert f"--cluster {cluster}: a memory:// store lives in this process only" in errors[0], errors
    r = _run(["extract", "--store", mem, *FAST])              # in-process, it is served
    assert r.exit_code == 0 and "24 done" in r.output, r.output


def test_ingest_folder_on_s3_gives_the_store_ingest_on_disk_gives(s3, demo_dir, tmp_path):
    from vsekit.storage.store import FeatureStore

    images = sorted(p.name for p in (demo_dir / "images").iterdir())[:10]
    tsv = tmp_path / "caps.tsv"
    tsv.write_text("".join(f"{name}\tcaption {i}\n" for i, name in enumerate(images)))
    args = ["ingest", "folder", str(demo_dir / "images"), str(tsv), "--seed", "1"]
    r = _run([*args, "--store", s3.url()])
    assert r.exit_code == 0, r.output
    assert _run([*args, "--store", str(tmp_path / "d.zarr")]).exit_code == 0
    a, b = FeatureStore.open(s3.url()), FeatureStore.open(tmp_path / "d.zarr")
    assert a.image_ids().tolist() == b.image_ids().tolist() and len(a.image_ids()) == 10
    assert a.image_splits().tolist() == b.image_splits().tolist()
    assert a.caption_text().tolist() == b.caption_text().tolist()
    r = _run([*args, "--store", s3.url()])                     # one ingest per URL
    assert r.exit_code == 1 and len(_errors(r.output)) == 1 and "already exists" in r.output, r.output


def test_exports_from_s3_equal_exports_from_disk(s3, demo_dir, tmp_path):
    """export reads a store on S3 (its blocks checked against their commit records) and writes the
    same files as from the same store on disk."""
    import h5py
    import numpy as np

    stores = {"s3": s3.url(), "disk": str(tmp_path / "d.zarr")}
    for st in stores.values():
        assert _run(["ingest", "karpathy", str(demo_dir / "dataset_demo.json"), "--store", st]).exit_code == 0
        assert _run(["extract", "--store", st, *FAST]).exit_code == 0
    for where, st in stores.items():
        for kind, out in (("hdf5", f"{where}.h5"), ("vsepp", f"{where}-vsepp")):
            r = _run(["export", kind, "--store", st, "--features", "test_resnet_fne", "--out", str(tmp_path / out)])
            assert r.exit_code == 0, r.output
    with h5py.File(tmp_path / "s3.h5") as a, h5py.File(tmp_path / "disk.h5") as b:
        for key in ("features/test_resnet_fne/data", "features/test_resnet_fne/status", "images/id", "captions/text"):
            assert np.array_equal(a[key][:], b[key][:]), key
    names = sorted(p.name for p in (tmp_path / "disk-vsepp").iterdir())
    assert "train_ims.npy" in names and names == sorted(p.name for p in (tmp_path / "s3-vsepp").iterdir())
    for name in names:
        assert (tmp_path / "s3-vsepp" / name).read_bytes() == (tmp_path / "disk-vsepp" / name).read_bytes(), name


def test_tokenize_on_s3_writes_the_tokens_it_writes_on_disk(s3, demo_dir, tmp_path):
    import numpy as np

    from vsekit.storage.store import FeatureStore

    stores = {"s3": s3.url(), "disk": str(tmp_path / "d.zarr")}
    for where, st in stores.items():
        assert _run(["ingest", "karpathy", str(demo_dir / "dataset_demo.json"), "--store", st]).exit_code == 0
        r = _run(["tokenize", "--store", st, "--min-count", "1"])
        assert r.exit_code == 0 and "tokenized 120 captions" in r.output, r.output
        assert _run(["export", "vocab", "--store", st, "--out", str(tmp_path / f"{where}.json")]).exit_code == 0
    a, b = FeatureStore.open(stores["s3"]), FeatureStore.open(stores["disk"])
    for key in ("tokens/ids", "tokens/offsets"):
        assert np.array_equal(a.root[key][:], b.root[key][:]), key
    assert a.root["tokens"].attrs["vocabulary"] == b.root["tokens"].attrs["vocabulary"]
    assert (tmp_path / "s3.json").read_bytes() == (tmp_path / "disk.json").read_bytes()
    assert not [k for k in s3.keys() if "tokens_partial" in k]       # the staging objects are gone
    # --workers N and --cluster on S3: tests/test_objstore_cluster.py


def test_standardize_and_discretize_on_s3_equal_disk(s3, demo_dir, tmp_path):
    """FNE post-processing on S3 (in this process; on clusters: tests/test_objstore_cluster.py): the statistics are in the set before it is
    published, each block has one commit record, and every array equals the same stages on disk."""
    import numpy as np

    from vsekit.storage import objcommit
    from vsekit.storage.store import FeatureStore

    stores = {"s3": s3.url(), "disk": str(tmp_path / "d.zarr")}
    for st in stores.values():
        assert _run(["ingest", "karpathy", str(demo_dir / "dataset_demo.json"), "--store", st]).exit_code == 0
        assert _run(["extract", "--store", st, *FAST]).exit_code == 0
        r = _run(["standardize", "--store", st, "--features", "test_resnet_fne"])
        assert r.exit_code == 0 and "wrote 3 of 3 blocks" in r.output, r.output
        r = _run(["discretize", "--store", st, "--features", "test_resnet_fne.z", "--pack"])
        assert r.exit_code == 0 and "wrote 3 of 3 blocks" in r.output, r.output
    a, b = FeatureStore.open(stores["s3"]), FeatureStore.open(stores["disk"])
    for name, arrays in (("test_resnet_fne.z", ("data", "mean", "std", "count", "status")),
                         ("test_resnet_fne.z.fne", ("data", "status"))):
        for arr in arrays:
            assert np.array_equal(a.features(name).group[arr][:], b.features(name).group[arr][:]), (name, arr)
        assert sorted(objcommit.records(a.features(name))) == [0, 1, 2]
        r = _run(["info", stores["s3"], name, "--verify"])
        assert r.exit_code == 0 and "no damage found" in r.output, r.output
    # fne (both stages in one pass, two leases) gives the same sets again under other names
    r = _run(["extract", "--store", stores["s3"], *FAST, "--name", "copy"])
    assert r.exit_code == 0, r.output
    r = _run(["fne", "--store", stores["s3"], "--features", "copy", "--pack"])
    assert r.exit_code == 0, r.output
    for suffix in (".z", ".z.fne"):
        assert np.array_equal(a.features("copy" + suffix).data[:], b.features("test_resnet_fne" + suffix).data[:])
    assert not [k for k in s3.keys() if "/.vsekit/leases/" in k]          # both leases released
    again = _run(["standardize", "--store", stores["s3"], "--features", "test_resnet_fne"])
    assert again.exit_code == 0 and "wrote 0 of 3 blocks" in again.output, again.output
    # on a cluster (local:N, tcp://, slurm:N, sge:N): tests/test_objstore_cluster.py; job arrays are refused
    r = _run(["discretize", "--store", stores["s3"], "--features", "test_resnet_fne.z", "--cluster", "slurm-array:2",
              "--name", "other"])
    errors = _errors(r.output)
    assert r.exit_code == 1 and len(errors) == 1 and "local:N / tcp:// / slurm:N / sge:N" in errors[0], r.output


def test_train_and_evaluate_on_s3_give_the_run_they_give_on_disk(s3, demo_dir, tmp_path):
    """`vsekit train` reads its windows from the S3 store (each block checked against its commit
    record), the run records the URL (not its credentials), and `vsekit evaluate` and `vsekit embed`
    of the run reopen it: the weights, the logged losses, the test metrics and the embeddings equal
    the same run on a disk store."""
    import json

    import torch

    stores = {"s3": s3.url(), "disk": str(tmp_path / "d.zarr")}
    train = ["--features", "test_resnet_fne", "--model", "vse", "--preset", "demo", "--embed-dim", "16",
             "--word-dim", "8", "--batch-size", "8", "--epochs", "2", "--no-progress", "--device", "cpu",
             "--shuffle-memory", "0.0001"]   # several windows: the reads cross block boundaries
    metrics = {}
    for where, st in stores.items():
        assert _run(["ingest", "karpathy", str(demo_dir / "dataset_demo.json"), "--store", st]).exit_code == 0
        assert _run(["extract", "--store", st, *FAST]).exit_code == 0
        assert _run(["tokenize", "--store", st, "--min-count", "1"]).exit_code == 0
        out = tmp_path / f"run-{where}"
        r = _run(["train", "--store", st, "--out", str(out), *train,
                  "--storage-option", f"secret_access_key={S3_TEST_SECRET}"])
        assert r.exit_code == 0 and "trained vse for 2 epochs" in r.output, r.output
        r = _run(["evaluate", str(out), "--split", "test", "--protocol", "all"])
        assert r.exit_code == 0, r.output
        metrics[where] = json.loads((out / "metrics.json").read_text())
        r = _run(["embed", str(out), "--split", "test", "--out", str(tmp_path / f"emb-{where}")])
        assert r.exit_code == 0, r.output
    config = json.loads((tmp_path / "run-s3" / "config.json").read_text())
    assert config["store"] == stores["s3"]
    for f in (tmp_path / "run-s3").rglob("*"):
        if f.is_file():
            assert S3_TEST_SECRET.encode() not in f.read_bytes(), f
    a = torch.load(tmp_path / "run-s3" / "checkpoint_last.pt", weights_only=False)["model"]
    b = torch.load(tmp_path / "run-disk" / "checkpoint_last.pt", weights_only=False)["model"]
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    logs = {w: [json.loads(x) for x in (tmp_path / f"run-{w}" / "metrics.jsonl").read_text().splitlines()]
            for w in stores}
    assert len(logs["s3"]) == 3 and logs["s3"][-1]["loss"] > 0
    assert [(e["loss"], e["val"]) for e in logs["s3"]] == [(e["loss"], e["val"]) for e in logs["disk"]]
    assert metrics["s3"]["protocols"] == metrics["disk"]["protocols"]
    import numpy as np

    for f in ("images.npy", "captions.npy"):
        assert np.array_equal(np.load(tmp_path / "emb-s3" / f), np.load(tmp_path / "emb-disk" / f)), f


def test_a_commands_storage_options_do_not_carry_over_to_the_next_command_in_one_process(s3, demo_dir):
    """`--storage-option` values belong to one command: a second command run in the same process (as
    tests and notebooks do) starts from none, so it neither reuses the first one's credentials nor
    its endpoint."""
    url = s3.url("carry.zarr")
    r = _run(["ingest", "karpathy", str(demo_dir / "dataset_demo.json"), "--store", url])
    assert r.exit_code == 0, r.output
    dead = ["--storage-option", "endpoint=http://127.0.0.1:9", "--storage-option", "max_retries=0",
            "--storage-option", "retry_timeout=1"]
    r1 = _run(["info", url, *dead])
    assert r1.exit_code != 0 and "refused the connection" in r1.output, r1.output
    r2 = _run(["info", url])          # the environment's endpoint again, not the last command's
    assert r2.exit_code == 0 and "images" in r2.output, r2.output


def test_an_in_process_extract_whose_lease_was_taken_over_ends_in_one_error_line_and_writes_no_more(
        s3, demo_dir, monkeypatch):
    """Issue 44 item 4: the run is paused past its lease's expiry after its first block, and another run
    takes the set over. It ended in a traceback (``DriverGone``, words for a dask task); now it is one
    Error line saying that the lease was lost and what was kept, and nothing more reaches the store."""
    import json

    from vsekit.storage import objcommit, objstore

    url = s3.url()
    assert _run(["ingest", "karpathy", str(demo_dir / "dataset_demo.json"), "--store", url]).exit_code == 0
    write_record = objcommit.write_record

    def then_taken_over(fs, block, status):
        done = write_record(fs, block, status)
        key = objstore.lease_key("test_resnet_fne")
        taker = dict(fs.store.objects.get_json(key)[0], token="another-run", pid=1, stage="vsekit extract (B)")
        fs.store.objects.put(key, objstore.dumps(taker))   # what B's takeover after the expiry leaves
        return done

    monkeypatch.setattr(objcommit, "write_record", then_taken_over)
    r = _run(["extract", "--store", url, *FAST])
    errors = _errors(r.output)
    assert r.exit_code == 1 and len(errors) == 1, r.output
    assert "Traceback" not in r.output and "DriverGone" not in r.output and "submitted" not in r.output
    assert "lost the lease of feature set 'test_resnet_fne'" in errors[0] and "another run took it over" in errors[0]
    assert "Kept: 8 done and 0 failed rows of 24" in errors[0], errors
    records = s3.keys("x.zarr/.vsekit/commits/test_resnet_fne/")
    assert len(records) == 1                                        # block 0 only: nothing after the loss
    assert not [k for k in s3.keys("x.zarr/features/test_resnet_fne/data/") if "/c/1/" in k or "/c/2/" in k]
    lease = json.loads(s3.client.get_object(Bucket=s3.bucket, Key="x.zarr/" + objstore.lease_key(
        "test_resnet_fne"))["Body"].read())
    assert lease["token"] == "another-run"                          # the taker's lease is left alone
