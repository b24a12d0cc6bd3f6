"""Which group a process joins, read from the launcher's environment (no process is started)."""

from __future__ import annotations

import pytest

from vsekit.train.distributed import first_in_nodelist, launch_env


def test_no_launcher_is_one_process():
    assert launch_env({}) is None
    assert launch_env({"PATH": "/usr/bin", "OMP_NUM_THREADS": "2"}) is None


def test_torchrun_variables():
    env = launch_env({"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
                      "MASTER_ADDR": "n01", "MASTER_PORT": "29400"})
    assert (env.rank, env.world, env.local_rank, env.local_world, env.master_addr, env.master_port, env.launcher) \
        == (3, 8, 1, 2, "n01", 29400, "torchrun")


def test_srun_task_joins_and_a_batch_script_does_not():
    step = {"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1", "SLURM_STEP_ID": "0",
            "SLURM_STEP_NUM_TASKS": "8", "SLURM_STEP_TASKS_PER_NODE": "4(x2)", "SLURM_JOB_ID": "123456",
            "SLURM_STEP_NODELIST": "gpu[07-08]", "MASTER_ADDR": "10.0.0.7"}
    env = launch_env(step)
    assert (env.rank, env.world, env.local_rank, env.local_world, env.launcher) == (5, 8, 1, 4, "srun")
    assert env.master_addr == "10.0.0.7" and env.master_port == 20000 + 123456 % 20000
    # the batch script's own shell: SLURM_PROCID=0 and the allocation's task count, but no job step
    batch = {k: v for k, v in step.items() if k not in ("SLURM_STEP_ID", "SLURM_STEP_NUM_TASKS")}
    assert launch_env(batch) is None
    assert launch_env({**step, "SLURM_STEP_ID": "batch"}) is None
    assert launch_env({**step, "SLURM_STEP_NUM_TASKS": "1"}) is None     # one task: one process


@pytest.mark.parametrize("nodelist, first", [("node[01-04,07],gpu3", "node01"), ("gpu3,gpu4", "gpu3"),
                                             ("c[7,9]", "c7"), ("solo", "solo")])
def test_first_node_of_a_nodelist(nodelist, first):
    assert first_in_nodelist(nodelist) == first


def test_the_node_number_comes_from_the_launcher():
    """The node's number names its shared window buffers apart from another node's
    (``NodeShare``): torchrun's ``GROUP_RANK``, srun's ``SLURM_NODEID``, else the node's first rank."""
    run = {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4"}
    assert launch_env({**run, "GROUP_RANK": "1"}).node == 1
    assert launch_env(run).node == 4
    step = {"SLURM_PROCID": "6", "SLURM_LOCALID": "2", "SLURM_STEP_ID": "0", "SLURM_STEP_NUM_TASKS": "8",
            "SLURM_NODEID": "3", "MASTER_ADDR": "10.0.0.7"}
    assert launch_env(step).node == 3
