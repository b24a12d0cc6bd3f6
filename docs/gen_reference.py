"""Writes docs/reference.md from the Click commands themselves: every command, every option, its
default and its vocabulary (the choices it takes), so the reference cannot go stale.

    python docs/gen_reference.py > docs/reference.md

``tests/test_docs_reference.py`` fails when the file differs from what this prints.
"""

from __future__ import annotations

import sys

import click

HEAD = """# Command reference

Generated from the commands themselves by `python docs/gen_reference.py > docs/reference.md`
(`tests/test_docs_reference.py` fails when it is out of date): every command and option, its default
and the values it takes. What an option means across commands: [cli.md](cli.md). Where to start:
[index.md](index.md).
"""


def _cell(text: object) -> str:
    return " ".join(str(text).split()).replace("|", "\\|")


def _takes(p: click.Parameter) -> str:
    t = p.type
    if isinstance(p, click.Option) and p.is_flag:
        return "flag"
    if isinstance(t, click.Choice):
        return " \\| ".join(f"`{c}`" for c in t.choices)
    if isinstance(t, (click.IntRange, click.FloatRange)):
        return _cell(t.name if not hasattr(t, "_describe_range") else f"{t.name} {t._describe_range()}")
    metavar = t.get_metavar(p, None) if "ctx" in t.get_metavar.__code__.co_varnames else t.get_metavar(p)
    return _cell(metavar or t.name)


def _default(p: click.Parameter) -> str:
    d = p.default
    unset = getattr(click.core, "UNSET", None)
    if d is None or d is unset or d == () or (isinstance(p, click.Option) and p.is_flag and d is False
                                                    and not p.secondary_opts):
        return ""
    if isinstance(p, click.Option) and p.is_flag and p.secondary_opts:
        return f"`{p.opts[0] if d else p.secondary_opts[0]}`"
    return f"`{_cell(d)}`"


def _command(path: str, cmd: click.Command, out: list[str]) -> None:
    if isinstance(cmd, click.Group):
        for name in cmd.list_commands(None):   # type: ignore[arg-type]
            _command(f"{path} {name}", cmd.get_command(None, name), out)   # type: ignore[arg-type]
        return
    ctx = click.Context(cmd, info_name=path)
    out += ["", f"## {path}", "", "```text", f"{path} {' '.join(cmd.collect_usage_pieces(ctx))}", "```", ""]
    out += [_cell(cmd.help or ""), ""]
    rows = [p for p in cmd.params if not getattr(p, "hidden", False)]
    if not rows:
        return
    out += ["| argument / option | takes | default | what it does |", "| --- | --- | --- | --- |"]
    for p in rows:
        if isinstance(p, click.Argument):
            name = f"`{p.human_readable_name}`"
            help_ = "argument" + (" (required)" if p.required else "")
        else:
            name = ", ".join(f"`{o}`" for o in [*p.opts, *p.secondary_opts])
            help_ = (p.help or "") + (" (required)" if p.required else "")
        out.append(f"| {name} | {_takes(p)} | {_default(p)} | {_cell(help_)} |")


def reference() -> str:
    from vsekit.cli import main

    out = [HEAD.rstrip("\n")]
    for name in main.list_commands(None):   # type: ignore[arg-type]
        _command(f"vsekit {name}", main.get_command(None, name), out)   # type: ignore[arg-type]
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    sys.stdout.write(reference())
