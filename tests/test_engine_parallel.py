"""Every executor decodes in parallel, GPU jobs get a GPU's host resources, and no run lands on the
CPU without saying so (issue 30), checked on the CPU: the decoders that really decoded each block
are recorded (``pid:thread`` of every row, summarised in the result's ``decoding``)."""

from __future__ import annotations

import json
import multiprocessing
import os
import re

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from vsekit.clusters import ClusterSpec, parse_cluster  # noqa: E402
from vsekit.extract import extract  # noqa: E402
from vsekit.storage import FeatureStore  # noqa: E402

OPTS = dict(model="test_resnet", kind="global", weights="none", input_size=32, resize=36, batch_size=4,
            block_rows=8, progress=False, device="cpu")


# end to end (CLI runs, extraction, training, subprocesses): in `make test`, not in `make test-fast`
pytestmark = pytest.mark.e2e


def test_in_process_decodes_in_worker_processes_and_records_it(demo_store):
    res = extract(demo_store, workers=2, **OPTS)
    assert res.decoding["processes"] == 2 and res.decoding["decoders"] == 2   # two batches, two workers
    fs = FeatureStore.open(demo_store.path).features(res.name)
    assert fs.attrs["device"] == "cpu"
    serial = extract(demo_store, name="serial", workers=0, **OPTS)
    assert serial.decoding == {"decoders": 1, "processes": 1, "threads": 0}
    np.testing.assert_array_equal(fs.data[:], FeatureStore.open(demo_store.path).features("serial").data[:])


def test_a_dask_task_decodes_with_threads_sized_where_it_runs(demo_store, monkeypatch):
    """Inside a dask worker (a daemon process: no child processes) a task decodes with threads; a
    tcp:// task sizes them on its worker (``auto``: at least 2), as local:N and slurm:N tasks do."""
    from vsekit.extract.distribute import extract_block
    from vsekit.extract.job import Execution, Job, Site
    from vsekit.extract.plan import make_plan

    ref = extract(demo_store, workers=0, **OPTS)
    fs = demo_store.features(ref.name)
    want = fs.data[0:8].copy()
    fs.status[0:8] = 0   # block 0 pending again
    plan = make_plan("test_resnet", "global", weights="none", input_size=32, resize=36)
    cpus = ClusterSpec("tcp", address="tcp://x:1", text="tcp://x:1").task_cpus("cpu")
    assert cpus is None   # a tcp:// worker's cores are seen on the worker
    job = Job(str(demo_store.path), ref.name, plan, Execution(device="auto", batch_size=4, workers="auto"),
              site=Site("dask", cpus))

    class Daemon:
        daemon = True
        name = "Dask Worker process"

    monkeypatch.setattr(multiprocessing, "current_process", lambda: Daemon())
    # the first two decodes wait for each other: they meet only if two threads decode at once (a
    # single decoding thread times out and its rows fail); which thread takes which later image is
    # the scheduler's choice, so the test does not depend on it
    import threading

    from vsekit.extract import reader

    meet, calls, lock = threading.Barrier(2, timeout=60), [], threading.Lock()
    real = reader.decode

    def decode(path, plan=None):
        with lock:
            calls.append(path)
            first_two = len(calls) <= 2
        if first_two:
            meet.wait()
        return real(path, plan)
    monkeypatch.setattr(reader, "decode", decode)
    out = extract_block(job, (0, 0, 8))
    assert out["device"] == "cpu"   # auto, resolved on the worker
    threads = {d for d in out["decoders"] if "vsekit-decode" in d}
    assert len(threads) >= 2 and {d.split(":")[0] for d in out["decoders"]} == {str(os.getpid())}
    got = FeatureStore.open(demo_store.path).features(ref.name)
    assert (got.status[0:8] == 1).all() and np.array_equal(got.data[0:8], want)


def _dask_threads(spec: ClusterSpec, device: str, cpus: int | None = None, workers="auto") -> int:
    """The decoding threads of one dask task of ``spec``, as resolved on its worker (extract/site.py)."""
    from vsekit.extract.job import Execution, Site
    from vsekit.extract.site import resolve

    return resolve(Execution(device="cpu", workers=workers), Site("dask", spec.task_cpus(device, cpus))).run.workers


def test_every_cluster_kind_gets_parallel_decoding():
    """Before: local:N and tcp:// got 0 decoding threads, slurm:N cores // workers with cores 1."""
    assert _dask_threads(ClusterSpec("local", 2), "cpu", cpus=2) == 2
    assert _dask_threads(ClusterSpec("local", 2), "cpu", cpus=16) == 8
    assert _dask_threads(ClusterSpec("slurm", 2, settings={}), "cpu") == 2
    assert _dask_threads(ClusterSpec("slurm", 2, settings={"gpus": 1}), "cuda") == 6   # the GPU default cores
    assert _dask_threads(ClusterSpec("slurm", 2, settings={"cores": 8, "gpus": 2}), "cuda") == 4
    assert ClusterSpec("tcp", address="tcp://h:1").task_cpus("cuda") is None   # sized on the worker
    assert _dask_threads(ClusterSpec("tcp", address="tcp://h:1"), "cuda") >= 2


def test_one_function_resolves_an_execution_for_every_site(monkeypatch):
    """Device, decoding workers, how they decode and the prefetch come from one call, on the site
    where the task runs; "at least 2" holds on cluster sites only; an explicit number is kept."""
    from vsekit.extract.job import Execution, Site
    from vsekit.extract.site import resolve
    from vsekit.extract.throughput import decode_workers

    here = resolve(Execution(device="auto", workers="auto", prefetch=3), Site("in-process", 2))
    assert (here.run.device, here.run.workers, here.run.prefetch) == ("cpu", decode_workers("auto", "cpu", cpus=2), 3)
    assert here.decoding == "processes" and here.notes == ()
    array = resolve(Execution(device="cpu", workers="auto"), Site("array", 1))
    assert array.run.workers == 2 and array.decoding == "processes"   # 1 core: still 2, decoding overlaps
    assert resolve(Execution(device="cpu", workers=0), Site("array", 8)).decoding == "in-thread"
    assert resolve(Execution(device="cpu", workers=5), Site("array", 1)).run.workers == 5
    with pytest.raises(ValueError, match="--prefetch must be >= 1"):
        resolve(Execution(device="cpu", prefetch=0), Site("in-process"))


def test_a_dask_workers_given_count_is_kept_and_noted(monkeypatch):
    """Before: on dask, --workers N was silently replaced by the cluster's own thread count. Now the
    task keeps N (as threads: a dask worker is a daemon process) and says so in a note."""
    from vsekit.extract.job import Execution, Site
    from vsekit.extract.site import resolve

    class Daemon:
        daemon = True
        name = "Dask Worker process"

    monkeypatch.setattr(multiprocessing, "current_process", lambda: Daemon())
    got = resolve(Execution(device="cpu", workers=3), Site("dask", 8))
    assert got.run.workers == 3 and got.decoding == "threads"
    assert len(got.notes) == 1 and got.notes[0].startswith("--workers 3: 3 decoding threads, not processes")
    auto = resolve(Execution(device="cpu", workers="auto"), Site("dask", 8))
    assert auto.run.workers == 8 and auto.notes == ()   # auto is the worker's share: nothing to note


def test_workers_and_prefetch_reach_an_array_tasks_execution(tmp_path):
    """Before: the array's spec was a hand-built dict without --workers and --prefetch (each task
    used auto and 2). Now the whole Execution is serialised and each task resolves it."""
    from types import SimpleNamespace

    from vsekit.extract.array import task_execution, task_spec
    from vsekit.extract.job import Execution, Job
    from vsekit.extract.plan import make_plan

    plan = make_plan("test_resnet", "global", weights="none", input_size=32, resize=36)
    run = Execution(device="cpu", batch_size=7, workers=3, prefetch=5, pin_memory="off", channels_last=False,
                    strict=True)
    store = SimpleNamespace(path=tmp_path / "s.zarr", remote=False)
    fs = SimpleNamespace(name="x", attrs={"config_hash": "h"})
    spec = json.loads(json.dumps(task_spec(store, fs, Job(str(store.path), "x", plan, run), 2, "tok")))
    got = task_execution(spec, cpus=1).run
    assert (got.workers, got.prefetch, got.batch_size, got.pin_memory, got.channels_last, got.strict) == \
        (3, 5, 7, "off", False, True)
    assert got.progress is False   # a batch log draws no bar
    assert task_execution(dict(spec, run=dict(spec["run"], workers="auto")), cpus=1).run.workers == 2


def test_a_value_that_cannot_apply_is_noted_and_recorded(demo_store, capsys):
    """--pin-memory on with the CPU: nothing to pin. Said once and kept in the set's attrs."""
    res = extract(demo_store, name="pinned", workers=0, pin_memory="on", **OPTS)
    fs = FeatureStore.open(demo_store.path).features(res.name)
    assert fs.attrs["execution_notes"] == ["--pin-memory on: the tasks run on cpu, where there is nothing "
                                           "to pin; batches are not pinned"]
    assert "vsekit: note: --pin-memory on: the tasks run on cpu" in capsys.readouterr().err
    again = extract(demo_store, name="pinned", workers=0, overwrite=True, **OPTS)
    assert FeatureStore.open(demo_store.path).features(again.name).attrs["execution_notes"] == []


@pytest.mark.slow
def test_local_cluster_run_decodes_with_threads(demo_store, capfd):
    pytest.importorskip("distributed")
    res = extract(demo_store, cluster="local:2", **OPTS)
    assert res.done == demo_store.n_images
    assert res.decoding["threads"] >= 2 and res.decoding["processes"] == 1, res.decoding
    assert res.devices == ["cpu"]
    assert FeatureStore.open(demo_store.path).features(res.name).attrs["execution_notes"] == []
    # --workers 3 on dask: kept (3 threads per task, not replaced), said once and recorded
    three = extract(demo_store, name="three", cluster="local:2", workers=3, **OPTS)
    assert 2 <= three.decoding["threads"] <= 3 and three.decoding["processes"] == 1, three.decoding
    notes = FeatureStore.open(demo_store.path).features("three").attrs["execution_notes"]
    assert len(notes) == 1 and notes[0].startswith("--workers 3: 3 decoding threads, not processes")
    assert capfd.readouterr().err.count("vsekit: note: --workers 3: 3 decoding threads") == 1


def _job_script(settings, device):
    jq = pytest.importorskip("dask_jobqueue")
    from vsekit.clusters.jobqueue import jobqueue_kwargs

    with jq.SLURMCluster(**jobqueue_kwargs("slurm", settings, device, None)) as cluster:
        return cluster.job_script()


def test_gpu_slurm_jobs_get_6_cores_16gb_per_gpu_and_never_pause():
    script = _job_script({"gpus": 2}, "cuda")
    assert "#SBATCH --cpus-per-task=12" in script and "--gres=gpu:2" in script
    mem = re.search(r"#SBATCH --mem=(\d+)G", script)
    assert mem and int(mem.group(1)) >= 29   # 32 GB as dask-jobqueue writes it (GiB)
    assert "export DASK_DISTRIBUTED__WORKER__MEMORY__PAUSE=False" in script
    cpu = _job_script({}, "cpu")   # CPU jobs keep their small defaults
    assert "#SBATCH --cpus-per-task=1" in cpu and "export DASK_DISTRIBUTED__WORKER__MEMORY__PAUSE=False" in cpu
    mine = _job_script({"gpus": 1, "cores": 3, "memory": "8GB"}, "cuda")   # the user's settings win
    assert "#SBATCH --cpus-per-task=3" in mine


def test_local_workers_never_pause():
    pytest.importorskip("distributed")
    from vsekit.clusters.local import local_worker_specs

    specs = local_worker_specs(2, "cpu")
    assert all(s["options"]["env"]["DASK_DISTRIBUTED__WORKER__MEMORY__PAUSE"] == "False" for s in specs.values())


def test_gpu_array_tasks_get_6_cores_and_16gb(tmp_path):
    from vsekit.extract.array import job_script
    from vsekit.schedulers.slurm import mem_mb

    s = job_script(tmp_path / "spec.json", "x", 4, {}, "cuda", tmp_path)
    assert "#SBATCH --cpus-per-task=6" in s and f"#SBATCH --mem={mem_mb('16GB')}M" in s and "--gres=gpu:1" in s
    c = job_script(tmp_path / "spec.json", "x", 4, {}, "cpu", tmp_path)
    assert "#SBATCH --cpus-per-task=1" in c and f"#SBATCH --mem={mem_mb('4GB')}M" in c


# --- no silent CPU --------------------------------------------------------------------------------------
def test_cuda_unavailable_names_the_driver_and_the_cuda_build(monkeypatch, capsys):
    from vsekit import devices

    monkeypatch.setattr(devices, "cuda_count", lambda: 0)
    monkeypatch.setattr(devices, "driver_version", lambda: "470.82.01")
    with pytest.raises(devices.DeviceError) as err:
        devices.resolve_device("cuda")
    build = torch.version.cuda
    assert "NVIDIA driver: 470.82.01" in str(err.value)
    assert (f"needs CUDA {build}" if build else "CPU-only build") in str(err.value)
    assert devices.resolve_device("auto") == "cpu"
    line = capsys.readouterr().err.strip()
    assert line.startswith("vsekit: note: --device auto: an NVIDIA driver is installed but CUDA is not usable")
    assert "470.82.01" in line and len(line.splitlines()) == 1
    monkeypatch.setattr(devices, "driver_version", lambda: None)
    devices.resolve_device("auto")
    assert capsys.readouterr().err == ""   # no driver: a CPU machine, nothing to say


def test_tcp_and_slurm_resolve_auto_on_the_workers():
    assert parse_cluster("tcp://127.0.0.1:8786").resolves_on_workers   # before: resolved on the driver
    assert parse_cluster("slurm:2", {}).resolves_on_workers and not parse_cluster("local:2").resolves_on_workers


def test_a_gpu_cluster_run_that_ran_on_cpu_says_so_and_records_it(demo_store, capsys):
    from vsekit.extract.runner import _record

    res = extract(demo_store, workers=0, **OPTS)
    fs = demo_store.features(res.name)
    _record(fs, {"devices": {"cpu"}}, "auto", parse_cluster("slurm:2", {}))
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("vsekit: note: --device auto on --cluster slurm:2: tasks ran on CPU")
    assert "gpus: 1" in err[0]
    attrs = FeatureStore.open(demo_store.path).features(res.name).attrs
    assert attrs["device"] == "cpu" and attrs["device_note"] in err[0]
    _record(fs, {"devices": {"cuda"}}, "auto", parse_cluster("slurm:2", {"gpus": 1}))
    assert capsys.readouterr().err == ""


def test_an_array_without_gpus_says_its_tasks_run_on_cpu(demo_store, tmp_path, monkeypatch, capfd):
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    (bin_ / "sbatch").write_text("#!/bin/bash\necho 77\n")
    (bin_ / "sbatch").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_}{os.pathsep}{os.environ['PATH']}")
    opts = dict(OPTS, device="auto")
    sub = extract(demo_store, cluster=parse_cluster("slurm-array:2", {}), **opts)
    assert sub.job_id == "77"
    err = capfd.readouterr().err
    assert "vsekit: note: --device auto on --cluster slurm-array:2: the array tasks ask for no GPU" in err
    attrs = FeatureStore.open(demo_store.path).features("test_resnet_global").attrs
    assert "ask for no GPU" in attrs["device_note"]
    spec = json.loads((demo_store.path / ".vsekit" / "arrays" / "test_resnet_global" / "spec.json").read_text())
    assert spec["run"]["device"] == "auto"   # resolved by each task on its node


def test_an_array_task_decodes_with_worker_processes(demo_store, tmp_path, monkeypatch, capfd):
    """Before: an array task on one CPU (the default) decoded serially in its main thread."""
    from vsekit.extract.array import work
    from vsekit.storage.job_arrays import array_dir

    bin_ = tmp_path / "bin"
    bin_.mkdir()
    (bin_ / "sbatch").write_text("#!/bin/bash\necho 78\n")
    (bin_ / "sbatch").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("SLURM_CPUS_PER_TASK", "1")
    extract(demo_store, cluster="slurm-array:1", **dict(OPTS, block_rows=12))
    assert work(array_dir(demo_store.path, "test_resnet_global") / "spec.json", task=0) == 0
    err = capfd.readouterr().err
    assert "device cpu, 2 decoding processes" in err
    assert re.findall(r"committed block \d+ \(rows [\d-]+\), decoded by (\d+) processes", err) == ["2", "2"]
    fs = FeatureStore.open(demo_store.path).features("test_resnet_global")
    assert fs.counts()["done"] == demo_store.n_images


def test_prefetch_is_an_option_of_the_cli_and_of_extract(demo_store, monkeypatch):
    """An option added as one field of Execution (extract/job.py) is a CLI flag and a keyword of
    extract() at once, and reaches the decoders (a prefetch dropped on the way fails here); the
    features do not depend on it."""
    from click.testing import CliRunner

    from vsekit.cli import main
    from vsekit.extract import reader, rows

    seen = []

    def spy(dataset, batches, workers, pin=False, prefetch=2, threads=False):
        seen.append((workers, prefetch))
        return reader.decoded(dataset, batches, workers, pin, prefetch, threads)

    monkeypatch.setattr(rows, "decoded", spy)
    a = extract(demo_store, name="a", workers=1, prefetch=1, **OPTS)
    b = extract(demo_store, name="b", workers=1, prefetch=4, **OPTS)
    assert a.done == b.done == demo_store.n_images
    assert seen == [(1, 1), (1, 4)]   # the decoders were asked for 1, then 4 batches ahead
    cli = CliRunner().invoke(main, ["extract", "--store", str(demo_store.path), "--model", "test_resnet",
                                    "--weights", "none", "--input-size", "32", "--resize", "36", "--name", "c",
                                    "--device", "cpu", "--workers", "1", "--prefetch", "3", "--no-progress"])
    assert cli.exit_code == 0, cli.output
    assert seen[-1] == (1, 3)
    fs = FeatureStore.open(demo_store.path)
    np.testing.assert_array_equal(fs.features("a").data[:], fs.features("b").data[:])
    res = CliRunner().invoke(main, ["extract", "--store", str(demo_store.path), "--model", "test_resnet",
                                    "--weights", "none", "--prefetch", "0"])
    assert res.exit_code == 1 and res.output.strip().splitlines()[-1] == "Error: --prefetch must be >= 1, got 0"
