"""How ``--cluster`` is offered and how SLURM jobs are shaped, without a SLURM: the ``--help`` of
every stage with ``--cluster``, the job scripts dask-jobqueue would submit
(``SLURMCluster.job_script()``), the GPU pinning of a job's workers, the device a task resolves on
its worker, and the decoding threads of a task."""

from __future__ import annotations

import re
import threading

import pytest
from click.testing import CliRunner

from vsekit.cli import main
from vsekit.clusters import ClusterSpec, parse_cluster
from vsekit.clusters.jobqueue import jobqueue_kwargs
from vsekit.cluster_pin import gpu_for

FORMS = ("local:N", "slurm:N", "slurm-array:N", "tcp://HOST:PORT")


@pytest.mark.parametrize("command", [["extract"], ["standardize"], ["discretize"], ["fne"], ["tokenize"],
                                     ["run"]])
def test_help_of_every_stage_with_cluster_lists_every_form(command):
    """Finding 8: the --help of extract/standardize/tokenize/fne listed only local:N|tcp://."""
    out = CliRunner().invoke(main, [*command, "--help"], terminal_width=200)
    assert out.exit_code == 0, out.output
    text = " ".join(out.output.split())
    for form in FORMS:
        assert form in text, f"{command[0]} --help does not name {form}"


def test_parse_cluster_knows_every_form():
    def form(spec):
        return spec.kind, spec.address or spec.n

    assert form(parse_cluster("local:2")) == ("local", 2)
    assert form(parse_cluster("slurm:3", {})) == ("slurm", 3)
    assert form(parse_cluster("slurm-array:4", {})) == ("slurm-array", 4)
    assert form(parse_cluster("tcp://127.0.0.1:8786")) == ("tcp", "tcp://127.0.0.1:8786")
    assert parse_cluster(parse_cluster("local:2")) == parse_cluster("local:2")   # parsed once, passed on
    with pytest.raises(ValueError, match="slurm-array:N with N >= 1"):
        parse_cluster("slurm-array:0")


def slurm(settings):
    return ClusterSpec("slurm", 1, settings=settings)


def _job_script(settings, device):
    jq = pytest.importorskip("dask_jobqueue")
    with jq.SLURMCluster(**jobqueue_kwargs("slurm", settings, device, None)) as cluster:
        return cluster.job_script()


def test_gpu_job_runs_one_pinned_single_threaded_worker_per_gpu():
    """Findings 6 and 8: G GPUs per job → --gres=gpu:G and G workers, each pinned to one GPU
    (preload), declaring GPU=1; --nthreads once; the job's cores are its CPUs."""
    script = _job_script({"cores": 8, "gpus": 2, "memory": "8GB", "walltime": "01:00:00"}, "cuda")
    assert "#SBATCH --gres=gpu:2" in script
    assert "#SBATCH --cpus-per-task=8" in script
    assert len(re.findall(r"--nthreads\b", script)) == 1 and "--nthreads 1" in script
    assert "--nworkers 2" in script
    assert "--preload vsekit.cluster_pin" in script and "--resources GPU=1" in script
    assert "--lifetime 3240s" in script and "--lifetime-stagger 90s" in script   # 6 min before walltime
    assert slurm({"cores": 8, "gpus": 2}).task_cpus() == 4   # each worker decodes with its 4 cores' threads


@pytest.mark.parametrize("device, settings", [("auto", {"cores": 2}), ("cpu", {"cores": 2, "gpus": 1})])
def test_cpu_job_asks_no_gres(device, settings):
    """Finding 6: --gres only when the tasks run on CUDA (auto without gpus, or cpu, asks none)."""
    script = _job_script(settings, device)
    assert "gres" not in script and "GPU=" not in script
    assert len(re.findall(r"--nthreads\b", script)) == 1 and "--nthreads 1" in script
    assert slurm(settings).task_device(device) == "cpu" and not slurm(settings).uses_gpu(device)


def test_devices_resolve_on_workers_for_slurm():
    """Finding 6: with slurm, ``cuda``/``auto`` go to the workers unresolved (a GPU-less login node
    must not refuse them); each pinned worker sees its one GPU as ``cuda``."""
    assert parse_cluster("slurm:8", {}).resolves_on_workers and not parse_cluster("local:2").resolves_on_workers
    assert slurm({}).task_device("cuda:1") == "cuda" and slurm({}).uses_gpu("cuda")
    assert slurm({"gpus": 1}).task_device("auto") == "auto" and slurm({"gpus": 1}).uses_gpu("auto")
    assert gpu_for("SLURMCluster-3-0", "4,5") == "4" and gpu_for("SLURMCluster-3-1", "4,5") == "5"
    assert gpu_for("SLURMCluster-3", "7") == "7" and gpu_for("w-1", None) is None


def test_worker_resolves_auto_on_a_cpu_only_node(demo_store):
    """A task given ``auto`` resolves it where it runs: on this GPU-less machine, the CPU."""
    pytest.importorskip("torch")
    from vsekit.extract import extract
    from vsekit.extract.distribute import extract_block
    from vsekit.extract.job import Execution, Job
    from vsekit.storage import FeatureStore

    opts = dict(model="test_resnet", kind="fne", weights="none", seed=3, input_size=64, resize=72,
                batch_size=2, block_rows=4, progress=False, workers=0, device="cpu")
    res = extract(demo_store, **opts)
    fs = demo_store.features(res.name)
    want = fs.data[0:4].copy()
    fs.status[0:4] = 0   # block 0 pending again
    from vsekit.extract.plan import make_plan

    plan = make_plan("test_resnet", "fne", weights="none", seed=3, input_size=64, resize=72)
    job = Job(str(demo_store.path), res.name, plan, Execution(device="auto", batch_size=2, workers=0))
    out = extract_block(job, (0, 0, 4))
    assert "skipped" not in out
    got = FeatureStore.open(demo_store.path).features(res.name)
    assert (got.status[0:4] == 1).all() and (got.data[0:4] == want).all()
    again = extract_block(job, (0, 0, 4))
    assert again.get("skipped") is True   # a committed block is not computed again


class _Slow:
    """A dataset whose items record the thread that decoded them."""

    def __init__(self, n):
        self.n, self.threads = n, set()

    def __getitem__(self, i):
        self.threads.add(threading.current_thread().name)
        return ("item", i)


def test_decoding_uses_threads_and_keeps_the_order():
    """Finding 7: a task decodes with several threads (its job's cores), items in batch order."""
    from vsekit.extract.reader import decoded_by_threads as decoded_batches

    batches = [[0, 1, 2], [3, 4], [5], [6, 7, 8, 9]]
    ds = _Slow(10)
    got = list(decoded_batches(ds, batches, 3))
    assert got == [[("item", i) for i in b] for b in batches]
    assert any(t.startswith("vsekit-decode") for t in ds.threads)
    serial = _Slow(10)
    assert list(decoded_batches(serial, batches, 0)) == got


def test_importing_dask_jobqueue_keeps_ctrl_c_and_works_off_the_main_thread():
    """Finding 4: dask-jobqueue 0.9.0's import replaced the SIGINT handler with one that exits 0,
    and failed off the main thread; vsekit's import does neither (fresh interpreter)."""
    import subprocess
    import sys

    pytest.importorskip("dask_jobqueue")
    code = ("import signal, threading\n"
            "from vsekit.clusters.jobqueue import import_jobqueue\n"
            "out = {}\n"
            "def go():\n"
            "    try:\n"
            "        out['cls'] = import_jobqueue().__name__\n"
            "    except BaseException as exc:\n"
            "        out['exc'] = repr(exc)\n"
            "t = threading.Thread(target=go); t.start(); t.join()\n"
            "print(out, signal.getsignal(signal.SIGINT) is signal.default_int_handler)\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stdout.split() == ["{'cls':", "'SLURMCluster'}", "True"], res.stdout


def _count_parses(monkeypatch) -> list[str]:
    """Every text ``parse_cluster`` is asked to parse (a ClusterSpec passed on is not a parse)."""
    import vsekit.clusters as cluster

    real, texts = cluster.parse_cluster, []

    def counting(spec, settings=None):
        if isinstance(spec, str) and spec:
            texts.append(spec)
        return real(spec, settings)

    monkeypatch.setattr(cluster, "parse_cluster", counting)
    return texts


def test_vsekit_run_parses_its_cluster_once_and_hands_every_stage_the_spec(tmp_path, monkeypatch):
    """Before: --cluster travelled as text and each stage parsed it again (SLURM settings through a
    context variable). Now `vsekit run` parses it once, with the pipeline's `cluster:` settings."""
    texts = _count_parses(monkeypatch)
    f = tmp_path / "p.yaml"
    f.write_text("pipelines:\n"
                 "  p:\n"
                 "    cluster: {queue: gpu}\n"
                 "    stages:\n"
                 f"      - {{stage: tokenize, store: {tmp_path}/s.zarr}}\n"
                 f"      - {{stage: tokenize, id: again, store: {tmp_path}/t.zarr, cluster: 'slurm:1'}}\n")
    res = CliRunner().invoke(main, ["run", "p", "--file", str(f), "--dry-run", "--cluster", "slurm:2"])
    assert res.exit_code == 0, res.output
    assert texts == ["slurm:2"]   # once, for the whole run; the stage's own is replaced
    assert res.output.count("--cluster slurm:2") == 2
    texts.clear()
    res = CliRunner().invoke(main, ["run", "p", "--file", str(f), "--dry-run"])
    assert res.exit_code == 0, res.output
    assert texts == ["slurm:1"]   # the one stage that names a cluster: parsed once, when it is resolved


def test_a_command_parses_its_cluster_once(demo_store, monkeypatch, tmp_path):
    """`vsekit extract --cluster slurm-array:1` (no sbatch here: refused after the spec was used)."""
    texts = _count_parses(monkeypatch)
    monkeypatch.setenv("PATH", str(tmp_path))   # no sbatch
    res = CliRunner().invoke(main, ["extract", "--store", str(demo_store.path), "--model", "test_resnet",
                                    "--weights", "none", "--input-size", "32", "--resize", "36",
                                    "--device", "cpu", "--cluster", "slurm-array:1"])
    assert res.exit_code == 1 and "`sbatch` is not on the PATH" in res.output, res.output
    assert texts == ["slurm-array:1"]
