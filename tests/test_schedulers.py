"""The batch schedulers as entries of one table (``vsekit.schedulers.SCHEDULERS``, one module each), without a scheduler:
``--cluster sge:N`` / ``pbs:N`` / ``lsf:N`` / ``htcondor:N`` parse like ``slurm:N``, each
scheduler's walltime syntax is read as it means it, and the job scripts dask-jobqueue would submit
carry each request in that scheduler's words (Grid Engine: ``-l h_rt``, ``-pe``, ``-l gpu=G``,
``-V``). On a real Grid Engine: tests/test_sge.py."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from vsekit.schedulers import SCHEDULERS
from vsekit.clusters import ClusterSpec, parse_cluster
from vsekit.clusters.jobqueue import jobqueue_kwargs, lifetime_args


def test_every_scheduler_parses_as_jobs_resolved_on_the_workers():
    for kind in ("slurm", "sge", "pbs", "lsf", "htcondor"):
        spec = parse_cluster(f"{kind}:3", {"queue": "q"})
        assert (spec.kind, spec.n, spec.is_jobqueue, spec.resolves_on_workers) == (kind, 3, True, True)
        with pytest.raises(ValueError, match=rf"{kind}:N with N >= 1 {SCHEDULERS[kind].label} jobs"):
            parse_cluster(f"{kind}:0", {})
    assert not parse_cluster("local:2").is_jobqueue and not parse_cluster("slurm-array:2", {}).is_jobqueue
    assert [k for k, s in SCHEDULERS.items() if s.tested] == ["slurm", "sge"]
    out = CliRunner().invoke(__import__("vsekit.cli", fromlist=["main"]).main, ["extract", "--help"],
                             terminal_width=200)
    assert "sge:N" in " ".join(out.output.split()) and "tested on stand-ins only" in " ".join(out.output.split())


@pytest.mark.parametrize("kind, walltime, seconds", [
    ("slurm", "30", 1800), ("slurm", "1-00:00:00", 86400), ("slurm", "01:00:00", 3600),
    ("sge", "600", 600), ("sge", "01:00:00", 3600), ("sge", "00:01:00", 60),
    ("pbs", "02:00:00", 7200), ("lsf", "30", 1800), ("lsf", "01:30", 5400),
])
def test_walltime_is_read_in_each_schedulers_syntax(kind, walltime, seconds):
    """A bare number is minutes to sbatch and bsub, seconds to Grid Engine's h_rt; the lifetime
    recipe (a tenth of the walltime, 20 s to 10 min, before it) follows from the seconds."""
    margin = min(600, max(20, seconds // 10))
    assert lifetime_args(walltime, kind=kind)[:2] == ["--lifetime", f"{seconds - margin}s"]


def test_a_walltime_without_a_time_gives_no_lifetime_and_htcondor_takes_none():
    assert lifetime_args("INFINITY", kind="sge") == [] and lifetime_args("1-00:00:00", kind="sge") == []
    with pytest.raises(ValueError, match="take no walltime"):
        jobqueue_kwargs("htcondor", {"walltime": "01:00:00"}, "cpu", None)


def test_an_lsf_walltime_is_one_bsub_takes():
    """bsub -W takes [HH:]MM only (the stand-in checks it as bsub does: tests/lsf_local.py); vsekit
    refuses any other walltime for LSF in one line, before a job is submitted and never starts."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import lsf_local

    pattern = lsf_local.CHECKS["-W"][0]
    for walltime in ("30", "01:30", "00:20"):
        assert re.fullmatch(pattern, walltime)
        assert jobqueue_kwargs("lsf", {"walltime": walltime}, "cpu", None)["walltime"] == walltime
    for walltime in ("00:20:00", "1-00:00", "1:2:3"):
        assert not re.fullmatch(pattern, walltime)
        with pytest.raises(ValueError, match=re.escape(f"cluster setting walltime '{walltime}': LSF takes [HH:]MM")):
            jobqueue_kwargs("lsf", {"walltime": walltime}, "cpu", None)


def _sge_script(settings, device):
    from vsekit.clusters.jobqueue import import_jobqueue

    with import_jobqueue("SGECluster")(**jobqueue_kwargs("sge", settings, device, None)) as cluster:
        return cluster.job_script()


def test_grid_engine_job_carries_walltime_cores_memory_and_gpus_in_its_words():
    pytest.importorskip("dask_jobqueue")
    script = _sge_script({"queue": "gpu.q", "walltime": "01:00:00", "cores": 12, "pe": "smp", "gpus": 2,
                          "memory": "32GB", "memory_resource": "h_vmem", "gpu_resource": "gpu",
                          "project": "vision"}, "cuda")
    assert "#$ -q gpu.q" in script and "#$ -P vision" in script and "#$ -l h_rt=01:00:00" in script
    assert "#$ -pe smp 12" in script and "#$ -V" in script
    assert re.search(r"#\$ -l h_vmem=\d+M,gpu=2\n", script)
    assert "--nworkers 2" in script and "--preload vsekit.cluster_pin" in script and "--resources GPU=1" in script
    assert "--lifetime 3240s" in script and "--lifetime-stagger 90s" in script
    assert ClusterSpec("sge", 1, settings={"cores": 12, "gpus": 2}).task_cpus("cuda") == 6
    cpu = _sge_script({"queue": "all.q"}, "cpu")   # one core, no pe, no memory resource, no GPU asked
    assert "-pe" not in cpu and "GPU=" not in cpu and "#$ -V" in cpu
    assert [ln for ln in cpu.splitlines() if ln.startswith("#$ -l")] == ["#$ -l h_rt=00:30:00"]
    # dask-jobqueue's default walltime: the workers retire before it too (1800 s - 180 s)
    assert "--lifetime 1620s" in cpu


def test_grid_engine_settings_are_checked_before_anything_starts():
    with pytest.raises(ValueError, match="cores: 4 on Grid Engine need pe"):
        jobqueue_kwargs("sge", {"cores": 4}, "cpu", None)
    with pytest.raises(ValueError, match="'pe' is for Grid Engine only, not SLURM"):
        jobqueue_kwargs("slurm", {"pe": "smp"}, "cpu", None)
    with pytest.raises(ValueError, match="'account' is for SLURM and PBS only, not Grid Engine"):
        jobqueue_kwargs("sge", {"account": "a"}, "cpu", None)


def test_untested_schedulers_get_their_own_requests():
    pytest.importorskip("dask_jobqueue")
    from vsekit.clusters.jobqueue import import_jobqueue

    scripts = {}
    for kind, settings in (("pbs", {"walltime": "02:00:00", "gpus": 1}), ("lsf", {"walltime": "01:30", "gpus": 1}),
                           ("htcondor", {"gpus": 1})):
        with import_jobqueue(SCHEDULERS[kind].cluster)(**jobqueue_kwargs(kind, settings, "cuda", None)) as c:
            scripts[kind] = c.job_script()
    assert "#PBS -l walltime=02:00:00" in scripts["pbs"] and "#PBS -l ngpus=1" in scripts["pbs"]
    assert "#BSUB -W 01:30" in scripts["lsf"] and '#BSUB -gpu "num=1"' in scripts["lsf"]
    assert "request_gpus = 1" in scripts["htcondor"]


def test_sge_array_script_is_one_qsub_t_array_of_the_settings(tmp_path):
    """sge-array:N parses as a job array; its script is ``-t 1-N`` with the queue, h_rt, memory and
    GPU resources, and the parallel environment, written as sge:N writes them."""
    from vsekit.extract.array import job_script

    spec = parse_cluster("sge-array:3", {"queue": "all.q"})
    assert spec.is_array and spec.resolves_on_workers and not spec.is_jobqueue
    script = job_script(tmp_path / "spec.json", "vgg19_fne", 3, {
        "queue": "gpu.q", "walltime": "02:00:00", "gpus": 1, "cores": 6, "pe": "smp", "memory": "16GB",
        "memory_resource": "h_vmem"}, "cuda", tmp_path / "logs", "sge")
    lines = script.splitlines()
    for line in ("#$ -t 1-3", "#$ -q gpu.q", "#$ -l h_rt=02:00:00", "#$ -pe smp 6", "#$ -V",
                 f"#$ -o {tmp_path / 'logs'}/", "#$ -l h_vmem=15259M,gpu=1"):
        assert line in lines, (line, script)
    assert lines[-1].endswith(f"-m vsekit.extract.array {tmp_path / 'spec.json'}")
    with pytest.raises(ValueError, match="need pe"):
        job_script(tmp_path / "s.json", "x", 2, {"cores": 2}, "cpu", tmp_path, "sge")
    with pytest.raises(ValueError, match="use sge:N here"):
        from vsekit.clusters import cluster_client

        pytest.importorskip("distributed")
        with cluster_client(spec):
            pass


def test_a_scheduler_is_found_by_name_and_an_unknown_name_lists_the_valid_ones():
    from vsekit import schedulers

    assert list(schedulers.SCHEDULERS) == ["slurm", "sge", "pbs", "lsf", "htcondor"]
    assert [schedulers.get(n).name for n in schedulers.SCHEDULERS] == list(schedulers.SCHEDULERS)
    with pytest.raises(ValueError, match="unknown batch scheduler 'torque'; valid: slurm, sge, pbs, lsf, htcondor"):
        schedulers.get("torque")
    assert schedulers.get(None) is schedulers.get("slurm")   # a lock written before locks named theirs
    # the task numbers each scheduler gives its array tasks, and the job a process runs in
    assert schedulers.this_task({"JOB_ID": "48", "SGE_TASK_ID": "2"}) == ("48", "2")
    assert schedulers.this_task({"SLURM_ARRAY_JOB_ID": "48", "SLURM_ARRAY_TASK_ID": "0"}) == ("48", "0")
    assert schedulers.this_task({"JOB_ID": "48", "SGE_TASK_ID": "undefined"}) == ("48", None)
    assert schedulers.this_task({}) == (None, None)
