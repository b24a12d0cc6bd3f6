"""Data-parallel training on ``torch.distributed``: the process group, and the collectives of a step.

A run is data-parallel when a launcher started it (``torchrun``, ``vsekit train --nproc-per-node N``,
SLURM's ``srun``: :func:`launch_env` reads their variables); without one it is one process,
:data:`SINGLE`, whose collectives are the identity. What is exact and how (the gathers here,
``DistributedDataParallel`` in ``step.train_step``): docs/train.md, "Data-parallel training".
"""

from __future__ import annotations

import datetime
import os
import re
import socket
import subprocess
from dataclasses import dataclass
from typing import Any, Sequence

import warnings

import numpy as np
import torch

# torch 2.14 marks torch.distributed.nn.functional deprecated in favour of the functional collectives,
# whose autograd support is narrower; these are the documented differentiable collectives
warnings.filterwarnings("ignore", message=r"torch\.distributed\.nn\.functional", category=FutureWarning)

DEFAULT_TIMEOUT_S = 600.0     # collective timeout: a dead rank is reported within this


class RankFailure(RuntimeError):
    """Another rank of the group died or stopped answering (a collective failed or timed out)."""


@dataclass
class LaunchEnv:
    """Where this process sits in a launched group."""

    rank: int
    world: int
    local_rank: int
    local_world: int
    master_addr: str
    master_port: int
    launcher: str        # "torchrun" or "srun"
    node: int = 0        # the node's number (torchrun's GROUP_RANK, srun's SLURM_NODEID)


def _first_host(nodelist: str) -> str:
    """The first host name of a SLURM node list (``node[01-04,07],gpu3`` -> ``node01``): scontrol's
    reading when it is there, else :func:`first_in_nodelist`."""
    try:
        out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True,
                             timeout=30)
        if out.returncode == 0 and out.stdout.split():
            return out.stdout.split()[0]
    except (OSError, subprocess.SubprocessError):
        pass
    return first_in_nodelist(nodelist)


def first_in_nodelist(nodelist: str) -> str:
    """The first host of a SLURM node list, read without scontrol."""
    first = re.match(r"([^,\[]+)(\[([^\]]+)\])?", nodelist.strip())
    if not first:
        return nodelist
    prefix, ranges = first.group(1), first.group(3)
    if not ranges:
        return prefix
    return prefix + ranges.split(",")[0].split("-")[0]


def _node_address(name: str) -> str:
    """An address for the SLURM node ``name``: the name when it resolves, else the node's ``NodeAddr``."""
    try:
        socket.gethostbyname(name)
        return name
    except OSError:
        pass
    try:
        out = subprocess.run(["scontrol", "show", "node", name, "-o"], capture_output=True, text=True, timeout=30)
        found = re.search(r"NodeAddr=(\S+)", out.stdout)
        if found:
            return found.group(1)
    except (OSError, subprocess.SubprocessError):
        pass
    return name


def launch_env(environ: dict[str, str] | None = None) -> LaunchEnv | None:
    """The group this process was launched into, or None (one process: no launcher variables).

    ``srun`` is recognised by ``SLURM_STEP_ID`` besides ``SLURM_PROCID`` (a batch script's own
    shell has ``SLURM_PROCID=0`` and the allocation's task count, but is no member of a group).
    A single task (``WORLD_SIZE=1`` under torchrun) is still a group of one: it runs the distributed
    path (``--nproc-per-node 1`` on a GPU checks NCCL).
    """
    env = os.environ if environ is None else environ
    if "RANK" in env and "WORLD_SIZE" in env:
        world = int(env["WORLD_SIZE"])
        return LaunchEnv(int(env["RANK"]), world, int(env.get("LOCAL_RANK", 0)),
                         int(env.get("LOCAL_WORLD_SIZE", world)), env.get("MASTER_ADDR", "127.0.0.1"),
                         int(env.get("MASTER_PORT", 29500)), "torchrun",
                         int(env.get("GROUP_RANK", int(env["RANK"]) - int(env.get("LOCAL_RANK", 0)))))
    step = env.get("SLURM_STEP_ID", env.get("SLURM_STEPID"))
    if "SLURM_PROCID" in env and step is not None and step not in ("batch", "extern"):
        world = int(env.get("SLURM_STEP_NUM_TASKS", env.get("SLURM_NTASKS", 1)))
        if world < 2:
            return None
        nodes = env.get("SLURM_STEP_NODELIST", env.get("SLURM_JOB_NODELIST", "127.0.0.1"))
        local_world = int(str(env.get("SLURM_STEP_TASKS_PER_NODE", env.get("SLURM_NTASKS_PER_NODE", world)))
                          .split("(")[0].split(",")[0] or world)
        port = int(env.get("MASTER_PORT") or 20000 + int(env.get("SLURM_JOB_ID", 0)) % 20000)
        return LaunchEnv(int(env["SLURM_PROCID"]), world, int(env.get("SLURM_LOCALID", 0)), local_world,
                         env.get("MASTER_ADDR") or _node_address(_first_host(nodes)), port, "srun",
                         int(env.get("SLURM_NODEID", int(env["SLURM_PROCID"]) - int(env.get("SLURM_LOCALID", 0)))))
    return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pad_to(t: torch.Tensor, shape: Sequence[int]) -> torch.Tensor:
    """``t`` zero-padded at the end of every dim to ``shape`` (``t`` itself when it has that shape)."""
    pad = [x for have, want in zip(reversed(t.shape), reversed(shape)) for x in (0, int(want) - int(have))]
    return torch.nn.functional.pad(t, pad) if any(pad) else t


def part_slice(n: int, rank: int, world: int) -> slice:
    """Rank ``rank``'s contiguous rows of a global batch of ``n``: the first ``n % world`` ranks one
    more; a batch smaller than the rank count is every rank's whole (each computes all of it)."""
    if n < world:
        return slice(0, n)
    base, extra = divmod(n, world)
    start = rank * base + min(rank, extra)
    return slice(start, start + base + (1 if rank < extra else 0))


class Group:
    """The ranks of a run and the collectives of a training step; world 1 is the identity (no torch.distributed)."""

    def __init__(self, rank: int = 0, world: int = 1, local_rank: int = 0, local_world: int = 1,
                 timeout_s: float = DEFAULT_TIMEOUT_S, backend: str | None = None, node: int | None = None):
        self.rank, self.world = rank, world
        self.local_rank, self.local_world = local_rank, local_world
        # the node's number, the same for its ranks and distinct between nodes (default: its first rank)
        self.node = rank - local_rank if node is None else node
        self.timeout_s = timeout_s
        self.backend = backend
        # bytes this rank put into collectives: all-gather parts (forward), their gradients (backward),
        # all-reduced tensors (batch-norm sums forward and backward, DDP's gradients)
        self.traffic = {"gather": 0, "gather_grad": 0, "reduce": 0}

    @property
    def distributed(self) -> bool:
        return self.backend is not None

    @property
    def main(self) -> bool:
        return self.rank == 0

    # -- the data of a step --------------------------------------------------------------------
    def sizes(self, n: int) -> list[int]:
        """The rows of each rank in a global batch of ``n`` (:func:`part_slice`'s, ``n >= world``)."""
        return [len(range(n)[part_slice(n, r, self.world)]) for r in range(self.world)]

    def part(self, n: int) -> slice:
        """This rank's contiguous slice of a global batch of ``n`` rows."""
        return part_slice(n, self.rank, self.world)

    # -- collectives (identity in one process) -------------------------------------------------
    def check(self, what: str, fn, *args, **kwargs):
        """``fn(*args, **kwargs)``, a collective; a peer's failure becomes one :class:`RankFailure`."""
        try:
            return fn(*args, **kwargs)
        except RankFailure:
            raise
        except (RuntimeError, ValueError) as exc:   # gloo / NCCL errors of a dead or hung peer
            if "no backend type associated" in str(exc).lower():   # a bug, not a peer's failure
                raise
            raise RankFailure(self.failure_message(what, exc)) from None

    def failure_message(self, what: str, exc: BaseException) -> str:
        text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        text = text.split(". This is typically")[0][:300]   # gloo's advice (and its emoji) left out
        # the ranks whose heartbeat in the group's store is missing or older than the heartbeat limit
        beat = getattr(self, "_heartbeat", None)
        dead = [] if beat is None else beat.stale()
        who = (f"rank {', '.join(map(str, dead))} died or stopped answering" if dead
               else "another rank died or stopped answering")
        return f"rank {self.rank}: {who} during {what} (collective timeout {self.timeout_s:g} s): {text}"

    def gather(self, value: Any, sizes: Sequence[int], *, autograd: bool = True) -> Any:
        """Every rank's rows of ``value`` (a tensor or a tuple/list of them, rows on dim 0 and
        ``sizes[r]`` rows on rank r), concatenated in rank order; floating tensors keep their
        gradient (``torch.distributed.nn``: the backward sums every rank's gradient of a part into
        the rank that holds it). Other dims are padded to the largest over the ranks."""
        if not self.distributed or value is None:
            return value
        if isinstance(value, (tuple, list)):
            return type(value)(self.gather(v, sizes, autograd=autograd) for v in value)
        return self.check("a gather of the batch's encodings", self._gather_one, value, list(sizes), autograd)

    def gather_dim(self, value: torch.Tensor, sizes: Sequence[int], dim: int) -> torch.Tensor:
        """As :meth:`gather` along ``dim`` (the score matrix's column blocks)."""
        if not self.distributed:
            return value
        moved = value.movedim(dim, 0)
        return self.check("a gather of the score blocks", self._gather_one, moved, list(sizes), True).movedim(0, dim)

    def _gather_one(self, t: torch.Tensor, sizes: list[int], autograd: bool) -> torch.Tensor:
        import torch.distributed as dist

        # the other dims may differ between ranks (a caption slice's width): agree on the largest
        shape = torch.tensor(list(t.shape[1:]) or [0], dtype=torch.int64, device=t.device)
        if t.dim() > 1:
            shapes = [torch.empty_like(shape) for _ in range(self.world)]
            dist.all_gather(shapes, shape)
            full = torch.stack(shapes).max(0).values.tolist()
        else:
            full = []
        dtype = t.dtype
        if dtype == torch.bool:
            t = t.to(torch.uint8)
        padded = pad_to(t, [max(sizes), *full])
        nbytes = padded.numel() * padded.element_size()
        self.traffic["gather"] += nbytes
        if autograd and padded.requires_grad:
            self.traffic["gather_grad"] += nbytes
            from torch.distributed.nn.functional import all_gather

            parts = all_gather(padded)
        else:
            parts = [torch.empty_like(padded) for _ in range(self.world)]
            dist.all_gather(parts, padded.contiguous())
        out = torch.cat([p[:n] for p, n in zip(parts, sizes)])
        return out.to(dtype) if dtype == torch.bool else out

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """The sum over the ranks, differentiable (for batch statistics)."""
        if not self.distributed:
            return tensor
        from torch.distributed.nn.functional import all_reduce

        self.traffic["reduce"] += 2 * tensor.numel() * tensor.element_size()   # forward and backward
        return self.check("a reduction of batch statistics", all_reduce, tensor)

    def reduce_array(self, array: np.ndarray, op: str, what: str = "a reduction of the validation's ranks"
                     ) -> np.ndarray:
        """The elementwise ``"sum"`` or ``"max"`` of a host array over the ranks (validation's counts)."""
        if not self.distributed:
            return array
        import torch.distributed as dist

        device = torch.device("cuda", torch.cuda.current_device()) if self.backend == "nccl" else "cpu"
        t = torch.from_numpy(np.ascontiguousarray(array)).to(device)
        self.check(what, dist.all_reduce, t, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM)
        return t.cpu().numpy()

    def gather_rows(self, tensor: torch.Tensor) -> torch.Tensor:
        """Every rank's rows (dim 0, any count), concatenated in rank order; no gradient."""
        if not self.distributed:
            return tensor

        def run():
            import torch.distributed as dist

            n = torch.tensor([tensor.shape[0]], dtype=torch.int64, device=tensor.device)
            counts = [torch.empty_like(n) for _ in range(self.world)]
            dist.all_gather(counts, n)
            sizes = [int(c) for c in counts]
            return self._gather_one(tensor.detach(), sizes, False)

        return self.check("a gather of batch statistics", run)

    def sum_async(self, values: Sequence[float]):
        """Start summing ``values`` over the ranks (a host tensor through gloo, beside the step's
        backward); returns the function that waits for the sums."""
        if not self.distributed:
            return lambda: [float(v) for v in values]
        import torch.distributed as dist

        t = torch.tensor([float(v) for v in values] or [0.0], dtype=torch.float64)
        work = self.check("a stop agreement", dist.all_reduce, t, async_op=True)

        def wait() -> list[float]:
            self.check("a stop agreement", work.wait)
            return t.tolist()[:len(values)]
        return wait

    def any(self, flag: bool) -> bool:
        """True on every rank when it is True on any (outside a step: after validation)."""
        return bool(self.reduce_array(np.array([1.0 if flag else 0.0]), "max", "a stop agreement")[0] > 0)

    def barrier(self, what: str = "a barrier") -> None:
        if not self.distributed:
            return
        import torch.distributed as dist

        self.check(what, dist.barrier)

    def broadcast_object(self, obj: Any) -> Any:
        """Rank 0's ``obj`` on every rank."""
        if not self.distributed:
            return obj
        import torch.distributed as dist

        box = [obj]
        self.check("a broadcast", dist.broadcast_object_list, box, 0)
        return box[0]

    def close(self) -> None:
        beat = getattr(self, "_heartbeat", None)
        if beat is not None:
            beat.stop()
        if self.distributed:
            import torch.distributed as dist

            if dist.is_initialized():
                try:
                    dist.destroy_process_group()
                except Exception:   # a group whose peers died cannot always be torn down cleanly
                    pass


SINGLE = Group()


class NodeShare:
    """The ranks of one node sharing the training window (:meth:`PairStream.epoch_shared`).

    Local rank 0 (the leader) creates the window buffers as files in ``directory``, named by the run
    (a token of rank 0's) and the node (two nodes' leaders writing into one shared folder never
    truncate each other's buffers) (``/dev/shm``:
    memory, not disk), every local rank maps them, and the leader removes the names once all have
    mapped them (the memory lives until the last rank unmaps it, so a killed run leaves nothing in the
    folder). Every call is made by every rank at the same point of the stream (a collective)."""

    MARGIN = 64 << 20   # room left in the folder beyond the two buffers

    def __init__(self, group: Group, directory: str | os.PathLike = "/dev/shm"):
        from pathlib import Path

        self.group, self.directory = group, Path(directory)
        self.leader = group.local_rank == 0
        self.fallback: str | None = None   # why the last epoch fell back to per-rank reads

    def sync(self, what: str) -> None:
        self.group.barrier(f"the shared training {what}")

    def _room(self, nbytes: int) -> str | None:
        if not self.directory.is_dir() or not os.access(self.directory, os.W_OK):
            return f"{self.directory} is not a writable folder"
        st = os.statvfs(self.directory)
        free = st.f_bavail * st.f_frsize
        if free < nbytes + self.MARGIN:
            return (f"{self.directory} has {free / 2**30:.2f} GiB free, the two window buffers need "
                    f"{nbytes / 2**30:.2f} GiB")
        return None

    def open_buffers(self, nbytes: int, specs: Sequence[tuple[tuple[int, ...], Any]]) -> list[np.ndarray] | None:
        """Arrays of ``specs`` ((shape, dtype) each) shared by the node's ranks, or None on every rank
        when any node lacks room (then each rank reads its own rows)."""
        import uuid

        token = self.group.broadcast_object(uuid.uuid4().hex if self.group.main else None)
        why = self._room(nbytes)
        if self.group.any(why is not None):
            self.fallback = why or "another node's shared-memory folder lacks room"
            return None
        self.fallback = None
        node = getattr(self.group, "node", self.group.rank - self.group.local_rank)
        paths = [self.directory / f"vsekit-window-{token}-node{node}-{i}" for i in range(len(specs))]
        arrays = None
        try:
            if self.leader:
                arrays = [np.memmap(p, dtype=dt, mode="w+", shape=tuple(shape)) for p, (shape, dt) in zip(paths, specs)]
            self.sync("buffers' creation")
            if not self.leader:
                arrays = [np.memmap(p, dtype=dt, mode="r", shape=tuple(shape)) for p, (shape, dt) in zip(paths, specs)]
            self.sync("buffers' mapping")
        finally:
            if self.leader:
                for p in paths:
                    p.unlink(missing_ok=True)
        return arrays


class Heartbeat:
    """Each rank stamps the group's store every ``every`` s; a rank whose stamp is missing or old is dead.

    Read only when a collective fails, to name the rank that died (a collective's own error names
    none, or names a peer address).
    """

    def __init__(self, store, rank: int, world: int, every: float = 1.0):
        import threading

        self.store, self.rank, self.world, self.every = store, rank, world, every
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="vsekit-heartbeat", daemon=True)
        self._thread.start()

    def _run(self):
        import time

        while not self._stop.is_set():
            try:
                self.store.set(f"vsekit/beat/{self.rank}", repr(time.time()))
            except Exception:   # the store's host (rank 0) is gone
                return
            self._stop.wait(self.every)

    def stale(self, wait: float | None = None) -> list[int]:
        """The ranks whose stamp does not advance over ``wait`` seconds (default two beats)."""
        import time

        def read():
            stamps = {}
            for r in range(self.world):
                if r != self.rank:
                    try:
                        stamps[r] = self.store.get(f"vsekit/beat/{r}")
                    except Exception:
                        stamps[r] = None
            return stamps

        first = read()
        if first.get(0, "") is None and self.rank != 0:
            return [0]      # the store lives with rank 0: unreachable means rank 0 is gone
        time.sleep(wait if wait is not None else 2.5 * self.every)
        second = read()
        return [r for r in first if first[r] is None or second[r] is None or first[r] == second[r]]

    def stop(self):
        self._stop.set()


def setup(device: str = "cpu", timeout_s: float = DEFAULT_TIMEOUT_S, environ: dict[str, str] | None = None) -> Group:
    """Join the launched group (NCCL on CUDA, gloo on the CPU), or :data:`SINGLE` when not launched."""
    env = launch_env(environ)
    if env is None:
        return SINGLE
    import torch.distributed as dist

    os.environ.setdefault("MASTER_ADDR", env.master_addr)
    os.environ.setdefault("MASTER_PORT", str(env.master_port))
    cuda = str(device).startswith("cuda")
    backend = "nccl" if cuda else "gloo"
    # on CUDA the step's small host tensors (shapes, counts, stop flags) go through gloo, the
    # encodings and gradients through NCCL: an NCCL-only group refuses a CPU tensor ("No backend
    # type associated with device type cpu", the first H100 run of gpu-check's ddp check)
    init_backend = "cpu:gloo,cuda:nccl" if cuda else "gloo"
    if cuda:
        torch.cuda.set_device(env.local_rank % max(1, torch.cuda.device_count()))
    if not dist.is_initialized():
        timeout = datetime.timedelta(seconds=timeout_s)
        restart = os.environ.get("TORCHELASTIC_RESTART_COUNT")
        if env.launcher == "torchrun" and restart is not None:
            # torch's elastic agent serves one store for every restart of the group, and the ranks'
            # gloo / NCCL addresses of an earlier attempt stay in it: a restarted rank could read a dead
            # peer's address. Each attempt gets keys of its own.
            agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
            store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), env.world,
                                  is_master=not agent and env.rank == 0, timeout=timeout,
                                  **({} if agent else {"multi_tenant": True}))
            dist.init_process_group(init_backend, store=dist.PrefixStore(f"vsekit/attempt{restart}", store),
                                    rank=env.rank, world_size=env.world, timeout=timeout)
        else:
            dist.init_process_group(init_backend, init_method="env://", rank=env.rank, world_size=env.world,
                                    timeout=timeout)
    group = Group(env.rank, env.world, env.local_rank, env.local_world, timeout_s, backend, env.node)
    try:
        from torch.distributed.distributed_c10d import _get_default_store

        group._heartbeat = Heartbeat(_get_default_store(), env.rank, env.world)
    except Exception:   # no store to stamp: failures are reported without the rank's name
        group._heartbeat = None
    return group


def device_of(group: Group, device: str) -> str:
    """The device of this rank: ``cuda`` becomes ``cuda:<local rank>`` (one GPU per rank)."""
    if group.distributed and str(device).startswith("cuda"):
        return f"cuda:{torch.cuda.current_device()}"
    return device
