"""``--device``: resolution (auto/cpu/cuda/cuda:N) against a faked GPU count, one-line errors through
every command that has the option, and the per-GPU pinning of local dask workers (no GPU needed)."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

torch = pytest.importorskip("torch")

from vsekit.cli import main  # noqa: E402
from vsekit.clusters.local import local_worker_env, local_worker_specs  # noqa: E402
from vsekit.devices import DeviceError, gpu_assignment, resolve_device  # noqa: E402


@pytest.fixture
def gpus(monkeypatch):
    """Pretend this machine has ``n`` CUDA devices."""
    def set_count(n: int):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: n > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: n)
    return set_count


@pytest.mark.parametrize("n, spec, want", [
    (0, "auto", "cpu"), (2, "auto", "cuda"), (0, None, "cpu"), (1, "AUTO", "cuda"),
    (0, "cpu", "cpu"), (2, "cpu", "cpu"), (2, "cuda", "cuda"), (2, "cuda:1", "cuda:1"), (1, "cuda:0", "cuda:0"),
])
def test_resolve(gpus, n, spec, want):
    gpus(n)
    assert resolve_device(spec) == want


@pytest.mark.parametrize("n, spec, words", [
    (0, "cuda", ["--device cuda", "no CUDA device", "available: cpu"]),
    (0, "cuda:0", ["no CUDA device"]),
    (2, "cuda:5", ["no GPU 5", "2 CUDA device", "cuda:0, cuda:1"]),
    (2, "gpu", ["'gpu' is not a device", "auto, cpu, cuda, cuda:N", "cuda:1"]),
    (2, "cuda:x", ["cuda:N"]),
    (0, "", ["is not a device"]),
])
def test_resolve_refuses(gpus, n, spec, words):
    gpus(n)
    with pytest.raises(DeviceError) as err:
        resolve_device(spec)
    msg = str(err.value)
    assert "\n" not in msg
    for w in words:
        assert w in msg, msg


def _bad_device_commands(store, run):
    return [
        ["extract", "--store", str(store), "--model", "test_resnet", "--weights", "none", "--device", "{}"],
        ["train", "--store", str(store), "--features", "x", "--out", str(run), "--device", "{}"],
        ["evaluate", str(run), "--device", "{}"],
        ["report", str(run), "--out", str(run / "rep"), "--device", "{}"],
    ]


@pytest.mark.parametrize("device", ["gpu", "cuda", "cuda:3"])
def test_every_command_refuses_a_bad_device_in_one_line(demo_store, tmp_path, device, gpus):
    gpus(0)
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text("{}")   # a run folder (an empty one is refused first: test_one_message.py)
    for argv in _bad_device_commands(demo_store.path, run):
        argv = [a.replace("{}", device) for a in argv]
        res = CliRunner().invoke(main, argv)
        assert res.exit_code == 1, (argv, res.output, res.exception)
        assert "Traceback" not in res.output and isinstance(res.exception, SystemExit)
        lines = [ln for ln in res.output.splitlines() if ln.strip()]
        assert lines[-1].startswith("Error: --device"), (argv, res.output)
        assert "cpu" in lines[-1]
    # nothing was created by the refused extract
    assert not demo_store.has_features("test_resnet_global")


def test_extract_records_the_resolved_device(demo_store, gpus):
    gpus(0)
    res = CliRunner().invoke(main, ["extract", "--store", str(demo_store.path), "--model", "test_resnet",
                                    "--weights", "none", "--input-size", "32", "--resize", "32",
                                    "--workers", "0", "--no-progress", "--batch-size", "8"])
    assert res.exit_code == 0, res.output
    from vsekit.storage import FeatureStore

    attrs = FeatureStore.open(demo_store.path).features("test_resnet_global").attrs
    assert attrs["device"] == "cpu"  # auto, resolved; not the word "auto"


# --- one worker per GPU --------------------------------------------------------------------------------
def test_gpu_assignment_round_robin():
    assert gpu_assignment(4, "cuda", 2) == ["0", "1", "0", "1"]
    assert gpu_assignment(3, "cuda", 4) == ["0", "1", "2"]
    assert gpu_assignment(2, "cuda:1", 2) == ["1", "1"]
    assert gpu_assignment(2, "cpu", 0) == [None, None]
    with pytest.raises(DeviceError):
        gpu_assignment(2, "cuda", 0)
    with pytest.raises(DeviceError):
        gpu_assignment(2, "cuda:2", 2)


def test_local_worker_env_maps_onto_visible_gpus():
    assert local_worker_env(2, "cpu", 0, None) == [{}, {}]
    assert local_worker_env(3, "cuda", 2, visible="") == [{"CUDA_VISIBLE_DEVICES": v} for v in "010"]
    # a job already restricted to GPUs 5 and 7: worker k gets the k-th of those
    assert local_worker_env(2, "cuda", 2, visible="5,7") == [{"CUDA_VISIBLE_DEVICES": "5"},
                                                             {"CUDA_VISIBLE_DEVICES": "7"}]


def test_local_worker_specs_declare_gpu_resource(monkeypatch):
    from vsekit import devices

    monkeypatch.setattr(devices, "cuda_count", lambda: 2)   # the GPUs this process sees
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    specs = local_worker_specs(2, "cuda", {"GPU": 1})
    opts = [s["options"] for s in specs.values()]
    assert [o["env"]["CUDA_VISIBLE_DEVICES"] for o in opts] == ["0", "1"]
    assert all(o["resources"] == {"GPU": 1} and o["nthreads"] == 1 for o in opts)


def test_local_cluster_pins_each_worker_to_its_own_gpu(monkeypatch):
    """Started for real (CPU machine, 2 GPUs pretended where vsekit counts them, no dask-cuda): each
    worker process sees one, different GPU, and a task that needs GPU=1 runs on both workers."""
    pytest.importorskip("distributed")
    import os

    from vsekit import devices
    from vsekit.clusters import local as cluster
    from vsekit.clusters import cluster_client

    monkeypatch.setattr(devices, "cuda_count", lambda: 2)
    monkeypatch.setattr(cluster, "_has_dask_cuda", lambda: False)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)

    def visible(_):
        import time
        time.sleep(0.2)
        return os.getpid(), os.environ.get("CUDA_VISIBLE_DEVICES")

    with cluster_client("local:2", device="cuda", resources={"GPU": 1}) as client:
        info = client.scheduler_info()["workers"]
        assert sorted(w["resources"].get("GPU") for w in info.values()) == [1, 1]
        envs = client.run(lambda: os.environ.get("CUDA_VISIBLE_DEVICES"))
        assert sorted(envs.values()) == ["0", "1"]
        got = client.gather(client.map(visible, range(6), resources={"GPU": 1}, pure=False))
    assert {v for _, v in got} <= {"0", "1"}


# --- vsekit run: --device and the `cluster:` section ---------------------------------------------------
def test_run_device_sets_every_stage(gpus):
    gpus(0)
    res = CliRunner().invoke(main, ["run", "demo", "--dry-run", "--device", "cpu"])
    assert res.exit_code == 0, res.output
    cmds = [ln.strip() for ln in res.output.splitlines() if ln.strip().startswith("vsekit ")]
    with_device = [c for c in cmds if c.split()[1] in ("extract", "train", "evaluate")]
    assert len(with_device) >= 10 and all("--device cpu" in c for c in with_device)
    bad = CliRunner().invoke(main, ["run", "demo", "--dry-run", "--device", "cuda:1"])
    assert bad.exit_code == 1 and bad.output.strip().splitlines()[-1].startswith("Error: --device cuda:1")


def test_pipeline_cluster_section(tmp_path, monkeypatch):
    from vsekit.cli.pipeline import cluster_settings_of
    from vsekit.cli import main
    from vsekit.clusters import parse_cluster
    from vsekit.pipeline import load_file, resolve_pipeline
    from vsekit.pipeline.spec import PipelineError

    f = tmp_path / "p.yaml"
    f.write_text("cluster: {queue: cpu, walltime: '01:00:00', cores: 4}\n"
                 "pipelines:\n"
                 "  a:\n"
                 "    cluster: {queue: gpu, gpus: 1}\n"
                 "    stages: [{stage: info, store: x}]\n"
                 "  b:\n"
                 "    stages: [{stage: info, store: x}]\n")
    pf = load_file(str(f))
    assert pf.get("a").cluster == {"queue": "gpu", "walltime": "01:00:00", "cores": 4, "gpus": 1}
    assert pf.get("b").cluster == {"queue": "cpu", "walltime": "01:00:00", "cores": 4}
    monkeypatch.delenv("VSEKIT_CLUSTER_CONFIG", raising=False)
    # what a stage's --cluster slurm:N gets: parsed once, with the pipeline's settings, no contextvar
    assert parse_cluster("slurm:2", cluster_settings_of(pf, "a")).settings["queue"] == "gpu"
    assert parse_cluster("slurm:2").settings == {}
    f.write_text("cluster: {queue: cpu}\n"
                 "pipelines:\n"
                 "  a:\n"
                 "    cluster: {queue: gpu, gpus: 1}\n"
                 "    stages: [{stage: tokenize, store: x, cluster: 'slurm:2'}]\n"
                 "  b:\n"
                 "    stages: [{stage: tokenize, store: x, cluster: 'slurm:2'}]\n")
    pf = load_file(str(f))
    [stage] = resolve_pipeline(pf.get("a"), main, env={}, cluster_settings=cluster_settings_of(pf, "a"))
    assert stage.values["cluster"].settings == {"queue": "gpu", "gpus": 1}
    [stage] = resolve_pipeline(pf.get("a"), main, env={}, cluster="slurm:3",
                               cluster_settings=cluster_settings_of(pf, "a"))   # `vsekit run --cluster`
    assert (stage.values["cluster"].n, stage.values["cluster"].settings["queue"]) == (3, "gpu")
    monkeypatch.setenv("VSEKIT_CLUSTER_CONFIG", '{"queue": "env"}')   # a pipeline without settings: the user's
    f.write_text("pipelines:\n  b:\n    stages: [{stage: tokenize, store: x, cluster: 'slurm:2'}]\n")
    [stage] = resolve_pipeline(load_file(str(f)).get("b"), main, env={}, cluster_settings=None)
    assert stage.values["cluster"].settings == {"queue": "env"}
    f.write_text("pipelines:\n  a:\n    cluster:\n      partition: gpu\n    stages: [{stage: info, store: x}]\n")
    with pytest.raises(PipelineError, match=r"line 4: cluster: unknown key 'partition'; valid: queue"):
        load_file(str(f))
