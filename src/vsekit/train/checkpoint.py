"""Run folders and their checkpoints: what vsekit writes into a run folder, how a checkpoint is saved
and loaded, how a run's model is rebuilt, and how ``--overwrite`` empties the folder of an old run.

Checkpoints hold plain data only and load with ``torch.load(weights_only=True)``, which never runs
code from the file; ``--overwrite`` removes every file vsekit wrote into the folder (``RUN_PATTERNS``),
and only once the new run has started (docs/train.md, "Reruns").
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..storage.base import not_a_run
from ..storage.store import StoreError

if TYPE_CHECKING:
    from ..models.base import RetrievalModel

BEST, LAST = "checkpoint_best.pt", "checkpoint_last.pt"

# every file name pattern vsekit writes into a run folder
RUN_PATTERNS = ("config.json", "checkpoint_*.pt", "checkpoint_*.tmp", "metrics.jsonl", "metrics.jsonl.tmp",
                "metrics.json", "metrics_ensemble.json", "sims_*.npy", "curves.png",
                ".vsekit-pipeline.json", ".vsekit-pipeline.json.tmp*")


def run_files(out: Path) -> list[Path]:
    """The files of a vsekit run in ``out`` (empty when it holds none)."""
    if not out.is_dir():
        return []
    found = {p for pattern in RUN_PATTERNS for p in out.glob(pattern) if p.is_file()}
    return sorted(found)


def holds_trained_run(out: Path) -> bool:
    """Whether ``out`` holds a run with at least one trained epoch (which only --overwrite may replace).

    ``checkpoint_last.pt`` is written after ``checkpoint_best.pt`` in each epoch, so a kill between
    the two in the first epoch leaves a best checkpoint and a log without a trained epoch: that run
    is started again (deterministically the same), not refused.
    """
    if (out / LAST).is_file():
        return True
    if not (out / BEST).is_file():
        return False
    try:
        epochs = [json.loads(x).get("epoch", 0) for x in (out / "metrics.jsonl").read_text().splitlines() if x]
    except (OSError, ValueError):
        return True   # a best checkpoint without a readable log: keep it unless told to overwrite
    return any(e >= 1 for e in epochs)


def clear_run(out: Path) -> list[Path]:
    """Remove every file of an old run from ``out``; returns what was removed."""
    removed = run_files(out)
    for p in removed:
        p.unlink(missing_ok=True)
    return removed


def run_checkpoint(run: str | Path, which: str = "best") -> Path | None:
    """The checkpoint file of the run folder ``run``: ``checkpoint_<which>.pt``, else the last one,
    else None."""
    run = Path(run)
    for path in (run / f"checkpoint_{which}.pt", run / LAST):
        if path.is_file():
            return path
    return None


# saving -------------------------------------------------------------------------------------------
def plain(obj: Any) -> Any:
    """``obj`` as tensors, dicts, lists, str, numbers, bools and None only (what ``weights_only`` loads)."""
    import torch

    if isinstance(obj, torch.Tensor) or obj is None or isinstance(obj, (str, bool, int, float)):
        return obj
    if isinstance(obj, dict):
        return {(k if isinstance(k, (str, int)) else str(k)): plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [plain(v) for v in obj]
    if hasattr(obj, "item"):  # numpy scalars
        return obj.item()
    return str(obj)


def save_checkpoint(path: Path, payload: dict[str, Any]) -> None:
    """Write atomically (temporary file, then rename) a checkpoint that ``weights_only=True`` loads."""
    import torch

    tmp = path.with_suffix(".tmp")
    torch.save(plain(payload), tmp)
    tmp.replace(path)


# loading ------------------------------------------------------------------------------------------
def refusal(path: Path, exc: Exception) -> str:
    """The message for a checkpoint that holds more than plain data (naming the object it wanted)."""
    import re

    found = re.search(r"GLOBAL ([\w.]+)", str(exc))
    what = f" ({found.group(1)})" if found else ""
    return (f"{path}: refused to load: it holds a Python object{what} besides plain tensors and data, "
            f"and loading it could run code; vsekit only loads checkpoints that load with "
            f"torch.load(weights_only=True), as the ones it writes do")


def load_file(path: Path, device: str = "cpu", hint: str = "") -> Any:
    """Whatever a checkpoint file holds, loaded with ``weights_only=True`` (a hostile pickle is refused,
    never run); a damaged or truncated file is a ``StoreError`` (``hint`` says what to do about it)."""
    import pickle

    import torch

    try:
        return torch.load(path, map_location=device, weights_only=True)
    except pickle.UnpicklingError as exc:
        raise StoreError(refusal(path, exc)) from None
    except (RuntimeError, EOFError, OSError, ValueError) as exc:
        raise StoreError(f"{path}: not a readable checkpoint (damaged or truncated?): "
                         f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
                         f"{hint}") from None


def load_checkpoint(path: Path, device: str = "cpu") -> dict[str, Any]:
    """Load a run checkpoint safely: ``weights_only=True`` never runs code from the file.

    Tensors are mapped to ``device``, so a run trained on CUDA loads on a CPU-only machine. A file
    that is damaged, truncated or holds anything but plain data is refused with a ``StoreError``.
    """
    import torch

    path = Path(path)
    if not path.is_file():
        raise StoreError(f"no checkpoint {path}")
    if str(device).startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"--device {device}: CUDA is not available on this machine; use --device cpu")
    ck = load_file(path, device, hint="; delete it and retrain, or resume from the other checkpoint")
    if not isinstance(ck, dict) or not isinstance(ck.get("model"), dict):
        raise StoreError(f"{path}: not a vsekit run checkpoint (expected a dict with a 'model' state dict)")
    return ck


def load_model(run: str | Path, device: str = "cpu", checkpoint: str = "best") -> tuple["RetrievalModel", dict[str, Any]]:
    """A trained run's model in eval mode (best checkpoint by default, else the last) and its saved
    config, with ``checkpoint`` (the file) and ``checkpoint_epoch`` added."""
    from ..devices import exact_float32
    from ..models import create_model

    run = Path(run)
    if not (run / "config.json").is_file():
        raise StoreError(not_a_run(run))
    config = json.loads((run / "config.json").read_text())
    path = run_checkpoint(run, checkpoint) or run / LAST
    exact_float32()   # scored in IEEE float32 on CUDA too (TF32 off), as trained
    ck = load_checkpoint(path, device)
    kw = dict(ck.get("model_kwargs") or config["model_kwargs"])
    kw["img_shape"] = tuple(kw["img_shape"])
    model = create_model(ck.get("model_name") or config["train"]["model"], **kw)
    model.load_state_dict(ck["model"])
    model.to(device).eval()
    config["checkpoint"] = str(path)
    config["checkpoint_epoch"] = ck.get("epoch", ck.get("state", {}).get("epoch"))
    return model, config
