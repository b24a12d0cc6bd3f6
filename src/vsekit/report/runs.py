"""Reading a training run folder: its config, per-epoch log and test metrics.

A run folder (its files: ``train/checkpoint.py``; docs/train.md) holds ``config.json``,
``metrics.jsonl`` (one JSON object per epoch), ``checkpoint_best.pt`` / ``checkpoint_last.pt`` and,
after ``vsekit evaluate``, ``metrics.json`` (+ ``sims_<split>.npy`` when small or asked). Any of these but ``config.json`` may be missing; the
report says what is missing instead of failing.

Metric names are matched loosely (``r1``, ``R@1``, ``i2t_r1``, nested ``{"i2t": {"r1": ..}}``,
``medr``/``med_r``...) so that the report reads what the evaluator writes without both sides having
to agree on one spelling.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

#: the two retrieval directions, in the papers' order (caption retrieval first)
DIRECTIONS = ("i2t", "t2i")
DIRECTION_TITLES = {"i2t": "Image → Text (caption retrieval)", "t2i": "Text → Image (image retrieval)"}
#: per-direction metrics in the papers' order; True where larger is better
METRICS = (("r1", "R@1", True), ("r5", "R@5", True), ("r10", "R@10", True),
           ("medr", "Med r", False), ("meanr", "Mean r", False), ("mrr", "MRR", True))
HIGHER_IS_BETTER = {f"{d}.{m}": hib for d in DIRECTIONS for m, _, hib in METRICS} | {"rsum": True}

_I2T = ("i2t", "imagetotext", "image2text", "img2txt", "imgtotxt", "img2text", "captionretrieval",
        "annotation", "imagetocaption", "i2c")
_T2I = ("t2i", "texttoimage", "text2image", "txt2img", "txttoimg", "text2img", "imageretrieval",
        "search", "captiontoimage", "c2i")


def _norm(key: Any) -> str:
    return re.sub(r"[^a-z0-9]", "", str(key).lower())


def _direction(s: str) -> str | None:
    for name, aliases in (("i2t", _I2T), ("t2i", _T2I)):
        if any(a in s for a in aliases):
            return name
    return None


_METRIC_PATTERNS = (("rsum", r"rsum|recallsum|sumrecall"), ("mrr", r"mrr|meanreciprocalrank"),
                    ("medr", r"medr|medianr|medrank|medianrank"), ("meanr", r"meanr|meanrank|avgr|avgrank"),
                    ("r10", r"r10|recall10|recallat10"), ("r5", r"r5|recall5|recallat5"),
                    ("r1", r"r1|recall1|recallat1"))


def _strip_direction(s: str) -> str:
    for alias in _I2T + _T2I:
        s = s.replace(alias, "")
    return s


def _metric(s: str) -> str | None:
    """The metric one key names (``"i2t_R@1"`` → ``r1``), ignoring direction and val/test prefixes."""
    s = re.sub(r"^(val|valid|validation|test|eval|dev|train)", "", _strip_direction(s))
    for name, pattern in _METRIC_PATTERNS:
        if re.fullmatch(pattern, s):
            return name
    return None


def _leaves(obj: Any, path: tuple[str, ...] = ()) -> Iterator[tuple[tuple[str, ...], Any]]:
    """Every scalar leaf of nested dicts, with its key path (lists are not walked)."""
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _leaves(v, path + (str(k),))
    else:
        yield path, obj


def _number(v: Any) -> float | None:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    v = float(v)
    return v if math.isfinite(v) else None


def classify(path: tuple[str, ...]) -> tuple[str | None, tuple[str, ...]]:
    """The canonical metric a leaf path names (``"i2t.r1"``, ``"rsum"``, or None), and the rest.

    One path part names the metric (possibly with the direction in it: ``i2t_r1``), any part may
    name the direction; ``rest`` are the parts that name neither (the protocol, e.g. ``coco-1k``).
    """
    norm = [_norm(p) for p in path]
    metrics = [m for m in (_metric(p) for p in norm) if m]
    if len(metrics) != 1:
        return None, ()
    rest = tuple(p for p, n in zip(path, norm) if _direction(n) is None and _metric(n) is None)
    if metrics[0] == "rsum":
        return "rsum", rest
    directions = {d for d in (_direction(n) for n in norm) if d}
    if len(directions) != 1:
        return None, ()
    return f"{directions.pop()}.{metrics[0]}", rest


def parse_metrics(obj: Any) -> dict[str, dict[str, float]]:
    """``metrics.json`` → ``{protocol: {"i2t.r1": v, ..., "rsum": v}}`` (protocol "" when flat)."""
    out: dict[str, dict[str, float]] = {}
    label = obj.get("protocol") if isinstance(obj, dict) and isinstance(obj.get("protocol"), str) else ""
    for path, value in _leaves(obj):
        num = _number(value)
        if num is None:
            continue
        name, rest = classify(path)
        if name is None:
            continue
        rest = tuple(p for p in rest if _norm(p) not in ("metrics", "protocols", "results", "summary", "mean",
                                                         "avg", "average"))
        if any(_norm(p) in ("folds", "fold", "std") or _norm(p).startswith("fold") for p in rest):
            continue  # per-fold values: the table shows the protocol's average
        protocol = "/".join(rest) or label
        out.setdefault(protocol, {}).setdefault(name, num)
    for values in out.values():
        if "rsum" not in values and all(f"{d}.r{k}" in values for d in DIRECTIONS for k in (1, 5, 10)):
            values["rsum"] = sum(values[f"{d}.r{k}"] for d in DIRECTIONS for k in (1, 5, 10))
    return {p: v for p, v in out.items() if v}


def parse_epoch(record: dict[str, Any]) -> dict[str, float]:
    """One ``metrics.jsonl`` record → ``{"epoch", "loss", "rsum", "i2t.r1", "t2i.r1"}`` (those present).

    Validation values are preferred over training ones when both are logged; the training loss is
    the leaf named ``train_loss``/``loss`` (not a validation loss).
    """
    out: dict[str, float] = {}
    ranked: dict[str, tuple[int, float]] = {}
    for path, value in _leaves(record):
        num = _number(value)
        if num is None:
            continue
        joined = "".join(_norm(p) for p in path)
        if joined in ("epoch", "epochs"):
            out["epoch"] = num
            continue
        is_val = "val" in joined or "dev" in joined
        if "loss" in joined and not is_val:
            # prefer the plain total: "train_loss" / "loss" over components ("loss_rank", "penalty")
            pri = 0 if joined in ("loss", "trainloss", "losstrain", "trainlossmean", "meanloss") else 1
            key = "loss"
        else:
            name, _ = classify(path)
            if name not in ("rsum", "i2t.r1", "t2i.r1"):
                continue
            pri, key = (0 if is_val else 1), name
        if key not in ranked or pri < ranked[key][0]:
            ranked[key] = (pri, num)
    out.update({k: v for k, (_, v) in ranked.items()})
    if record.get("switch"):  # the curriculum's switch to the max loss (PH/POE) happened here
        out["switch"] = 1.0
    return out


@dataclass
class RunInfo:
    """What the report knows about one run folder."""

    path: Path
    name: str
    config: dict[str, Any]
    history: list[dict[str, float]] = field(default_factory=list)
    metrics: dict[str, dict[str, float]] | None = None
    raw_metrics: Any = None
    notes: list[str] = field(default_factory=list)

    @property
    def checkpoint(self) -> Path | None:
        for name in ("checkpoint_best.pt", "checkpoint_last.pt"):
            if (self.path / name).is_file():
                return self.path / name
        return None

    def sims_file(self, split: str) -> Path | None:
        p = self.path / f"sims_{split}.npy"
        return p if p.is_file() else None

    @property
    def model_name(self) -> str:
        """The model's registry name (``config["train"]["model"]`` for the trainer's runs)."""
        for cfg in (self.config, self.config.get("train")):
            if isinstance(cfg, dict):
                for key in ("model", "model_name"):
                    if isinstance(cfg.get(key), str) and cfg[key]:
                        return cfg[key]
        return "?"

    @property
    def label(self) -> str:
        """The model and, for the trainer's runs, the presets it was made with."""
        presets = (self.config.get("train") or {}).get("presets") if isinstance(self.config.get("train"), dict) else None
        return self.model_name + (f" ({', '.join(presets)})" if presets else "")


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path} is not valid JSON (line {exc.lineno}: {exc.msg})") from exc


def load_run(path: str | Path) -> RunInfo:
    """Read a run folder; only ``config.json`` is required."""
    from ..storage.base import not_a_run

    path = Path(path)
    cfg_path = path / "config.json"
    if not cfg_path.is_file():
        raise ValueError(not_a_run(path))
    config = _read_json(cfg_path)
    if not isinstance(config, dict):
        raise ValueError(f"{cfg_path} must hold a JSON object")
    run = RunInfo(path=path, name=path.resolve().name, config=config)

    log = path / "metrics.jsonl"
    if log.is_file():
        for lineno, line in enumerate(log.read_text().splitlines(), 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                run.notes.append(f"{log.name} line {lineno} is not valid JSON; skipped")
                continue
            if isinstance(record, dict):
                run.history.append(parse_epoch(record))
        if not run.history:
            run.notes.append(f"{log.name} has no epochs: no learning curves")
    else:
        run.notes.append("no metrics.jsonl: no learning curves")

    mpath = path / "metrics.json"
    if mpath.is_file():
        run.raw_metrics = _read_json(mpath)
        run.metrics = parse_metrics(run.raw_metrics)
        if not run.metrics:
            run.notes.append("metrics.json holds no retrieval metrics this report recognises")
            run.metrics = None
    else:
        run.notes.append(f"no test evaluation (no metrics.json): run `vsekit evaluate {path}`")
    if run.checkpoint is None:
        run.notes.append("no checkpoint: retrieval examples only from a saved similarity matrix, no attention")
    return run


def load_ensembles(infos: list[RunInfo]) -> list[RunInfo]:
    """The ensembles evaluated from these run folders (``metrics_ensemble.json`` of ``vsekit evaluate
    A B``), each as a metrics-only row named as the terminal names it (``A + B``). A SAF run with an
    SGR run is SGRAF, the paper's name for that average: the row is called ``SGRAF (A + B)``."""
    out: list[RunInfo] = []
    seen: set[tuple[str, ...]] = set()
    by_path = {i.path.resolve(): i for i in infos}
    for info in infos:
        path = info.path / "metrics_ensemble.json"
        if not path.is_file():
            continue
        doc = _read_json(path)
        paths = [Path(r) for r in (doc.get("runs") or [])] if isinstance(doc, dict) else []
        runs = tuple(p.name for p in paths)
        metrics = parse_metrics(doc)
        if not runs or not metrics or runs in seen:
            continue
        seen.add(runs)
        name, model = " + ".join(runs), "ensemble: mean of similarities"
        if sorted(_model_of(p, by_path) for p in paths) == ["saf", "sgr"]:
            name, model = f"SGRAF ({name})", "SGRAF: mean of the SAF and SGR similarities"
        out.append(RunInfo(path=info.path, name=name, metrics=metrics, raw_metrics=doc, config={"model": model}))
    return out


def _model_of(path: Path, known: dict[Path, RunInfo]) -> str:
    """The model name of the run folder ``path``: one of the report's runs (by path, else by folder
    name, since ``vsekit evaluate`` saved the paths as it was given them), else its config.json."""
    resolved = path.resolve()
    if resolved in known:
        return known[resolved].model_name
    named = [i for p, i in known.items() if p.name == path.name]  # a relative path from another folder
    if len(named) == 1:
        return named[0].model_name
    try:
        cfg = _read_json(resolved / "config.json")
    except (OSError, ValueError):
        return "?"
    return RunInfo(path=resolved, name=resolved.name, config=cfg).model_name if isinstance(cfg, dict) else "?"
