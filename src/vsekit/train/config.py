"""The resolved training configuration.

Config flows one way: defaults → presets (``presets.py``, in the order given, later ones win) →
explicit overrides (CLI options) → a frozen ``TrainConfig`` saved as ``RUN/config.json``. ``--model``
without a preset that names a model starts from that model's paper preset
(``presets.MODEL_DEFAULT_PRESET``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

from .presets import MODEL_DEFAULT_PRESET, PRESETS  # noqa: F401 (re-exported)


PRECISIONS = ("fp32", "bf16")


@dataclass
class TrainConfig:
    """Everything that determines a training run (saved as ``RUN/config.json``)."""

    model: str = ""
    presets: list[str] = field(default_factory=list)
    epochs: int = 30
    batch_size: int = 128
    embed_dim: int = 1024
    word_dim: int = 300
    lr: float = 2e-4
    lr_milestones: list[int] = field(default_factory=list)  # x lr_decay at each (epochs since phase start)
    lr_decay: float = 0.1
    grad_clip: float = 2.0
    optimizer: str = "adam"         # "adam", or "adadelta" (SMAN)
    weight_decay: float = 0.0
    loss: str = "hinge"             # a loss registered in models/losses.py
    margin: float = 0.2
    max_violation: bool = False
    similarity: str | None = None   # None: the model's own
    use_abs: bool | None = None     # None: the model's own
    captions: str = "one"           # "one" random caption per image per epoch, or "all"
    curriculum: bool = False        # PH/POE: sum loss until val rsum stalls, then max loss from the best
    patience: int = 3
    lr2: float | None = None        # learning rate of the max-loss phase (default: lr)
    model_args: dict[str, Any] = field(default_factory=dict)
    train_split: str = "train"
    val_split: str = "val"
    seed: int = 0
    shuffle_memory_gb: float = 4.0  # window buffers' budget: a global shuffle whenever the split fits
    window_chunks: int | None = None  # fixed window (chunks); None: sized from shuffle_memory_gb
    eval_batch: int = 256
    device: str = "cpu"
    precision: str = "fp32"         # "fp32", or "bf16": the forward under autocast (loss, metrics fp32)
    checkpoint_every: str | None = None   # mid-epoch checkpoints: "N" steps or "Nm" minutes (None: epoch ends)

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> "TrainConfig":
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})


def resolve_config(model: str | None = None, presets: Sequence[str] = (), **overrides: Any) -> TrainConfig:
    """Defaults, then each preset in order, then the overrides that are not None."""
    values: dict[str, Any] = {}
    model_args: dict[str, Any] = {}
    presets = list(presets)
    named = [p for p in presets if PRESETS.get(p, {}).get("model")]
    if model and not named and model in MODEL_DEFAULT_PRESET:
        presets.insert(0, MODEL_DEFAULT_PRESET[model])
    for name in presets:
        if name not in PRESETS:
            raise ValueError(f"unknown preset {name!r}; valid choices: {', '.join(PRESETS)}")
        p = dict(PRESETS[name])
        model_args.update(p.pop("model_args", {}))
        values.update(p)
    user_args = overrides.pop("model_args", None) or {}
    model_args.update(user_args)
    fields = {f.name for f in dataclasses.fields(TrainConfig)}
    for key, value in overrides.items():
        if key not in fields:
            raise ValueError(f"unknown training option {key!r}; valid: {', '.join(sorted(fields))}")
        if value is not None:
            values[key] = value
    if model:
        values["model"] = model
    if not values.get("model"):
        raise ValueError("no model given: pass --model (or a preset that names one: "
                         f"{', '.join(n for n, p in PRESETS.items() if 'model' in p)})")
    cfg = TrainConfig(**values, presets=list(presets), model_args=model_args)
    _validate(cfg)
    return cfg


def _validate(cfg: TrainConfig) -> None:
    from .data import CAPTION_MODES
    from ..models.losses import SIMILARITIES, loss_names

    if cfg.captions not in CAPTION_MODES:
        raise ValueError(f"--captions {cfg.captions!r}: valid choices: {', '.join(CAPTION_MODES)}")
    if cfg.loss not in loss_names():
        raise ValueError(f"loss {cfg.loss!r}: valid choices: {', '.join(loss_names())}")
    if cfg.similarity is not None and cfg.similarity not in SIMILARITIES:
        raise ValueError(f"--similarity {cfg.similarity!r}: valid choices: {', '.join(SIMILARITIES)}")
    for name in ("epochs", "batch_size", "embed_dim", "word_dim"):
        if int(getattr(cfg, name)) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(cfg, name)}")
    if cfg.lr <= 0 or (cfg.lr2 is not None and cfg.lr2 <= 0):
        raise ValueError("--lr and --lr2 must be positive")
    if cfg.patience < 1:
        raise ValueError(f"--patience must be at least 1, got {cfg.patience}")
    if cfg.precision not in PRECISIONS:
        raise ValueError(f"--precision {cfg.precision!r}: valid choices: {', '.join(PRECISIONS)}")
    if cfg.checkpoint_every is not None:
        parse_every(cfg.checkpoint_every)
    if not cfg.shuffle_memory_gb > 0:
        raise ValueError(f"--shuffle-memory must be positive (GB), got {cfg.shuffle_memory_gb}")


def parse_every(value) -> tuple[str, float]:
    """``--checkpoint-every``: ``"500"`` (steps) -> ("steps", 500); ``"20m"`` (minutes) -> ("seconds", 1200)."""
    text = str(value).strip().lower()
    try:
        if text.endswith("m"):
            minutes = float(text[:-1])
            if minutes > 0:
                return "seconds", minutes * 60.0
        else:
            steps = int(text)
            if steps >= 1:
                return "steps", float(steps)
    except ValueError:
        pass
    raise ValueError(f"--checkpoint-every {value!r}: give a number of steps (e.g. 500) or of minutes (e.g. 20m)")
