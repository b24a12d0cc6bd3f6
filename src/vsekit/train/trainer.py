"""The trainer: Adam (Adadelta for SMAN), step decay, gradient clipping, curriculum PH/POE, checkpoints, resume, logs.

Curriculum (FNE paper, PH/POE): the sum of hinges until the validation rsum has not improved for
``patience`` epochs, then the max of hinges from the best checkpoint at its own learning rate
(``lr2``). Every epoch writes ``checkpoint_last.pt``, ``metrics.jsonl`` (rewritten from the saved
history, so a resumed run's log equals an uninterrupted one's), ``curves.png`` and, when the
validation rsum improves, ``checkpoint_best.pt``; the epoch's randomness is seeded from (seed, epoch)
(docs/train.md, "Reruns"). Data-parallel runs go through the same code: :class:`Run` holds the
pieces, ``step.train_step`` the step, ``distributed`` the group; only rank 0 writes files.
"""

from __future__ import annotations

import contextlib
import inspect
import json
import math
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch

from ..devices import exact_float32
from ..interrupts import Interrupted, active as active_handling
from ..storage.base import not_a_run
from ..storage.objstore import store_ref
from ..storage.store import FeatureStore, StoreError
from ..version import __version__
from . import presets
from ..models import _MODELS, RetrievalModel, create_model, lookup
from .checkpoint import load_checkpoint, plain as _plain, save_checkpoint as _save
from .config import TrainConfig, parse_every, resolve_config
from .distributed import SINGLE, Group, NodeShare
from .step import step_seed, train_step  # noqa: F401 (re-exported)
from .data import EvalSet, FeatureSource, PairStream, Tokens, describe_source, open_features, training_rows
from .evaluation import compute_ranks, metrics_from_ranks
from ..models.losses import create_loss
from .scoring import EnsembleScorer, encode_set, evaluating
from .tblog import CurveWriter

# steps between host reads of the running loss for the progress bar (the loss stays on the device)
LOG_EVERY = 50
COMMON_ARGS = ("img_shape", "vocab_size", "embed_dim", "word_dim", "similarity", "use_abs")


def model_kwargs(cfg: TrainConfig, img_shape: tuple[int, ...], vocab_size: int) -> dict[str, Any]:
    """The factory's keyword arguments: the common ones it accepts, plus ``model_args``.

    Common arguments a factory does not take are dropped (SMAN has no ``similarity``); a
    ``model_args`` key it does not take is dropped when it came from a preset meant for another model
    and is an error otherwise (checked by the CLI through ``check_model_args``).
    """
    factory = lookup(_MODELS, "model", cfg.model)
    common = {"img_shape": tuple(int(s) for s in img_shape), "vocab_size": int(vocab_size),
              "embed_dim": cfg.embed_dim, "word_dim": cfg.word_dim, "similarity": cfg.similarity,
              "use_abs": cfg.use_abs}
    params = inspect.signature(factory).parameters
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    kw = {k: v for k, v in common.items() if v is not None and (takes_any or k in params)}
    kw.update({k: v for k, v in cfg.model_args.items() if takes_any or k in params})
    return kw


def check_model_args(model: str, keys: list[str]) -> None:
    """Refuse ``--model-arg`` keys the model's factory does not take, listing the ones it does."""
    params = inspect.signature(lookup(_MODELS, "model", model)).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return
    valid = [p for p in params if p not in COMMON_ARGS]
    for key in keys:
        if key not in params:
            raise ValueError(f"--model-arg {key}: model {model!r} takes no such argument; valid: {', '.join(valid)}")


def check_model_arg_types(model: str, args: dict[str, Any]) -> None:
    """Refuse a ``--model-arg`` value of another type than the factory's default (``hops=many``)."""
    params = inspect.signature(lookup(_MODELS, "model", model)).parameters
    kinds = ((bool, bool, "true or false"), (int, int, "an integer"), (float, (int, float), "a number"),
             (str, str, "a string"))
    for key, value in args.items():
        default = params[key].default if key in params else None
        kind = next(((takes, want) for typ, takes, want in kinds if isinstance(default, typ)), None)
        if kind is None:   # no default, None, or another type: not checked
            continue
        takes, want = kind
        if not isinstance(value, takes) or (isinstance(value, bool) and not isinstance(default, bool)):
            raise ValueError(f"--model-arg {key}={value!r}: model {model!r} expects {want} "
                             f"(default {default!r})")


def build_model(cfg: TrainConfig, img_shape, vocab_size: int) -> tuple[RetrievalModel, dict[str, Any]]:
    kw = model_kwargs(cfg, img_shape, vocab_size)
    check_model_arg_types(cfg.model, {k: v for k, v in cfg.model_args.items() if k in kw})
    torch.manual_seed(cfg.seed)
    try:
        return create_model(cfg.model, **kw), kw
    except (TypeError, ValueError, RuntimeError) as exc:
        raise ValueError(f"cannot build model {cfg.model!r} with {kw}: {exc}; check --model-arg and "
                         f"the dimension options") from exc


# validation ---------------------------------------------------------------------------------------
def validate(model: RetrievalModel, source: FeatureSource, tokens: Tokens, evalset: EvalSet,
             cfg: TrainConfig, group: Group = SINGLE, device: str | None = None) -> dict[str, float]:
    """Metrics of ``model`` on ``evalset``: encoded and scored with the whole model in eval mode, as
    ``vsekit evaluate`` scores a checkpoint; the model's modes, parameters and buffers are unchanged.

    Data-parallel, each rank encodes its part of the images and captions and scores its part of the
    captions against every image; the counts are summed over the ranks, so every rank gets the
    metrics of one process with each encoding and each score computed once."""
    share = group if group.distributed and len(evalset.captions) >= group.world else None
    with evaluating(model):
        enc = encode_set(model, source, tokens, evalset, batch_size=cfg.eval_batch, device=device or cfg.device,
                         group=group)
        scorer = EnsembleScorer([model], [enc])
        ranks = compute_ranks(scorer, len(evalset.rows), evalset.caption_image, share=share)
    return metrics_from_ranks(*ranks)


def make_optimizer(cfg: TrainConfig, params, lr: float) -> torch.optim.Optimizer:
    return presets.make_optimizer(cfg.optimizer, params, lr, cfg.weight_decay)


def _lr(cfg: TrainConfig, state: dict[str, Any], epoch: int) -> float:
    base = cfg.lr if state["phase"] != "max" else (cfg.lr2 or cfg.lr)
    since = epoch - state["phase_start"]
    return base * cfg.lr_decay ** sum(1 for m in cfg.lr_milestones if since >= int(m))


# resuming -----------------------------------------------------------------------------------------
# options that may change when a run resumes: where it runs and how long, not what it learns
RESUMABLE = ("epochs", "device", "eval_batch", "checkpoint_every")
OPTION_NAMES = {"lr_milestones": "--lr-update", "use_abs": "--abs/--no-abs",
                "max_violation": "--max-violation/--sum-violation", "curriculum": "--curriculum/--no-curriculum",
                "shuffle_memory_gb": "--shuffle-memory"}


def option_name(key: str) -> str:
    return OPTION_NAMES.get(key, "--" + key.replace("_", "-"))


def _resume_config(saved: dict[str, Any], model: str | None, presets, overrides: dict[str, Any]
                   ) -> tuple[TrainConfig, dict[str, list]]:
    """The saved config with the options that may change on resume applied; refuses any other change.

    Returns the config and ``{key: [old, new]}`` of what changed. An option given with the value the
    run already has is accepted, so rerunning the same command with ``--resume`` works.
    """
    from .config import MODEL_DEFAULT_PRESET, PRESETS, _validate

    cfg = TrainConfig.from_json(saved["train"])
    refused: list[str] = []
    if model and model != cfg.model:
        refused.append(f"--model {model} (the run trains {cfg.model})")
    if presets:
        given = list(presets)
        if cfg.model in MODEL_DEFAULT_PRESET and not any(PRESETS.get(p, {}).get("model") for p in given):
            given.insert(0, MODEL_DEFAULT_PRESET[cfg.model])
        if given != list(cfg.presets) and list(presets) != list(cfg.presets):
            refused.append(f"--preset {' '.join(presets)} (the run used {' '.join(cfg.presets) or 'none'})")
    for key, value in (overrides.pop("model_args", None) or {}).items():
        if cfg.model_args.get(key) != value:
            refused.append(f"--model-arg {key}={value} (the run has {cfg.model_args.get(key)!r})")
    changed: dict[str, list] = {}
    for key, value in overrides.items():
        if value is None or not hasattr(cfg, key):
            continue
        old = getattr(cfg, key)
        same = (list(old) == list(value)) if isinstance(old, (list, tuple)) else old == value
        if same:
            continue
        if key in RESUMABLE:
            changed[key] = [old, value]
            setattr(cfg, key, type(old)(value) if old is not None else value)
        else:
            refused.append(f"{option_name(key)} {value} (the run has {old})")
    if refused:
        raise ValueError("--resume continues a run with its own settings; these options differ from the "
                         "run's and cannot change on resume: " + "; ".join(refused) + ". Only "
                         + ", ".join(option_name(k) for k in RESUMABLE) + " (and --progress) may change; "
                         "drop the others, or start a new run with --overwrite or another --out")
    _validate(cfg)
    return cfg, changed


def _check_same_features(saved: dict[str, Any], features: str, source) -> None:
    """Refuse to resume on another feature set, or on the same one re-made with other settings or weights."""
    if features != saved.get("features"):
        raise ValueError(f"--features {features}: the run was trained on {saved.get('features')!r}; "
                         f"resume with --features {saved.get('features')}")
    then = saved.get("feature_attrs") or {}
    now = {k: source.fs.attrs.get(k) for k in then}
    diff = [k for k in then if then[k] != now[k]]
    if diff:
        raise ValueError(f"feature set {features!r} changed since the run started (" + ", ".join(
            f"{k}: {then[k]!r} -> {now[k]!r}" for k in diff) + "); a resumed run must read the same "
            f"features: restore them, or start again with --overwrite")


def _feature_attrs(source) -> dict[str, Any]:
    """The provenance of the training features that a resume must find unchanged."""
    keys = ("kind", "model", "config_hash", "parent", "weights", "weights_sha256")
    return {k: source.fs.attrs.get(k) for k in keys}


def _start_folder(out: Path, resume: bool, overwrite: bool) -> None:
    """Refuse to start over a trained run without ``--overwrite``; a resume needs a checkpoint."""
    from .checkpoint import holds_trained_run

    if resume:
        if not (out / "checkpoint_last.pt").is_file():
            raise StoreError(f"--resume: {out} has no checkpoint_last.pt to resume from")
        if not (out / "config.json").is_file():
            raise StoreError(f"--resume: {not_a_run(out)}")
    elif holds_trained_run(out) and not overwrite:
        raise StoreError(f"{out} already holds a training run; pass --resume to continue it or "
                         f"--overwrite to start again")


class LossMeter:
    """The epoch's summed loss, accumulated on the device: no host synchronisation per step."""

    def __init__(self, device: torch.device):
        dtype = torch.float32 if device.type == "mps" else torch.float64
        self.total = torch.zeros((), dtype=dtype, device=device)
        self.steps = 0

    def add(self, loss: torch.Tensor) -> None:
        self.total += loss.detach()
        self.steps += 1

    def mean(self) -> float:
        """The mean loss so far (one host read)."""
        return float(self.total) / max(1, self.steps)


# the run ------------------------------------------------------------------------------------------
class Stop(Exception):
    """Every rank agreed to stop at a step boundary (a signal came); the checkpoint is saved."""

    def __init__(self, signum: int, epoch: int, batches: int):
        super().__init__(signum)
        self.signum, self.epoch, self.batches = signum, epoch, batches


class Run:
    """One training run: its config, data, model, optimizer, state, group and files.

    :meth:`epoch` trains an epoch (from a mid-epoch position after a resume), :meth:`validate`
    scores the validation split, :meth:`end_epoch` records the epoch (best checkpoint, curriculum
    switch, last checkpoint, log) and :meth:`save_position` writes a mid-epoch checkpoint. Only rank
    0 writes files; every rank holds the same weights, optimizer and state.
    """

    def __init__(self, cfg, out, group, net, kw, source, tokens, evalset, stream, device, log, progress):
        self.cfg, self.out, self.group, self.net, self.kw = cfg, out, group, net, kw
        self.source, self.tokens, self.evalset, self.stream = source, tokens, evalset, stream
        self.device, self.log, self.progress = device, log, progress
        self.state: dict[str, Any] = {"epoch": 0, "phase": "sum" if cfg.curriculum else "single", "phase_start": 0,
                                      "best_rsum": -math.inf, "best_epoch": 0, "stall": 0, "history": [],
                                      "switched_at": None}
        self.optim = make_optimizer(cfg, net.parameters(), cfg.lr)
        self.position: dict[str, Any] | None = None
        self.every = parse_every(cfg.checkpoint_every) if cfg.checkpoint_every else None
        self.steps_done = 0
        self.last_save = time.monotonic()
        # the node's shared window buffers: /dev/shm, or another memory-backed folder (docs/train.md)
        self.node = NodeShare(group, os.environ.get("VSEKIT_SHARED_WINDOW_DIR") or "/dev/shm")
        self.fallback_said = False

    @property
    def last(self) -> Path:
        return self.out / "checkpoint_last.pt"

    def save(self, path: Path, **extra: Any) -> None:
        """A checkpoint of the weights and the run's settings, with ``extra`` (optimizer, state, position...)."""
        _save(path, {"model": self.net.state_dict(), **extra, "config": self.cfg.to_json(),
                     "model_name": self.cfg.model, "model_kwargs": self.kw})

    def load(self, ck: dict[str, Any]) -> None:
        self.net.load_state_dict(ck["model"])
        self.state = ck["state"]
        self.position = ck.get("position")
        self.steps_done = int(self.state.get("steps", 0))
        epoch = self.position["epoch"] - 1 if self.position else self.state["epoch"]
        self.optim = make_optimizer(self.cfg, self.net.parameters(), _lr(self.cfg, self.state, epoch))
        self.optim.load_state_dict(ck["optimizer"])

    # -- checkpoints (rank 0 writes; the others wait, so nobody exits before the file is whole) ----
    def save_position(self, epoch: int, batches: int, meter: "LossMeter") -> None:
        """A mid-epoch checkpoint: weights, optimizer, state, and where the epoch's stream stands."""
        if self.group.main:
            position = {"epoch": epoch, "batches": batches, "loss_total": float(meter.total),
                        "loss_steps": meter.steps, "steps": self.steps_done}
            if self.group.world == 1:   # one process: its dropout stream continues (ranks reseed per step)
                position["rng"] = torch.get_rng_state()
                if self.device.type == "cuda":
                    position["cuda_rng"] = torch.cuda.get_rng_state(self.device)
            self.save(self.last, optimizer=self.optim.state_dict(), state=self.state, position=position)
        self.group.barrier("the checkpoint's save")
        self.last_save = time.monotonic()

    def checkpoint_due(self) -> bool:
        """Whether a mid-epoch checkpoint is due after this step (rank 0's clock for minutes)."""
        if self.every is None:
            return False
        kind, value = self.every
        if kind == "steps":
            return self.steps_done % int(value) == 0
        return time.monotonic() - self.last_save >= value

    # -- an epoch ------------------------------------------------------------------------------
    def epoch(self, epoch: int) -> tuple[float, float]:
        """Train one epoch (from the saved position when resuming into it); returns (mean loss, lr)."""
        cfg, state, group = self.cfg, self.state, self.group
        loss_fn = create_loss(cfg.loss, margin=cfg.margin, max_violation=cfg.max_violation or state["phase"] == "max")
        lr = _lr(cfg, state, epoch - 1)
        for g in self.optim.param_groups:
            g["lr"] = lr
        torch.manual_seed(cfg.seed * 100003 + epoch)
        meter = LossMeter(self.device)
        skip = 0
        pos = self.position if self.position and self.position["epoch"] == epoch else None
        if pos is not None:
            skip = int(pos["batches"])
            meter.total.fill_(float(pos["loss_total"]))
            meter.steps = int(pos["loss_steps"])
            self.steps_done = int(pos.get("steps", 0))
            if "rng" in pos and group.world == 1:
                torch.set_rng_state(pos["rng"].cpu())
                if "cuda_rng" in pos and self.device.type == "cuda":
                    torch.cuda.set_rng_state(pos["cuda_rng"].cpu(), self.device)
            self.position = None
        # data-parallel: the ranks of a node share the window (read once per node into shared memory),
        # each copying out its rows; one rank per node keeps only its rows (docs/train.md, "Data per rank")
        if group.distributed and group.local_world > 1:
            batches = self.stream.epoch_shared(epoch, group.rank, group.world, self.node, skip=skip)
        elif group.distributed:
            batches = self.stream.epoch_part(epoch, group.rank, group.world, skip=skip)
        else:
            batches = self.stream.epoch(epoch, skip=skip)
        bar = None
        if self.progress and group.main:
            from tqdm.auto import tqdm
            # ranks: on stdout (their stderr, torch's and gloo's logging, goes to the run's log)
            batches = bar = tqdm(batches, total=len(self.stream), initial=skip, desc=f"epoch {epoch}/{cfg.epochs}",
                                 unit="batch", leave=False, file=sys.stdout if group.distributed else None)
        handler = active_handling()
        minutes = self.every is not None and self.every[0] == "seconds"
        self.net.train()
        done = skip
        for batch in batches:
            if group.world > 1:
                torch.manual_seed(step_seed(cfg.seed, epoch, done, group.rank))
            pending = handler.pending if handler is not None else None
            flags = (1.0 if pending == signal.SIGTERM else 0.0, 1.0 if pending == signal.SIGINT else 0.0,
                     1.0 if minutes and group.main and self.checkpoint_due() else 0.0)
            loss, flags = train_step(self.net, batch, loss_fn, self.optim, cfg, self.device, group, flags)
            if group.world == 1 and handler is not None:   # one process: a signal during this step counts
                pending = handler.pending
                flags = [1.0 if pending == signal.SIGTERM else 0.0, 1.0 if pending == signal.SIGINT else 0.0, flags[2]]
            meter.add(loss)
            done += 1
            self.steps_done += 1
            if flags[0] > 0 or flags[1] > 0:
                self.save_position(epoch, done, meter)
                raise Stop(signal.SIGTERM if flags[0] > 0 else signal.SIGINT, epoch, done)
            if (flags[2] > 0 if minutes else self.checkpoint_due()) and done < len(self.stream):
                self.save_position(epoch, done, meter)
            if bar is not None and meter.steps % LOG_EVERY == 0:
                bar.set_postfix(loss=f"{meter.mean():.4f}", refresh=False)
        if bar is not None:
            bar.close()
        if self.node.fallback and not self.fallback_said:
            self.fallback_said = True
            self.log(f"warning: the training window is not shared by the ranks of a node ({self.node.fallback}): "
                     f"each rank reads the window's chunks and keeps its own rows (docs/train.md, \"Data per rank\")")
        return meter.mean(), lr

    # -- validation and the epoch's end -----------------------------------------------------------
    def validate(self) -> dict[str, float]:
        """Metrics of the current weights, computed once over the ranks (each encodes and scores its
        part), the same on every rank."""
        return validate(self.net, self.source, self.tokens, self.evalset, self.cfg, self.group, str(self.device))

    def end_epoch(self, epoch: int, loss: float, lr: float, metrics: dict[str, float], t0: float,
                  curves) -> None:
        cfg, state, out, main = self.cfg, self.state, self.out, self.group.main
        entry = {"epoch": epoch, "phase": state["phase"], "loss": loss, "lr": lr,
                 "val": metrics, "time_s": round(time.perf_counter() - t0, 3)}
        state["epoch"] = epoch
        state["steps"] = self.steps_done
        state["history"].append(entry)
        if metrics["rsum"] > state["best_rsum"]:
            state.update(best_rsum=metrics["rsum"], best_epoch=epoch, stall=0)
            if main:
                self.save(out / "checkpoint_best.pt", epoch=epoch)
        else:
            state["stall"] += 1
        if state["phase"] == "sum" and state["stall"] >= cfg.patience:
            self.group.barrier("the best checkpoint's save")
            best = load_checkpoint(out / "checkpoint_best.pt", cfg.device if self.group.world == 1 else str(self.device))
            self.net.load_state_dict(best["model"])
            self.optim = make_optimizer(cfg, self.net.parameters(), cfg.lr2 or cfg.lr)
            state.update(phase="max", phase_start=epoch, stall=0, switched_at=epoch)
            entry["switch"] = f"max loss from the best checkpoint (epoch {best['epoch']})"
            self.log(f"epoch {epoch}: val rsum stalled for {cfg.patience} epochs; switching to the max loss "
                     f"from epoch {best['epoch']}")
        if main:
            self.save(self.last, optimizer=self.optim.state_dict(), state=state)
            _write_log(out, state)
            curves.log(entry)
        self.group.barrier("the epoch's checkpoint")
        self.last_save = time.monotonic()
        self.log(f"epoch {epoch}/{cfg.epochs} [{entry['phase']}] loss {entry['loss']:.4f} val rsum "
                 f"{metrics['rsum']:.1f} (best {state['best_rsum']:.1f} @ {state['best_epoch']})")


def train(store: str | Path, features: str, model: str | None, out: str | Path, *, presets=(),
          resume: bool = False, overwrite: bool = False, progress: bool = True,
          log: Callable[[str], None] | None = None, collective_timeout: float | None = None,
          **overrides: Any) -> dict[str, Any]:
    """Train ``model`` on ``features`` of ``store`` into the run folder ``out``; returns a summary.

    ``resume`` continues from ``checkpoint_last.pt`` (an epoch's end, or a mid-epoch position with
    ``--checkpoint-every``): only ``RESUMABLE`` options may differ from the run's (they are applied
    and recorded in ``config.json``); any other differing option is refused. ``overwrite`` replaces
    a run: once the new run's inputs and model are checked, every file of the old run is removed
    (see ``checkpoint``). Started by a launcher (torchrun, srun, ``--nproc-per-node``) the run is
    data-parallel (:mod:`.distributed`); ``collective_timeout`` (s) bounds a wait on a dead rank.
    """
    from .distributed import DEFAULT_TIMEOUT_S, RankFailure, setup

    group = setup(overrides.get("device") or "cpu", collective_timeout or DEFAULT_TIMEOUT_S)
    try:
        return _train(group, store, features, model, out, presets=presets, resume=resume, overwrite=overwrite,
                      progress=progress, log=log, **overrides)
    except RankFailure as exc:
        raise RankFailure(f"{exc}; {resume_advice(Path(out))}") from None
    finally:
        if group.distributed:
            group.close()


def prepare(store, features, model, out: Path, world: int, *, presets=(), resume=False, overwrite=False,
            log: Callable[[str], None] = lambda msg: None, ranks: str | None = None, **overrides):
    """Everything a run checks before it trains: the folder, the options (on resume, against the
    run's), the device, the rank count, the store, the features and the model. The ranks call it, and
    ``vsekit train --nproc-per-node`` calls it once before any rank starts, so a refusal is one line
    (``ranks`` names the rank count's option in it)."""
    out = Path(out)
    overrides.pop("tensorboard", None)
    _start_folder(out, resume, overwrite)
    saved: dict[str, Any] = {}
    changed: dict[str, list] = {}
    if resume:
        try:
            saved = json.loads((out / "config.json").read_text())
        except ValueError as exc:
            raise StoreError(f"{out / 'config.json'} is not valid JSON ({exc})") from None
        cfg, changed = _resume_config(saved, model, presets, dict(overrides))
    else:
        cfg = resolve_config(model, presets, **overrides)
    if str(cfg.device).startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"--device {cfg.device}: CUDA is not available on this machine; "
                         f"{'resume' if resume else 'train'} with --device cpu")
    if cfg.batch_size % world:
        exc = ValueError(f"--batch-size {cfg.batch_size} is not a multiple of {ranks or f'the {world} ranks'}: "
                         f"the global batch is split evenly over the ranks; choose a batch size divisible by "
                         f"{world} or another rank count")
        exc.same_on_every_rank = True   # rank 0 says it; the others exit quietly
        raise exc
    fstore = FeatureStore.open(store)
    tokens = Tokens.from_store(fstore)
    source = open_features(fstore, features, fstore.split_rows(cfg.train_split))
    if resume:
        _check_same_features(saved, features, source)
    train_rows, evalset = training_rows(fstore, source, cfg.train_split, cfg.val_split, log)  # failed rows said
    net, kw = build_model(cfg, source.row_shape, tokens.vocab_size)
    if net.image_input != source.image_input:
        raise ValueError(f"model {cfg.model!r} reads {net.image_input!r} features but {features!r} is a "
                         f"{source.kind!r} set; choose features of kind {net.image_input!r}")
    return cfg, saved, changed, fstore, tokens, source, train_rows, evalset, net, kw


def resume_advice(out: Path) -> str:
    """What to do after a run failed: resume from its checkpoint, or start again when there is none."""
    if (out / "checkpoint_last.pt").is_file():
        return f"{out / 'checkpoint_last.pt'} holds the run: continue with --resume"
    return "no checkpoint was saved yet: start the run again (without --resume)"


def _train(group: Group, store, features, model, out, *, presets, resume, overwrite, progress, log,
           **overrides) -> dict[str, Any]:
    from .checkpoint import clear_run
    from .distributed import device_of

    quiet = not group.main
    log = (lambda msg: None) if (log is None or quiet) else log
    tensorboard = overrides.pop("tensorboard", None)  # a log folder, not a training setting
    out = Path(out)
    start = prepare(store, features, model, out, group.world, presets=presets, resume=resume, overwrite=overwrite,
                    log=log, **overrides)
    cfg, saved, changed, fstore, tokens, source, train_rows, evalset, net, kw = start
    float32 = exact_float32()   # training is float32: IEEE float32 on CUDA too (TF32 off)
    device = torch.device(device_of(group, cfg.device))
    net.to(device)
    stream = PairStream(source, tokens, train_rows, fstore.caption_images(), batch_size=cfg.batch_size,
                        captions=cfg.captions, window_chunks=cfg.window_chunks, seed=cfg.seed,
                        shuffle_memory=cfg.shuffle_memory_gb * 2**30)
    group.barrier("the start")   # every rank has checked its inputs before rank 0 changes the folder
    if group.main:
        if not resume:
            removed = clear_run(out)   # the new run has started: nothing of an old one may remain
            if removed:
                log(f"--overwrite: removed {len(removed)} file(s) of the previous run in {out}")
        out.mkdir(parents=True, exist_ok=True)
        if resume:
            if changed or saved.get("float32") != float32:
                saved["train"] = cfg.to_json()
                saved["float32"] = float32
                if changed:
                    saved.setdefault("resumed", []).append({"changed": changed})
                _write_json(out / "config.json", saved)
            if changed:
                log("resume: " + ", ".join(f"{option_name(k)} {v[0]} -> {v[1]}" for k, v in changed.items()))
        else:
            _write_json(out / "config.json", {
                "train": cfg.to_json(), "store": store_ref(store), "features": features,
                "model_kwargs": _plain(kw), "feature_set": describe_source(source),
                "feature_attrs": _feature_attrs(source),
                "vocab_size": tokens.vocab_size, "float32": float32, "vsekit_version": __version__})
    if group.world > 1:
        log(f"data-parallel over {group.world} ranks ({group.backend}): global batch {cfg.batch_size}, "
            f"{cfg.batch_size // group.world} pairs per rank")

    run = Run(cfg, out, group, net, kw, source, tokens, evalset, stream, device, log, progress)
    handler = active_handling()
    with (handler.polled() if handler is not None else contextlib.nullcontext()):
        # from here a signal stops the run at the next step boundary, with a checkpoint
        return _run(run, group, out, resume, tensorboard, handler, log)


def _run(run: Run, group: Group, out: Path, resume: bool, tensorboard, handler, log) -> dict[str, Any]:
    cfg, stream = run.cfg, run.stream
    if resume:
        run.load(load_checkpoint(out / "checkpoint_last.pt", str(run.device)))
        if group.main:
            _write_log(out, run.state)   # the log of the saved epochs, even if the kill came before its write
        where = (f"epoch {run.position['epoch']} after batch {run.position['batches']}" if run.position
                 else f"after epoch {run.state['epoch']}")
        log(f"resuming {out} {where}")
    else:
        m0 = run.validate()
        run.state["history"].append({"epoch": 0, "phase": run.state["phase"], "loss": None, "lr": None,
                                     "val": m0, "time_s": 0.0})
        run.state["untrained_rsum"] = m0["rsum"]
        if group.main:
            _write_log(out, run.state)

    curves = CurveWriter(tensorboard if group.main else None, run.state["history"])
    first = run.position["epoch"] if run.position else run.state["epoch"] + 1
    try:
        for epoch in range(first, cfg.epochs + 1):
            t0 = time.perf_counter()
            loss, lr = run.epoch(epoch)
            metrics = run.validate()
            run.end_epoch(epoch, loss, lr, metrics, t0, curves)
            pending = handler.pending if handler is not None else None
            if epoch < cfg.epochs and group.any(pending is not None):   # a signal during validation
                raise Stop(pending or signal.SIGTERM, epoch, len(stream))
    except Stop as stop:
        curves.close()
        if handler is not None:
            handler.clear()
        raise Interrupted(f"interrupted in epoch {stop.epoch} after batch {stop.batches}: "
                          f"{out / 'checkpoint_last.pt'} holds it; continue with --resume", stop.signum) from None
    curves.close()
    if group.main:
        plot_curves(run.state["history"], out / "curves.png")
    state = run.state
    return {"out": str(out), "epochs": state["epoch"], "best_epoch": state["best_epoch"],
            "best_rsum": state["best_rsum"], "untrained_rsum": state.get("untrained_rsum"),
            "switched_at": state.get("switched_at"), "model": cfg.model, "ranks": group.world}


def _write_json(path: Path, doc: Any, lines: bool = False) -> None:
    """``doc`` as JSON (``lines``: a list as JSON lines), written whole or not at all."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(json.dumps(x) + "\n" for x in doc) if lines else json.dumps(doc, indent=2))
    tmp.replace(path)


def _write_log(out: Path, state: dict[str, Any]) -> None:
    """Rewrite metrics.jsonl from the history (so a resumed run's log equals an uninterrupted one's)."""
    _write_json(out / "metrics.jsonl", state["history"], lines=True)


def plot_curves(history: list[dict[str, Any]], path: Path) -> None:
    """Training loss and validation rsum per epoch (matplotlib, Agg backend)."""
    import matplotlib
    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    ep = [h["epoch"] for h in history]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(9, 3.2))
    tr = [(h["epoch"], h["loss"]) for h in history if h["loss"] is not None]
    if tr:
        a1.plot(*zip(*tr), marker="o")
    a1.set_xlabel("epoch")
    a1.set_ylabel("training loss")
    a2.plot(ep, [h["val"]["rsum"] for h in history], marker="o", color="tab:green")
    for h in history:
        if h.get("switch"):
            a2.axvline(h["epoch"], color="grey", ls="--", lw=1)
    a2.set_xlabel("epoch")
    a2.set_ylabel("validation rsum")
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
