"""The run folder: what vsekit writes into it, and how ``--overwrite`` empties it of an old run.

A run folder holds the trainer's files (``config.json``, checkpoints, ``metrics.jsonl``,
``curves.png``), what ``evaluate`` adds (``metrics.json``, ``sims_*.npy``) and the pipeline's record
(``.vsekit-pipeline.json``). ``--overwrite`` removes all of them, so a report can never show one
run's name with another run's numbers; files vsekit did not write are left alone.

The old run is removed only once the new one has started successfully: its options, store, feature
set and model have all been checked (a mistake in the new command leaves the old run intact).
"""

from __future__ import annotations

from pathlib import Path

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
    if (out / "checkpoint_last.pt").is_file():
        return True
    if not (out / "checkpoint_best.pt").is_file():
        return False
    import json

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
