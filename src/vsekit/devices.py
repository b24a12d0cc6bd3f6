"""Which device a command runs on: ``--device auto|cpu|cuda|cuda:N``, resolved once, up front.

``auto`` (every command's default) is CUDA when torch sees a GPU, else CPU. A device that cannot be
used here (``gpu``, ``cuda`` on a machine without CUDA, ``cuda:5`` with two GPUs) is refused with a
one-line :class:`DeviceError` (a ``ValueError``: the CLI prints it as ``Error: ...``, exit 1) that
names the option and what is available, before any work starts. What was resolved is what the
commands record (store attrs, run config), so a run says where it really ran.

Also here: how ``--cluster local:N --device cuda`` spreads its workers over the GPUs
(:func:`gpu_assignment`), tested without a GPU.
"""

from __future__ import annotations

CHOICES = ("auto", "cpu", "cuda", "cuda:N")


class DeviceError(ValueError):
    """A ``--device`` value that cannot be used on this machine."""


def cuda_count() -> int:
    """How many CUDA devices torch can use here (0 without CUDA, or without a CUDA build)."""
    import torch

    try:
        return int(torch.cuda.device_count()) if torch.cuda.is_available() else 0
    except (RuntimeError, AssertionError):  # a broken driver: treat as no GPU
        return 0


def available() -> list[str]:
    """The devices a user can name here: ``cpu`` and ``cuda:0`` ... ``cuda:N-1``."""
    return ["cpu"] + [f"cuda:{i}" for i in range(cuda_count())]


def driver_version() -> str | None:
    """The NVIDIA driver's version on this machine (``/proc/driver/nvidia/version``), or None."""
    import re

    try:
        text = open("/proc/driver/nvidia/version").read()
    except OSError:
        return None
    m = re.search(r"Kernel Module\s+(?:for \S+\s+)?([0-9][0-9.]+)", text) or re.search(r"\b(\d{3,}\.\d+(?:\.\d+)?)\b", text)
    return m.group(1) if m else "unknown version"


def cuda_diagnosis() -> str:
    """Why CUDA is unusable here: the torch build's CUDA version (what the driver must support) and
    the NVIDIA driver found, e.g. ``torch 2.4.0+cu121 needs CUDA 12.1; NVIDIA driver: 470.82``."""
    import torch

    build = torch.version.cuda
    need = f"torch {torch.__version__} needs CUDA {build}" if build else f"torch {torch.__version__} is a CPU-only build"
    driver = driver_version()
    return f"{need}; NVIDIA driver: {driver or 'none found'}"


def _where() -> str:
    n = cuda_count()
    if n == 0:
        return f"this machine has no CUDA device (available: cpu; {cuda_diagnosis()})"
    return f"this machine has {n} CUDA device(s) (available: {', '.join(available())})"


def resolve_device(spec: str | None, option: str = "--device") -> str:
    """``auto``/None → ``cuda`` or ``cpu``; ``cpu``, ``cuda``, ``cuda:N`` checked against this machine.

    Raises :class:`DeviceError` naming ``option`` and the available devices.
    """
    raw = "auto" if spec is None else str(spec)
    s = raw.strip().lower()
    if s == "auto":
        if cuda_count() > 0:
            return "cuda"
        if driver_version() is not None:   # a GPU driver, yet no usable CUDA: say so, once per process
            _note_once(f"{option} auto: an NVIDIA driver is installed but CUDA is not usable, so this runs on "
                       f"CPU ({cuda_diagnosis()})")
        return "cpu"
    if s == "cpu":
        return "cpu"
    if s == "cuda" or s.startswith("cuda:"):
        n = cuda_count()
        if n == 0:
            raise DeviceError(f"{option} {raw}: {_where()}; use --device cpu or auto")
        if s == "cuda":
            return "cuda"
        index = s.split(":", 1)[1]
        if not index.isdigit():
            raise DeviceError(f"{option} {raw!r}: expected cuda:N with N a GPU number; {_where()}")
        if int(index) >= n:
            raise DeviceError(f"{option} {raw}: there is no GPU {int(index)}; {_where()}")
        return f"cuda:{int(index)}"
    raise DeviceError(f"{option} {raw!r} is not a device; valid choices: {', '.join(CHOICES)} ({_where()})")


_NOTED: set[str] = set()


def _note_once(line: str) -> None:
    import sys

    if line not in _NOTED:
        _NOTED.add(line)
        print(f"vsekit: note: {line}", file=sys.stderr, flush=True)


def is_cuda(device: str) -> bool:
    return str(device).startswith("cuda")


def gpu_assignment(n_workers: int, device: str, n_gpus: int) -> list[str | None]:
    """The ``CUDA_VISIBLE_DEVICES`` value of each of ``n_workers`` local workers (None: leave unset).

    ``cuda`` spreads the workers round-robin over the ``n_gpus`` GPUs (worker k gets GPU k mod n);
    ``cuda:I`` puts every worker on GPU I; ``cpu`` pins nothing. Each worker then sees exactly one
    GPU, as its ``cuda:0``, so the model, its memory and the ``GPU`` resource are its own.
    """
    if n_workers < 1:
        raise ValueError(f"n_workers must be >= 1, got {n_workers}")
    if not is_cuda(device):
        return [None] * n_workers
    if n_gpus < 1:
        raise DeviceError(f"--device {device}: {_where()}")
    if ":" in device:
        index = int(device.split(":", 1)[1])
        if index >= n_gpus:
            raise DeviceError(f"--device {device}: there is no GPU {index}; {_where()}")
        return [str(index)] * n_workers
    return [str(k % n_gpus) for k in range(n_workers)]


def worker_device(device: str) -> str:
    """The device name inside a worker pinned by :func:`gpu_assignment` (its only GPU is cuda:0)."""
    return "cuda" if is_cuda(device) else device


# What every vsekit process that computes features or trains records about its float32 math.
FLOAT32_RECORD = {"tf32": False, "float32_matmul_precision": "highest"}


def exact_float32() -> dict:
    """Make float32 math IEEE float32 on CUDA in this process (TF32 off for cuDNN and matmuls, which
    Ampere and later GPUs would otherwise use for float32), and return what to record. Per process:
    every extraction worker and training run calls it before its first CUDA operation; no effect on
    the CPU (docs/gpus_clusters.md, "fp32 is float32: TF32 off")."""
    import torch

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")
    return dict(FLOAT32_RECORD)
