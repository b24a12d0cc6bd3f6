"""Stages are the CLI's own Click commands: look them up, check values against their parameters, build argv.

Nothing here knows a stage's options by heart. A stage's values are checked against the Click
command's parameters (names, ``ParamType`` conversion, choices, flags, ``multiple`` and ``nargs``),
and the stage runs by invoking that same command in-process, so a pipeline can never drift from the
command line. Path parameters are checked for type only: the files they name may be made by an
earlier stage.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import click


@dataclass
class Param:
    """One way of naming a Click parameter in a stage (``store``, ``keep-restval``, ``json-path``)."""

    param: click.Parameter
    key: str                # canonical key (long option without dashes, or argument name)
    invert: bool = False    # the secondary name of an on/off flag (``--keep-restval``)

    @property
    def is_argument(self) -> bool:
        return isinstance(self.param, click.Argument)

    @property
    def flag(self) -> str:
        """The option string used on the command line."""
        opts = [o for o in self.param.opts if o.startswith("--")] or list(self.param.opts)
        return max(opts, key=len)


def norm(key: str) -> str:
    return str(key).strip().lower().replace("_", "-").lstrip("-")


def resolve_command(cli: click.Group, path: str) -> click.Command:
    """The command for a path such as ``extract`` or ``ingest karpathy``; ValueError lists choices."""
    ctx = click.Context(cli, info_name="vsekit")
    cmd: click.Command = cli
    done: list[str] = []
    for word in path.split():
        if not isinstance(cmd, click.Group):
            raise ValueError(f"`vsekit {' '.join(done)}` has no subcommands (asked for {path!r})")
        sub = cmd.get_command(ctx, word)
        if sub is None:
            choices = ", ".join(sorted(cmd.list_commands(ctx)))
            where = f"`vsekit {' '.join(done)}` subcommand" if done else "stage"
            raise ValueError(f"unknown {where} {word!r}; valid choices: {choices}")
        cmd, done = sub, done + [word]
    if isinstance(cmd, click.Group):
        choices = ", ".join(sorted(cmd.list_commands(ctx)))
        raise ValueError(f"stage {path!r} needs a subcommand, e.g. `stage: {path} "
                         f"{sorted(cmd.list_commands(ctx))[0] if choices else 'NAME'}`; valid: {choices}")
    return cmd


def params_of(cmd: click.Command) -> dict[str, Param]:
    """Every accepted stage key of ``cmd``, normalised (``-`` and ``_`` are interchangeable)."""
    out: dict[str, Param] = {}
    for p in cmd.params:
        if isinstance(p, click.Argument):
            out[norm(p.name)] = Param(p, norm(p.name))
            continue
        if not isinstance(p, click.Option) or p.hidden and p.name == "help":
            continue
        longs = [o for o in p.opts if o.startswith("--")] or list(p.opts)
        key = norm(max(longs, key=len))
        out[key] = Param(p, key)
        for o in longs:
            out.setdefault(norm(o), Param(p, key))
        if norm(p.name) not in out:
            out[norm(p.name)] = Param(p, key)
        for o in p.secondary_opts:
            if o.startswith("--"):
                out[norm(o)] = Param(p, key, invert=True)
    return out


def _scalar_ok(value: Any) -> bool:
    return value is None or isinstance(value, (str, int, float, bool))


def convert_value(p: Param, value: Any, ctx: click.Context) -> Any:
    """Check and convert one stage value; ValueError says what is wrong. ``None`` means unset."""
    param = p.param
    if value is None:
        return None
    if p.invert:
        if not isinstance(value, bool):
            value = click.BOOL.convert(value, param, ctx)
        return not value
    if isinstance(param, click.Option) and param.is_flag and not param.count:
        if isinstance(value, bool):
            return value
        try:
            return click.BOOL.convert(value, param, ctx)
        except click.BadParameter:
            raise ValueError(f"{value!r} is not a boolean (write true or false)") from None
    many = (getattr(param, "multiple", False)) or (isinstance(param, click.Argument) and param.nargs == -1)
    if many:
        items = value if isinstance(value, list) else [value]
        return [_convert_nargs(param, v, ctx) for v in items]
    return _convert_nargs(param, value, ctx)


def _convert_nargs(param: click.Parameter, value: Any, ctx: click.Context) -> Any:
    nargs = param.nargs if param.nargs and param.nargs > 1 else 1
    if nargs > 1:
        items = value.split() if isinstance(value, str) else value
        if not isinstance(items, list) or len(items) != nargs:
            raise ValueError(f"expects {nargs} values (a list like [a, b]), got {value!r}")
        types = getattr(param.type, "types", None) or [param.type] * nargs
        return [_convert_one(param, t, v, ctx) for t, v in zip(types, items)]
    if isinstance(value, list):
        raise ValueError(f"expects one value, got a list {value!r}")
    return _convert_one(param, param.type, value, ctx)


def _convert_one(param: click.Parameter, ptype: click.ParamType, value: Any, ctx: click.Context) -> Any:
    if not _scalar_ok(value):
        raise ValueError(f"expects a single value, got {type(value).__name__} {value!r}")
    if isinstance(ptype, (click.Path, click.File)):
        # type only: the file may be made by an earlier stage
        if isinstance(value, bool) or value == "":
            raise ValueError(f"expects a path, got {value!r}")
        return str(value)
    if isinstance(ptype, click.types.FloatParamType) and isinstance(value, bool):
        raise ValueError(f"expects a number, got {value!r}")
    if isinstance(ptype, click.types.IntParamType) and (isinstance(value, bool)
                                                        or isinstance(value, float) and not value.is_integer()):
        raise ValueError(f"expects an integer, got {value!r}")
    try:
        return ptype.convert(value, param, ctx)
    except click.BadParameter as exc:
        raise ValueError(exc.format_message()) from None


def fmt(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return repr(value)
    return str(value)


def build_argv(command: str, cmd: click.Command, values: dict[str, Any]) -> list[str]:
    """The argument list that runs ``cmd`` with ``values`` (canonical key -> converted value)."""
    params = {p.key: p for p in params_of(cmd).values() if not p.invert}
    argv: list[str] = command.split()
    for key, value in values.items():
        if value is None or params[key].is_argument:
            continue
        p = params[key]
        param = p.param
        if isinstance(param, click.Option) and param.is_flag and not param.count:
            if value:
                argv.append(p.flag)
            elif param.secondary_opts:
                argv.append(max(param.secondary_opts, key=len))
            continue
        items = value if getattr(param, "multiple", False) else [value]
        for item in items:
            argv.append(p.flag)
            argv.extend(fmt(v) for v in (item if isinstance(item, list) else [item]))
    positionals: list[str] = []   # the arguments, in the command's declared order
    for p in cmd.params:
        v = values.get(norm(p.name)) if isinstance(p, click.Argument) else None
        for item in ([] if v is None else v if isinstance(v, list) else [v]):
            positionals.extend(fmt(x) for x in (item if isinstance(item, list) else [item]))
    return argv + ["--", *positionals] if positionals else argv


def has_option(cmd: click.Command, key: str) -> bool:
    p = params_of(cmd).get(norm(key))
    return p is not None and not p.is_argument


def option_default(cmd: click.Command, key: str) -> Any:
    p = params_of(cmd).get(norm(key))
    if p is None:
        return None
    default = p.param.default
    return None if callable(default) else default


def call_stage(cmd: click.Command, command: str, values: dict[str, Any]) -> Any:
    """Run a stage: ``cmd``'s function called with ``values`` (canonical key -> converted value) as its
    typed keyword arguments, each unset parameter at the command's default. No command line is
    built: Click only fills the defaults and applies each parameter's type to the values (the files
    a path names are checked now, when the stage runs, as the command line would)."""
    params = {p.key: p for p in params_of(cmd).values() if not p.invert}
    given = {params[k].param.name: v for k, v in values.items() if v is not None and k in params}
    ctx = cmd.make_context(f"vsekit {command}", [], default_map=given)
    with ctx:
        return ctx.invoke(cmd.callback, **ctx.params)
