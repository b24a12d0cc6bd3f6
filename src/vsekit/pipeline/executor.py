"""Run a pipeline: fingerprint each stage, skip what is up to date, run the rest.

Each stage that runs is its command's function called in-process with the stage's typed values
(:func:`.commands.call_stage`): no command line is built or parsed again, and ``--cluster`` arrives
parsed. A fingerprint chains the previous stage's, so a changed stage reruns every stage after it;
a *running* record written before a stage runs makes an interrupted rerun resume rather than start
over. The rules (fingerprint, skip, ``--overwrite``, resume) are docs/pipelines.md, "Up to date,
reruns and resume".
"""

from __future__ import annotations

import copy
import datetime as _dt
import hashlib
import json
import os
import shlex
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence

import click
import yaml

from ..suggest import did_you_mean
from ..version import __version__
from ..words import plural
from .commands import call_stage, has_option, norm, params_of, resolve_command
from .outputs import store_there
from .resolve import ResolvedStage, check_file, resolve_pipeline
from .spec import Located, PipelineError, PipelineFile, PipelineSpec, load_file, merge_files, variables_of
from .summary import metrics_table

if TYPE_CHECKING:
    from ..clusters import ClusterSpec


def fingerprint(stage: ResolvedStage, previous: str) -> str:
    files = {}
    for f in stage.external_files:
        if not os.path.isfile(f):  # folders change whenever something is added to them
            continue
        try:
            st = os.stat(f)
            files[f] = [st.st_size, st.st_mtime_ns]
        except OSError:
            files[f] = None
    blob = json.dumps({"command": stage.spec.command, "values": stage.fingerprint_values(),
                       "files": files, "previous": previous, "vsekit": __version__},
                      sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:20]


@dataclass
class Step:
    """The plan for one stage."""

    stage: ResolvedStage
    action: str          # "run" or "skip"
    reason: str
    fingerprint: str
    overwrite: bool = False
    resume: bool = False

    def extra(self) -> dict[str, bool]:
        """The options the plan adds to the stage's own (option names as on the command line)."""
        extra = {"overwrite": True} if self.overwrite else {}
        if self.overwrite and has_option(self.stage.command, "drop-features"):
            extra["drop-features"] = True   # a re-ingest: the stages after it remake its feature sets
        if self.resume:
            extra["resume"] = True
        return extra

    def command_line(self) -> str:
        """The stage's command line as printed and recorded: no secret of a --storage-option in it."""
        from ..storage.objstore import shown_argv

        return "vsekit " + " ".join(shlex.quote(a) for a in shown_argv(self.stage.argv(self.extra())))


@dataclass
class RunResult:
    pipeline: str
    steps: list[Step]
    ran: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    seconds: float = 0.0


def _find_stage(stages: list[ResolvedStage], ref: str) -> int:
    for i, s in enumerate(stages):
        if s.id == ref:
            return i
    by_cmd = [i for i, s in enumerate(stages) if s.spec.command == ref or s.spec.command.split()[0] == ref]
    if len(by_cmd) == 1:
        return by_cmd[0]
    if ref.isdigit() and 1 <= int(ref) <= len(stages):
        return int(ref) - 1
    ids = ", ".join(s.id for s in stages)
    if len(by_cmd) > 1:
        raise PipelineError(f"--from {ref!r} matches {len(by_cmd)} stages; name one by id: {ids}")
    raise PipelineError(f"--from {ref!r}: no such stage; valid: {ids} (or a 1-based number)")


def plan(stages: list[ResolvedStage], pipeline: str, *, from_stage: str | None = None,
         force: bool = False) -> list[Step]:
    """Decide for every stage whether it runs and why (reads outputs, changes nothing)."""
    start = _find_stage(stages, from_stage) if from_stage else None
    steps: list[Step] = []
    previous = ""
    cascade: str | None = None
    for i, stage in enumerate(stages):
        fp = fingerprint(stage, previous)
        previous = fp
        outputs = stage.io.outputs
        exists = bool(outputs) and all(o.exists() for o in outputs)
        any_output = any(o.exists() or getattr(o, "incomplete", lambda: False)() for o in outputs)
        records = [o.read(record_key(pipeline, stage)) for o in outputs] if any_output else []
        recorded = bool(records) and all(r is not None for r in records)
        same = recorded and all(r.get("fingerprint") == fp for r in records)
        running = recorded and any(r.get("state") == RUNNING for r in records)
        stale = False
        if start is not None and i < start:
            steps.append(Step(stage, "skip", f"before --from {from_stage}", fp))
            continue
        if force:
            action, reason, stale = "run", "--force", True
        elif start is not None:
            action, reason, stale = "run", f"--from {from_stage}", True
        elif not outputs:
            action, reason = "run", "makes no recorded output, so it always runs"
        elif not any_output:
            action, reason = "run", "its output does not exist yet"
        elif cascade:
            action, reason, stale = "run", f"an earlier stage ({cascade}) runs", True
        elif recorded and not same:
            action, reason, stale = "run", "its options or inputs changed", True
        elif running and any(r.get("overwrite") for r in records):
            # the stage's own overwrite removes this record with the old output: it never got that far
            action, reason, stale = "run", "it was interrupted before it replaced its old output", True
        elif running:
            action, reason = "run", "it was interrupted with these options: resuming"
            stale = not stage.io.resumable
        elif not exists:
            action, reason = "run", "its output is incomplete: resuming"
        elif not recorded:
            action, reason = "run", "its output exists but this stage has no record of making it: resuming"
            stale = not stage.io.resumable
        else:
            action, reason = "skip", "up to date"
        overwrite = (action == "run" and stale and any_output and has_option(stage.command, "overwrite")
                     and not stage.values.get("overwrite"))
        resume = (action == "run" and not stale and bool(stage.io.resume_file)
                  and has_option(stage.command, "resume") and not stage.values.get("resume")
                  and any(os.path.isfile(os.path.join(getattr(o, "path", ""), stage.io.resume_file))
                          for o in outputs))
        steps.append(Step(stage, action, reason, fp, overwrite, resume))
        if action == "run" and outputs:
            cascade = cascade or stage.id
    return steps


RUNNING = "running"


def record_key(pipeline: str, stage: ResolvedStage) -> str:
    """Records are kept per pipeline and stage, so two pipelines never take each other's for theirs."""
    return f"{pipeline}/{stage.id}"


def _record(step: Step, pipeline: str, running: bool = False) -> dict[str, Any]:
    """A stage's record; the running one, written before it runs, tells a later plan that these options
    were started and not finished (and whether ``--overwrite`` was passed)."""
    when = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
    record = {"fingerprint": step.fingerprint, "pipeline": pipeline, "stage": step.stage.id,
              "command": step.command_line(), "vsekit": __version__}
    if running:
        return {**record, "state": RUNNING, "overwrite": step.overwrite, "started": when}
    return {**record, "finished": when}


def run_pipeline(pipeline: PipelineSpec, cli: click.Group, *, sets: Mapping[str, str] | None = None,
                 env: Mapping[str, str] | None = None, from_stage: str | None = None, force: bool = False,
                 dry_run: bool = False, cluster: "ClusterSpec | str | None" = None,
                 cluster_settings: Mapping[str, Any] | None = None,
                 echo: Callable[[str], None] = click.echo) -> RunResult:
    """Validate ``pipeline`` completely, then run (or, with ``dry_run``, print) its plan.

    ``cluster`` (parsed once by the caller) replaces every stage's ``--cluster``; a stage's own is
    parsed with ``cluster_settings`` (default: the pipeline's ``cluster:`` section)."""
    t0 = time.perf_counter()
    if cluster_settings is None:
        cluster_settings = pipeline.cluster
    stages = resolve_pipeline(pipeline, cli, sets=sets, env=env, cluster=cluster,
                              cluster_settings=cluster_settings)
    steps = plan(stages, pipeline.name, from_stage=from_stage, force=force)
    result = RunResult(pipeline.name, steps)
    n = len(steps)
    if dry_run:
        check_protocols([s.stage for s in steps if s.action == "run"], set(), echo)
        echo(f"pipeline {pipeline.name}: {sum(s.action == 'run' for s in steps)} of {plural(n, 'stage')} would run")
        for k, step in enumerate(steps, start=1):
            echo(f"  [{k}/{n}] {step.action:<4} {step.stage.id}: {step.reason}")
            echo(f"        {step.command_line()}")
        result.seconds = time.perf_counter() - t0
        return result
    previous = ""
    checked: set[str] = set()
    for k, step in enumerate(steps, start=1):
        # the evaluations' protocols against the test splits as soon as their stores exist (before
        # anything runs when they already do; else right after the ingest that makes them)
        check_protocols([s.stage for s in steps[k - 1:] if s.action == "run"], checked, echo)
        # the inputs' files may have just been written by an earlier stage: fingerprint them now
        step.fingerprint = previous = fingerprint(step.stage, previous)
        if step.action == "skip":
            echo(f"skip {step.stage.id}: {step.reason}")
            result.skipped.append(step.stage.id)
            continue
        echo(f"[{k}/{n}] {step.stage.id}: {step.reason}")
        echo(f"  {step.command_line()}")
        t_stage = time.perf_counter()
        for out in step.stage.io.outputs:   # an output that does not exist yet takes no record
            out.write(record_key(pipeline.name, step.stage), _record(step, pipeline.name, running=True))
        _invoke(cli, step, pipeline.name)
        for out in step.stage.io.outputs:
            out.write(record_key(pipeline.name, step.stage), _record(step, pipeline.name))
        result.ran.append(step.stage.id)
        echo(f"[{k}/{n}] {step.stage.id}: done in {_elapsed(time.perf_counter() - t_stage)} "
             f"({_elapsed(time.perf_counter() - t0)} since the start)")
    result.seconds = time.perf_counter() - t0
    return result


def _elapsed(seconds: float) -> str:
    if seconds < 60:
        return f"{seconds:.1f} s"
    m, s = divmod(int(round(seconds)), 60)
    return f"{m} min {s:02d} s" if m < 60 else f"{m // 60} h {m % 60:02d} min"


def check_protocols(stages: list[ResolvedStage], checked: set[str], echo: Callable[[str], None]) -> None:
    """Refuse an evaluate stage whose ``--protocol`` cannot run on its store's split (coco-1k needs 5
    images), and warn when a protocol is defined on another split size, once the store exists."""
    for stage in stages:
        if stage.spec.command != "evaluate" or stage.id in checked:
            continue
        protocols = [p for p in (stage.values.get("protocol") or ()) if p != "all"]
        store = stage.values.get("store")
        if not protocols or not store or not store_there(store):
            continue
        checked.add(stage.id)
        from ..storage.store import FeatureStore

        split = stage.values.get("split") or "test"
        try:
            n_images = len(FeatureStore.open(str(store), mode="r").split_rows(split))
        except Exception:   # noqa: BLE001 - an unreadable store is the stage's own error to report
            continue
        fix = (f"remove `protocol:` from the stage (evaluate then picks the protocols that fit the split), "
               f"or run with `--stage-option {stage.id}.protocol=all`")
        if "coco-1k" in protocols and n_images < 5:
            raise PipelineError(f"{stage.spec.label}: --protocol coco-1k needs at least 5 {split} images, "
                                f"the {split} split of {store} has {n_images}; {fix}")
        from ..train.evaluate_run import protocol_warnings

        for warning in protocol_warnings(protocols, n_images, split):   # evaluate's own words
            echo(f"warning: {stage.spec.label}: {warning}; or {fix}")


def _invoke(cli: click.Group, step: Step, pipeline: str) -> None:
    """Run one stage in-process: its command's function called with the stage's typed values (the
    cluster already parsed); a failure names the stage and the resume command."""
    from ..interrupts import Interrupted
    from ..storage.fserrors import user_error

    values = {**step.stage.values, **step.extra()}   # canonical keys: the option names, "-" as on the command line
    try:
        call_stage(step.stage.command, step.stage.spec.command, values)
    except click.exceptions.Exit as exc:
        if exc.exit_code not in (0, None):
            raise PipelineError(f"pipeline {pipeline!r}, {step.stage.spec.label} exited with code "
                                f"{exc.exit_code}") from None
    except Interrupted:   # SIGINT / SIGTERM: the command's own exit (130 / 143) and what was kept
        raise
    except (click.exceptions.Abort, KeyboardInterrupt):
        raise PipelineError(f"pipeline {pipeline!r}, {step.stage.spec.label}: aborted; rerun "
                            f"`vsekit run {pipeline}` to resume") from None
    except click.ClickException as exc:
        raise _failed(step, pipeline, exc.format_message()) from None
    except Exception as exc:   # the library's refusals, as the CLI words them (vsekit.cli.VsekitGroup)
        message = user_error(exc, step.stage.values.get("store"))
        if message is None:
            raise
        raise _failed(step, pipeline, message) from exc


def _failed(step: Step, pipeline: str, message: str) -> PipelineError:
    example = (f" (e.g. --stage-option {step.stage.id}.weights=none for `--weights none`)"
               if has_option(step.stage.command, "weights") else "")
    return PipelineError(f"pipeline {pipeline!r}, {step.stage.spec.label} failed: "
                         f"{message}\n  command: {step.command_line()}\n  "
                         f"an option of this stage is set from the command line with `vsekit run {pipeline} "
                         f"--stage-option {step.stage.id}.OPTION=VALUE`{example}, a ${{VARIABLE}} with "
                         f"`--set NAME=VALUE`\n  fix it and rerun `vsekit run {pipeline}`: finished stages "
                         f"are skipped and this one resumes")


def list_pipelines(pf: PipelineFile) -> str:
    files = [pf.path] if not pf.shipped or pf.shipped == pf.path else [pf.shipped, pf.path]
    lines = [f"pipelines in {' and '.join(files)}:"]
    width = max((len(n) for n in pf.pipelines), default=0)
    for name, p in pf.pipelines.items():
        # always marked, whether or not a file of yours exists (docs/pipelines.md)
        mark = "  [yours, shadows the shipped one]" if name in pf.shadowed else (
            "  [shipped]" if pf.shipped and p.file == pf.shipped else "  [yours]")
        lines.append(f"  {name:<{width}}  {len(p.stages):>2} {'stage ' if len(p.stages) == 1 else 'stages'}  "
                     f"{p.description}{mark}")
    return "\n".join(lines)


#: the shipped recipes, package data of the wheel, kept identical to the repository's ``pipelines.yaml``
#: by a test, so ``vsekit run --list`` works from an installed wheel as from a checkout
PACKAGED = Path(__file__).resolve().parents[1] / "data" / "pipelines.yaml"


def user_file(file: str | None = None) -> str | None:
    """The user's pipelines file: ``--file``, else ``./pipelines.yaml``, else ``$VSEKIT_PIPELINES``
    (a documented input, read here only)."""
    if file:
        return file
    if Path("pipelines.yaml").is_file():
        return "pipelines.yaml"
    return os.environ.get("VSEKIT_PIPELINES") or None


def load_pipelines(file: str | None = None) -> PipelineFile:
    """The shipped recipes plus the user's file (``--file``, ``./pipelines.yaml`` or ``$VSEKIT_PIPELINES``):
    the user's pipelines are added; one with a shipped recipe's name replaces (shadows) it."""
    user = user_file(file)
    shipped_path = PACKAGED if PACKAGED.is_file() else Path(__file__).resolve().parents[3] / "pipelines.yaml"
    if not shipped_path.is_file():   # pragma: no cover - a broken install
        return load_file(user or "pipelines.yaml")
    shipped = load_file(shipped_path)
    if user is None:
        return merge_files(shipped, None)
    if Path(user).is_file() and Path(user).resolve() != shipped_path.resolve() \
            and Path(user).read_bytes() == shipped_path.read_bytes():   # a checkout's own copy
        return merge_files(load_file(user), None)
    return merge_files(shipped, load_file(user))


def check_sets(pipeline: PipelineSpec, sets: Mapping[str, str]) -> None:
    """Refuse a ``--set NAME`` that the pipeline neither declares nor uses (a typo would be ignored)."""
    known = variables_of(pipeline) | {"DEVICE"}   # `vsekit run --device` sets it
    for name in sets:
        if name not in known:
            hint = did_you_mean(name, known)
            raise PipelineError(f"--set {name}: pipeline {pipeline.name!r} has no variable ${{{name}}}"
                                f"{'; ' + hint if hint else ''} (its variables: {', '.join(sorted(known))})")


def apply_stage_options(pipeline: PipelineSpec, options: Sequence[str], cli: click.Group) -> PipelineSpec:
    """``--stage-option STAGE.OPTION=VALUE``: set an option of the stages named STAGE (a stage id, or
    a command such as ``extract`` or ``ingest-karpathy`` for all its stages; ``*`` for every stage that
    has the option); VALUE is read as YAML (``none``, ``5``, ``[a, b]``). The option itself is checked
    against the stage's command like one written in the file."""
    if not options:
        return pipeline
    pipeline = copy.deepcopy(pipeline)
    for item in options:
        target, sep, rest = item.partition(".")
        key, eq, raw = rest.partition("=")
        if not sep or not eq or not target or not key.strip():
            raise PipelineError(f"--stage-option {item!r}: expected STAGE.OPTION=VALUE "
                                f"(e.g. extract.weights=none)")
        key = key.strip()
        try:
            value = yaml.safe_load(raw) if raw.strip() else ""
        except yaml.YAMLError:
            value = raw
        if isinstance(value, str) or value is None:
            value = raw   # `none` stays the word none, not YAML's null
        if target == "*":
            matched = [s for s in pipeline.stages if norm(key) in _params_of_stage(s, cli)]
        else:
            matched = [s for s in pipeline.stages
                       if target in (s.id, s.command, s.command.replace(" ", "-"), s.command.split()[0])]
        if not matched:
            names = sorted({s.id for s in pipeline.stages} | {s.command.split()[0] for s in pipeline.stages})
            hint = did_you_mean(target, names)
            raise PipelineError(f"--stage-option {item!r}: pipeline {pipeline.name!r} has no stage {target!r}"
                                f"{'; ' + hint if hint else ''} (stages: {', '.join(s.id for s in pipeline.stages)})")
        for stage in matched:
            loc = Located([Located(v, stage.line) for v in value] if isinstance(value, list) else value,
                          stage.line)
            stage.values = {k: v for k, v in stage.values.items() if norm(k) != norm(key)}
            stage.values[key] = loc
            stage.key_lines[key] = stage.line
    return pipeline


def _params_of_stage(stage, cli: click.Group) -> dict:
    try:
        return params_of(resolve_command(cli, stage.command))
    except ValueError:
        return {}


def run(name: str, *, cli: click.Group, file: str | None = None, sets: Mapping[str, str] | None = None,
        from_stage: str | None = None, force: bool = False, dry_run: bool = False,
        cluster: "ClusterSpec | str | None" = None, cluster_settings: Mapping[str, Any] | None = None,
        env: Mapping[str, str] | None = None,
        echo: Callable[[str], None] = click.echo, stage_options: Sequence[str] = ()) -> RunResult:
    """``vsekit run NAME``: check the whole file, run the pipeline, print the metrics table.

    ``cli`` is the Click group whose commands the stages name (``vsekit.cli.main``); it is passed in,
    so this package never imports the CLI that imports it.
    """
    pf = load_pipelines(file)
    pipeline = pf.get(name)
    check_sets(pipeline, sets or {})
    pipeline = apply_stage_options(pipeline, stage_options, cli)
    # every pipeline of the file it comes from (the shipped recipes are checked when one is run)
    mine = {n: p for n, p in pf.pipelines.items() if p.file == pipeline.file}
    check_file({**mine, name: pipeline}, cli, sets=sets, env=env)
    result = run_pipeline(pipeline, cli, sets=sets, env=env, from_stage=from_stage, force=force,
                          dry_run=dry_run, cluster=cluster, cluster_settings=cluster_settings, echo=echo)
    if not dry_run:
        runs = []
        for step in result.steps:
            if step.stage.spec.command.split()[0] == "evaluate":
                for out in step.stage.io.outputs:
                    target = out._target() if hasattr(out, "_target") else None
                    if target is not None and target.is_file():
                        runs.append((step.stage.id, target))
        table = metrics_table(runs)
        if table:
            echo("")
            echo(table)
        echo(f"pipeline {name}: {plural(len(result.ran), 'stage')} ran, {len(result.skipped)} skipped "
             f"in {result.seconds:.1f} s")
    return result
