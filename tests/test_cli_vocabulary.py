"""One option vocabulary (docs/cli.md): every command follows the table of docs/cli.md.

The test is driven by the table: a command that disagrees with it fails here, and the fix is in the
command (or, for a deliberate change, in the table).
"""

from __future__ import annotations

from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from vsekit.cli import main

DOC = Path(__file__).resolve().parents[1] / "docs" / "cli.md"
SPLITS = {"train", "val", "test", "restval"}


def _table() -> dict[str, dict]:
    rows = {}
    for line in DOC.read_text().splitlines():
        if not line.startswith("| `"):
            continue
        cells = [c.strip() for c in line.strip().strip("|").split(" | ")]
        name, typ, commands, required, meaning = cells[0].strip("`"), cells[1], cells[2], cells[3], cells[4]
        assert name not in rows, f"docs/cli.md lists {name} twice: one name, one meaning"
        rows[name] = {"type": typ, "commands": {c.strip() for c in commands.split(",") if c.strip()},
                      "required": {c.strip() for c in required.split(",") if c.strip() and c.strip() != "-"},
                      "meaning": meaning}
    return rows


def _commands(group=main, path=()):
    for name in group.list_commands(None):
        cmd = group.get_command(None, name)
        if isinstance(cmd, click.Group):
            yield from _commands(cmd, (*path, name))
        else:
            yield " ".join((*path, name)), cmd


def _name(p: click.Option) -> str:
    return "/".join([*p.opts, *p.secondary_opts])


def _type(p: click.Option) -> str:
    if p.is_flag:
        return "flag"
    t = p.type
    if isinstance(t, click.Choice):
        return "split" if set(t.choices) == SPLITS else "choice"
    return {"integer": "int", "integer range": "int", "float range": "float", "directory": "path",
            "file": "path", "path": "path", "text": "text"}.get(t.name, t.name)


COMMANDS = dict(_commands())
TABLE = _table()


@pytest.mark.parametrize("command", list(COMMANDS))
def test_command_follows_the_table(command):
    cmd = COMMANDS[command]
    unset = getattr(click.core, "UNSET", None)
    problems = []
    have = set()
    for p in cmd.params:
        if not isinstance(p, click.Option) or p.name == "help":
            continue
        name = _name(p)
        have.add(name)
        row = TABLE.get(name)
        if row is None or command not in row["commands"]:
            problems.append(f"{name}: not in docs/cli.md's row for {command}")
            continue
        if _type(p) != row["type"]:
            problems.append(f"{name}: type {_type(p)}, the table says {row['type']}")
        click_required = command in row["required"]
        if bool(p.required) != click_required and f"{command}*" not in row["required"]:
            problems.append(f"{name}: required={p.required}, the table says {click_required}")
        if not (p.help or "").strip():
            problems.append(f"{name}: no help text")
        has_default = (not p.is_flag and p.default is not None and p.default is not unset and p.default != ())
        if has_default and not p.show_default and "[default:" not in (p.help or ""):
            problems.append(f"{name}: default {p.default!r} not shown")
        if "--progress" in [*p.opts, *p.secondary_opts] or "--no-progress" in [*p.opts, *p.secondary_opts]:
            if name != "--progress/--no-progress":
                problems.append(f"{name}: progress is --progress/--no-progress everywhere")
    for name, row in TABLE.items():
        if command in row["commands"] and name not in have:
            problems.append(f"{name}: the table lists it for {command}, the command lacks it")
    assert not problems, f"vsekit {command} disagrees with docs/cli.md:\n  " + "\n  ".join(problems)


@pytest.mark.parametrize("command", list(COMMANDS))
def test_usage_errors_exit_1(command):
    res = CliRunner().invoke(main, [*command.split(), "--no-such-option"])
    assert res.exit_code == 1 and "No such option '--no-such-option'" in res.output, res.output
    res = CliRunner().invoke(main, ["no-such-command"])
    assert res.exit_code == 1


def test_table_names_only_real_commands_and_store_is_required_with_help():
    for name, row in TABLE.items():
        unknown = row["commands"] - set(COMMANDS)
        assert not unknown, f"{name}: docs/cli.md names commands that do not exist: {unknown}"
    store = TABLE["--store"]
    optional = store["commands"] - {c.rstrip("*") for c in store["required"]}
    assert optional == {"evaluate", "embed", "report"}   # they read the run's own store unless given
    workers = TABLE["--workers"]
    assert workers["type"] == "workers" and workers["commands"] == {"extract", "tokenize"}
