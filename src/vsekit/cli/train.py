"""``vsekit train`` and ``vsekit evaluate``: thin wrappers over ``vsekit.train.train`` / ``evaluate``."""

from __future__ import annotations

import contextlib
import json
import os
import sys
from pathlib import Path

import click

from ..devices import resolve_device
from ..storage.fserrors import user_error
from ..words import plural
from .options import STORAGE_OPTION, RunPath, StorePath
from .pipeline import key_values


def _model_args(pairs: tuple[str, ...]) -> dict:
    """``--model-arg KEY=VALUE`` items, each value read as JSON where it is JSON (``hops=30``)."""
    out = {}
    for key, value in key_values(pairs, "--model-arg").items():
        try:
            out[key.replace("-", "_")] = json.loads(value)
        except json.JSONDecodeError:
            out[key.replace("-", "_")] = value
    return out


@click.command("train")
@click.option("--store", "store", required=True, type=StorePath(exists=True, url_ok=True),
              help="The store (a path, or s3://... on object storage).")
@STORAGE_OPTION
@click.option("--features", required=True, help="Feature set to train on (global, FNE int8 or packed, grid, regions).")
@click.option("--model", default=None, help="Model name (vse, order, seam-e, seam-c, seam-g, ...); "
              "a paper preset names one.")
@click.option("--out", required=True, type=click.Path(file_okay=False), help="Run folder to write.")
@click.option("--preset", "presets", multiple=True,
              help="Paper settings (docs/train.md): sh mh soe moe ph poe (f30k-*, f8k-*, *-bl) vse++ order++ order0 "
                   "seam-e seam-c seam-g sman saf-coco sgr-coco saf-f30k sgr-f30k *-temde-f30k demo sman-demo sgraf-demo "
                   "(repeatable; later ones win, options win over presets).")
@click.option("--epochs", type=int, default=None, help="Training epochs [default: 30, or the preset's].")
@click.option("--batch-size", type=int, default=None, help="Images per training batch [default: 128, or the preset's].")
@click.option("--embed-dim", type=int, default=None, help="Joint space dimension.")
@click.option("--word-dim", type=int, default=None, help="Word embedding dimension.")
@click.option("--lr", type=float, default=None, help="Learning rate [default: 0.0002, or the preset's].")
@click.option("--lr2", type=float, default=None, help="Learning rate of the curriculum's max-loss phase.")
@click.option("--lr-update", "lr_milestones", type=int, multiple=True,
              help="Multiply the lr by --lr-decay at this epoch (repeatable).")
@click.option("--lr-decay", type=float, default=None, help="Factor of the lr at each --lr-update epoch [default: 0.1].")
@click.option("--margin", type=float, default=None, help="Hinge margin alpha.")
@click.option("--max-violation/--sum-violation", default=None, help="Hardest negative only, or all negatives.")
@click.option("--similarity", type=click.Choice(["cosine", "order", "order-norm"]), default=None,
              help="Similarity of the joint space [default: the model's own].")
@click.option("--abs/--no-abs", "use_abs", default=None, help="|.| of both embeddings (order embeddings).")
@click.option("--captions", type=click.Choice(["one", "all"]), default=None,
              help="One random caption per image per epoch, or every caption.")
@click.option("--curriculum/--no-curriculum", default=None, help="PH/POE: sum loss, then max loss.")
@click.option("--patience", type=int, default=None, help="Epochs without val rsum gain before the switch.")
@click.option("--grad-clip", type=float, default=None, help="Clip the gradient norm to this [default: 2.0].")
@click.option("--model-arg", "model_arg", multiple=True, help="Model argument KEY=VALUE (e.g. hops=30).")
@click.option("--global-module", type=click.Choice(["self-attention", "t-emde", "none"]), default=None,
              help="SAF/SGR global similarity node: self-attention (SGRAF), T-EMDE sketches, or none.")
@click.option("--seed", type=int, default=None, help="Random seed of the initialisation and the shuffle [default: 0].")
@click.option("--shuffle-memory", "shuffle_memory_gb", type=click.FloatRange(min=0, min_open=True), default=None,
              help="GB of memory for the shuffle window: the whole split is shuffled at once when it fits, "
                   "else in windows of chunks [default: 4].")
@click.option("--val-split", type=click.Choice(["train", "val", "test", "restval"]), default=None,
              help="Split whose usable images validate each epoch and pick the best checkpoint [default: val]; "
                   "failed rows are skipped.")
@click.option("--eval-batch", type=click.IntRange(min=1), default=None,
              help="Images per batch of the validation after each epoch [default: 256]; may change on --resume.")
@click.option("--device", default=None, help="auto | cpu | cuda | cuda:N [default: auto; a resume keeps the run's].")
@click.option("--precision", type=click.Choice(["fp32", "bf16"]), default=None,
              help="fp32, or bf16: the forward pass under autocast, the loss and metrics in fp32 [default: fp32].")
@click.option("--checkpoint-every", default=None,
              help="Also checkpoint mid-epoch: every N steps (500) or minutes (20m); --resume continues from "
                   "the step it saved [default: at each epoch's end only].")
@click.option("--nproc-per-node", type=click.IntRange(min=0), default=None,
              help="Data-parallel on this node: start N ranks (one per GPU, or N CPU ranks) through torch's "
                   "elastic launcher; --batch-size stays the global batch (docs/train.md). 0: one process.")
@click.option("--max-restarts", type=click.IntRange(min=0), default=0, show_default=True,
              help="With --nproc-per-node: restart the ranks from the last checkpoint this many times when one dies.")
@click.option("--collective-timeout", type=click.FloatRange(min=1), default=None,
              help="Data-parallel: seconds a rank waits on the others before it reports a dead rank [default: 600].")
@click.option("--resume", is_flag=True, help="Continue the run in --out from its last checkpoint.")
@click.option("--overwrite", is_flag=True, help="Start again in an --out that holds a run.")
@click.option("--progress/--no-progress", default=True, show_default=False, help="Show a progress bar.")
@click.option("--tensorboard", default=None, type=click.Path(file_okay=False),
              help="Also write the training curves as TensorBoard events to this folder (needs tensorboard).")
@click.pass_context
def train_cmd(ctx, store, features, model, out, presets, model_arg, resume, overwrite, progress, lr_milestones,
              global_module, nproc_per_node, max_restarts, collective_timeout, **opts):
    """Train a retrieval model on a store's feature set; writes checkpoints, metrics.jsonl, curves.png."""
    if model and not resume:   # before torch is imported: a misspelt name is refused at once
        from ..suggest import BACKBONES, RETRIEVAL_MODELS, unknown_model

        if model not in RETRIEVAL_MODELS:   # one `Error:` line, as extract's (no usage block)
            raise ValueError(unknown_model(model, RETRIEVAL_MODELS,
                                           other=("a backbone of `vsekit extract --model`", BACKBONES)))
    from ..train import train
    from ..train.distributed import RankFailure, launch_env
    from ..train.trainer import check_model_args, prepare

    env = launch_env()
    if env is not None:
        _take_rank_options()
    if env is not None and int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0) > 0 \
            and (Path(out) / "checkpoint_last.pt").is_file():
        resume, overwrite = True, False    # a restarted group continues from the last checkpoint

    if opts.get("device") is not None or not resume:
        opts["device"] = resolve_device(opts.get("device"))  # recorded resolved in config.json
    margs = _model_args(model_arg)
    if global_module is not None:
        margs["global_module"] = global_module
    if not resume:
        from ..train.config import PRESETS

        name = model or next((PRESETS[p]["model"] for p in reversed(presets) if PRESETS.get(p, {}).get("model")), None)
        if margs and name:
            check_model_args(name, list(margs))
        _check_feature_shape(store, features, name)
    if max_restarts and not (nproc_per_node and env is None):
        raise click.ClickException("--max-restarts restarts the ranks that --nproc-per-node starts; give "
                               "--nproc-per-node N, or drop --max-restarts")
    settings = dict(model_args=margs or None, lr_milestones=list(lr_milestones) or None, **opts)
    if nproc_per_node and env is None:
        # every refusal the ranks would make before training, made once, before any rank starts
        prepare(store, features, model, out, nproc_per_node, presets=presets, resume=resume, overwrite=overwrite,
                ranks=f"--nproc-per-node {nproc_per_node}", **settings)
        return _launch(ctx, nproc_per_node, max_restarts)
    try:
        summary = train(store, features, model, out, presets=presets, resume=resume, overwrite=overwrite,
                        progress=progress, log=click.echo, collective_timeout=collective_timeout, **settings)
    except RankFailure as exc:
        raise click.ClickException(str(exc)) from None
    except Exception as exc:
        if env is None:
            raise
        if env.rank > 0 and getattr(exc, "same_on_every_rank", False):
            raise SystemExit(1) from None   # rank 0 says it once
        message = user_error(exc, store)
        if message is None:
            raise
        raise click.ClickException(f"rank {env.rank}: {message}") from None
    if env is not None and env.rank > 0:
        return
    click.echo(f"trained {summary['model']} for {plural(summary['epochs'], 'epoch')}: best val rsum "
               f"{summary['best_rsum']:.1f} at epoch {summary['best_epoch']} "
               f"(untrained {summary['untrained_rsum'] or float('nan'):.1f}); run in {summary['out']}")


#: how ``--nproc-per-node`` hands this command's ``--storage-option`` values to its ranks: in their
#: environment (JSON), never on their command line (which ``ps`` shows), in a log or on disk; each rank
#: takes them out of its environment at once (:func:`_take_rank_options`)
RANK_OPTIONS_ENV = "VSEKIT_RANK_STORAGE_OPTIONS"


def _take_rank_options() -> None:
    """In a rank: the launcher's ``--storage-option`` values, removed from the environment (so nothing
    this rank starts inherits them) and added to the process's storage options."""
    from ..storage.objstore import DEFAULT_OPTIONS

    raw = os.environ.pop(RANK_OPTIONS_ENV, None)
    if raw:
        DEFAULT_OPTIONS.update({str(k): str(v) for k, v in json.loads(raw).items()})


def _argv(ctx: click.Context, drop=("nproc_per_node", "max_restarts", "storage_option")) -> list[str]:
    """The command line of this ``vsekit train`` (the options given, written as a pipeline stage's), without
    the launcher's own and without ``--storage-option`` (its values reach the ranks through
    :data:`RANK_OPTIONS_ENV`)."""
    from click.core import ParameterSource

    from ..pipeline.commands import build_argv, params_of

    keys = {p.param.name: p.key for p in params_of(ctx.command).values() if not p.invert}
    given = {keys[name]: value for name, value in ctx.params.items() if name not in drop and
             ctx.get_parameter_source(name) not in (ParameterSource.DEFAULT, ParameterSource.DEFAULT_MAP, None)}
    return build_argv("train", ctx.command, given)


#: the run's log of its ranks under ``--nproc-per-node``: their stderr (torch's, gloo's and NCCL's own
#: logging, tracebacks, each rank's Error line) and the launcher's, kept out of the terminal
RANKS_LOG = "ranks.log"


def _launch(ctx: click.Context, nproc: int, max_restarts: int) -> None:
    """Start ``nproc`` ranks of this command through ``torch.distributed.run`` (standalone: one node).

    The ranks' stdout (rank 0's progress and log) stays on the terminal; their stderr and the
    launcher's go to the run's :data:`RANKS_LOG`. A failure is said once, here: a rank's own Error line
    (it names the rank), or which rank died; an interrupted group's message and exit code 130 / 143.
    """
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    from ..storage.objstore import DEFAULT_OPTIONS
    from ..train.trainer import resume_advice

    out = Path(ctx.params["out"])
    out.mkdir(parents=True, exist_ok=True)
    log = out / RANKS_LOG
    argv = ["--standalone", f"--nproc-per-node={nproc}", f"--max-restarts={max_restarts}",
            "--module", "vsekit.cli", *_argv(ctx)]
    if DEFAULT_OPTIONS:
        os.environ[RANK_OPTIONS_ENV] = json.dumps(DEFAULT_OPTIONS)
    failed: ChildFailedError | None = None
    code = 0
    try:
        with _stderr_to(log):
            try:
                run(get_args_parser().parse_args(argv))
            except ChildFailedError as exc:
                failed = exc
            except SignalException as exc:
                code = 128 + int(exc.sigval)
    finally:
        os.environ.pop(RANK_OPTIONS_ENV, None)
    lines = log.read_text(errors="replace").splitlines()
    if failed is None and not code:
        return
    if failed is not None:
        rank, failure = failed.get_first_failure()
        code = failure.exitcode
    # interrupted (the launcher forwards a signal): the ranks saved and said where; else a rank's Error line
    interrupted = failed is None or code in (130, 143)
    said = next((x for x in lines if x.startswith("interrupted" if interrupted else "Error: ")), None)
    if interrupted or (code in (1, 2) and said is not None):
        click.echo(said or "interrupted", err=True)
        raise SystemExit(code)
    what = f"died (signal {-code})" if code < 0 else f"exited with code {code}"
    restarts = f" after {max_restarts} restart(s)" if max_restarts else ""
    raise click.ClickException(f"rank {rank} {what}{restarts}; the other ranks were stopped (their output: "
                               f"{log}); {resume_advice(out)}")


@contextlib.contextmanager
def _stderr_to(path):
    """This process's stderr (file descriptor 2, which the ranks inherit) written to ``path`` meanwhile."""
    sys.stderr.flush()
    saved, fd = os.dup(2), os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND, 0o644)
    os.dup2(fd, 2)
    os.close(fd)
    try:
        yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)


#: models that read a spatial feature set (a grid or regions), not one vector per image
SPATIAL_MODELS = {"sman": "a grid set (`vsekit extract --kind grid`, rows G x G x C)",
                  "saf": "a regions or grid set (`vsekit extract --kind regions|grid`, `ingest butd`)",
                  "sgr": "a regions or grid set (`vsekit extract --kind regions|grid`, `ingest butd`)"}


def _check_feature_shape(store: str, features: str, name: str | None) -> None:
    """Refuse a vector feature set (global, FNE) for the model ``name`` if it reads a grid or regions."""
    from ..storage.store import FeatureStore

    if name not in SPATIAL_MODELS:
        return
    st = FeatureStore.open(store)
    if not st.has_features(features):
        return   # the trainer names the missing set and the ones there are
    fs = st.features(features)
    if len(fs.shape) == 2:
        kind = fs.attrs.get("kind") or "vectors"
        spatial = [n for n in st.feature_names() if len(st.features(n).shape) > 2]
        have = f"; this store has: {', '.join(spatial)}" if spatial else ""
        raise click.UsageError(f"--model {name} reads {SPATIAL_MODELS[name]}; --features {features} holds one "
                               f"vector of {fs.shape[1]} per image (kind {kind}): pass a grid or regions set "
                               f"as --features{have}")


@click.command("evaluate")
@click.argument("runs", nargs=-1, type=RunPath())
@click.option("--sims", default=None, type=click.Path(exists=True, dir_okay=False),
              help="Score this (images x captions) .npy of --split made elsewhere, instead of RUNS (needs --store).")
@click.option("--protocol", "protocols", multiple=True, type=click.Choice(["coco-1k", "coco-5k", "1k", "all"]),
              help="Evaluation protocol (repeatable): coco-1k (5 folds of 1000 of COCO's 5000 test "
                   "images), coco-5k, 1k (a 1000-image split, as Flickr30K's), all (every image of the "
                   "split, whatever its size). Default: coco-1k and coco-5k on a 5000-image COCO test "
                   "split, 1k on a 1000-image split, else all.")
@click.option("--split", default="test", show_default=True, type=click.Choice(["train", "val", "test", "restval"]),
              help="Split to evaluate on.")
@click.option("--store", "store", default=None, type=StorePath(exists=True, url_ok=True),
              help="Evaluate on this store instead of the run's.")
@STORAGE_OPTION
@click.option("--features", default=None, help="Feature set instead of the run's.")
@click.option("--checkpoint", type=click.Choice(["best", "last"]), default="best", show_default=True,
              help="Checkpoint of the run: the best validation rsum, or the last epoch.")
@click.option("--device", default="auto", show_default=True, help="auto | cpu | cuda | cuda:N.")
@click.option("--batch-size", default=256, show_default=True, type=click.IntRange(min=1),
              help="Images or captions encoded per batch.")
@click.option("--save-sims/--no-save-sims", default=None,
              help="Write sims_<split>.npy (default: only when small).")
@click.option("--out", default=None, type=click.Path(file_okay=False),
              help="Folder for metrics.json (default: the run; metrics_ensemble.json for several runs).")
@click.option("--progress/--no-progress", default=True, show_default=False, help="Show a progress bar.")
def evaluate_cmd(runs, sims, protocols, split, store, features, checkpoint, device, batch_size, save_sims, out,
                 progress):
    """Evaluate one run, or the average similarity of several (SAF + SGR = SGRAF), and print the table."""
    from ..train import evaluate

    device = resolve_device(device)
    if sims or not runs:
        from ..train.external import evaluate_sims

        if runs or not sims or not store:
            raise click.UsageError("give RUN folders, or --sims FILE.npy with --store (not both)")
        result = evaluate_sims(sims, store, split=split, protocols=protocols or None,
                               out=out and f"{out}/metrics.json", progress=progress)
    else:
        result = evaluate(runs, protocols=protocols or None, split=split, store=store, features=features,
                          device=device, batch_size=batch_size, save=save_sims, out=out, progress=progress,
                          checkpoint=checkpoint)
    for warning in result.get("warnings", ()):
        click.echo(f"warning: {warning}", err=True)
    click.echo(result["table"])
    click.echo(f"wrote {result['metrics_path']}")


COMMANDS = (train_cmd, evaluate_cmd)
