"""Validate a pipeline against the real CLI and resolve every stage to a command line.

Everything is checked before anything runs: the stage's command exists, every option and argument
is one that command has, each value converts with the command's own Click type (choices, numbers,
flags, ``multiple``/``nargs``), required parameters are given, every ``${VAR}`` is set, and every
``--features NAME`` is a feature set that an earlier stage makes. Errors name the file, the line,
the pipeline and the stage.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Mapping

import click

from .commands import Param, build_argv, convert_value, norm, option_default, params_of, resolve_command
from .outputs import StageIO, stage_io
from .spec import Located, MissingVariable, PipelineError, PipelineSpec, StageSpec, Variables

if TYPE_CHECKING:
    from ..clusters import ClusterSpec

#: options that say where or how fast a stage runs, not what it makes: not part of the fingerprint
NOT_FINGERPRINTED = frozenset({"cluster", "workers", "device", "pin-memory", "channels-last", "prefetch", "progress",
                               "no-progress", "quiet", "verbose",
                               "storage-option"})   # credentials: never recorded, and where the store is stays --store


@dataclass
class ResolvedStage:
    spec: StageSpec
    command: click.Command
    values: dict[str, Any]          # canonical key -> converted value (None: unset)
    io: StageIO
    external_files: list[str] = field(default_factory=list)   # input files given by path

    @property
    def id(self) -> str:
        return self.spec.id

    def argv(self, extra: Mapping[str, Any] | None = None) -> list[str]:
        return build_argv(self.spec.command, self.command, {**self.values, **(extra or {})})

    def fingerprint_values(self) -> dict[str, Any]:
        return {k: v for k, v in sorted(self.values.items()) if v is not None and k not in NOT_FINGERPRINTED}


class _Err:
    def __init__(self, pipeline: PipelineSpec, stage: StageSpec | None = None):
        self.pipeline, self.stage = pipeline, stage

    def __call__(self, line: int, message: str) -> PipelineError:
        where = f"{self.pipeline.file}, line {line}: pipeline {self.pipeline.name!r}"
        if self.stage is not None:
            where += f", {self.stage.label}"
        return PipelineError(f"{where}: {message}")


def _substitute(loc: Located, variables: Variables, err: _Err, tolerate_missing: bool) -> Any:
    """Plain value with ${VAR} expanded; missing variables raise (or become ``<VAR>`` placeholders)."""
    v = loc.value
    if isinstance(v, list):
        return [_substitute(x, variables, err, tolerate_missing) for x in v]
    if isinstance(v, dict):
        return {k: _substitute(x, variables, err, tolerate_missing) for k, x in v.items()}
    if isinstance(v, str):
        try:
            return variables.substitute(v)
        except MissingVariable as exc:
            if tolerate_missing:
                return _Placeholder(v)
            raise err(loc.line, f"variable ${{{exc.name}}} is not set; set it in the environment, "
                                f"with `--set {exc.name}=VALUE`, or under `variables:`") from None
    return v


class _Placeholder(str):
    """A string whose variables are not set (only while checking pipelines other than the one run)."""


def _has_placeholder(value: Any) -> bool:
    if isinstance(value, list):
        return any(_has_placeholder(v) for v in value)
    return isinstance(value, _Placeholder)


def resolve_pipeline(pipeline: PipelineSpec, cli: click.Group, *, sets: Mapping[str, str] | None = None,
                     env: Mapping[str, str] | None = None, cluster: "ClusterSpec | str | None" = None,
                     cluster_settings: Mapping[str, Any] | None = None,
                     tolerate_missing: bool = False) -> list[ResolvedStage]:
    """Check ``pipeline`` completely and return its stages ready to run (raises PipelineError).

    ``cluster`` (``vsekit run --cluster``, parsed once by the caller) replaces every stage's; a
    stage's own ``cluster:`` text is parsed here, once, with ``cluster_settings`` (the pipeline's
    ``cluster:`` section), so each stage receives a :class:`~vsekit.clusters.ClusterSpec`."""
    from ..clusters import parse_cluster

    cluster_settings = dict(cluster_settings) if cluster_settings else None   # none: $VSEKIT_CLUSTER_CONFIG
    if isinstance(cluster, str):
        cluster = parse_cluster(cluster, cluster_settings)
    variables = Variables(pipeline.variables, sets or {}, env)
    stages: list[ResolvedStage] = []
    made: dict[tuple[str, str], str] = {}   # (store, name) -> stage label that makes it
    used_defaults: set[str] = set()
    top = click.Context(cli, info_name="vsekit")
    for key, loc in pipeline.defaults.items():
        if isinstance(loc.value, dict) and cli.get_command(top, key.split()[0]) is None:
            raise _Err(pipeline)(loc.line, f"defaults: {key!r} is not a command; valid choices: "
                                           f"{', '.join(sorted(cli.list_commands(top)))}")
    for spec in pipeline.stages:
        err = _Err(pipeline, spec)
        try:
            cmd = resolve_command(cli, spec.command)
        except ValueError as exc:
            raise err(spec.key_lines.get("stage", spec.line), str(exc)) from None
        params = params_of(cmd)
        ctx = click.Context(cmd, info_name=spec.command)
        raw: dict[str, tuple[Param, Any, int]] = {}
        # pipeline defaults first (only those the command has), then the stage's own values
        for key, loc in pipeline.defaults.items():
            if isinstance(loc.value, dict):
                if key in (spec.command, spec.command.split()[0]):
                    for k2, l2 in loc.value.items():
                        if norm(k2) not in params:
                            raise err(l2.line, f"default {k2!r} for {key!r}: `vsekit {spec.command}` "
                                               f"has no option {k2!r}; {_valid(params)}")
                        raw[params[norm(k2)].key] = (params[norm(k2)], l2, l2.line)
                continue
            if norm(key) in params and not params[norm(key)].invert:
                raw[params[norm(key)].key] = (params[norm(key)], loc, loc.line)
                used_defaults.add(key)
        for key, loc in spec.values.items():
            line = spec.key_lines.get(key, loc.line)
            if norm(key) not in params:
                raise err(line, f"unknown option {key!r} for `vsekit {spec.command}`; {_valid(params)}")
            p = params[norm(key)]
            raw[p.key] = (p, loc, line)
        if cluster and "cluster" in params and not params["cluster"].is_argument:
            # `vsekit run --cluster` wins over the file: it says where this run goes
            raw["cluster"] = (params["cluster"], Located(cluster, spec.line), spec.line)
        values: dict[str, Any] = {}
        for key, (p, loc, line) in raw.items():
            value = _substitute(loc, variables, err, tolerate_missing)
            if _has_placeholder(value):
                values[key] = value
                continue
            if key == "cluster" and not p.is_argument and not isinstance(value, (list, dict)):
                if tolerate_missing:   # checking the file only: parsed when its pipeline runs, once
                    values[key] = value
                    continue
                try:
                    values[key] = parse_cluster(value, cluster_settings)
                except ValueError as exc:
                    raise err(line, f"option 'cluster' of `vsekit {spec.command}`: {exc}") from None
                continue
            try:
                values[key] = convert_value(p, value, ctx)
            except ValueError as exc:
                what = "argument" if p.is_argument else "option"
                raise err(line, f"{what} {key!r} of `vsekit {spec.command}`: {exc}") from None
        for p in {id(x.param): x for x in params.values()}.values():
            if p.param.required and values.get(p.key) is None:
                what = f"argument {p.key!r}" if p.is_argument else f"option {p.key!r} (--{p.key})"
                raise err(spec.line, f"`vsekit {spec.command}` needs the {what}")
        io = stage_io(spec.command, values, lambda k, _c=cmd: option_default(_c, k))
        for store, name, option in io.reads:
            if (store, name) not in made:
                have = ", ".join(sorted({n for s, n in made if s == store})) or "none"
                line = spec.key_lines.get(option, spec.key_lines.get(option.replace("-", "_"), spec.line))
                raise err(line, f"--{option} {name!r}: no earlier stage makes this feature set in "
                                f"{store}; earlier stages make: {have}")
        for key in io.makes:
            made[key] = spec.label
        stages.append(ResolvedStage(spec, cmd, values, io, _input_files(params, values)))
    for key, loc in pipeline.defaults.items():
        if not isinstance(loc.value, dict) and key not in used_defaults:
            raise _Err(pipeline)(loc.line, f"default {key!r} is an option of none of its stages' commands")
    return stages


def _valid(params: dict[str, Param]) -> str:
    names = sorted({p.key for p in params.values() if not p.invert})
    return f"valid: {', '.join(names)}"


def _input_files(params: dict[str, Param], values: dict[str, Any]) -> list[str]:
    """Paths of existing-file parameters (inputs read from disk, such as a Karpathy JSON)."""
    out = []
    for key, value in values.items():
        p = params.get(key)
        if p is None or value is None:
            continue
        t = p.param.type
        if isinstance(t, click.Path) and t.exists:
            out.extend(str(v) for v in (value if isinstance(value, list) else [value]))
    return out


def check_file(pipelines: Mapping[str, PipelineSpec], cli: click.Group, *, sets=None, env=None) -> None:
    """Check every pipeline of a file; unset variables are allowed here (checked when one is run)."""
    for p in pipelines.values():
        resolve_pipeline(p, cli, sets=sets, env=env, cluster_settings=dict(p.cluster or {}),
                         tolerate_missing=True)


__all__ = ["ResolvedStage", "resolve_pipeline", "check_file", "NOT_FINGERPRINTED"]
