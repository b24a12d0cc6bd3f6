"""docs/reference.md is what ``docs/gen_reference.py`` prints from the Click commands now: a new or
changed option, default or choice that is not regenerated into it fails here."""

from __future__ import annotations

import importlib.util
from pathlib import Path

DOCS = Path(__file__).parents[1] / "docs"


def _generator():
    spec = importlib.util.spec_from_file_location("gen_reference", DOCS / "gen_reference.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_reference_is_generated_from_the_commands():
    want = _generator().reference()
    have = (DOCS / "reference.md").read_text()
    assert have == want, "docs/reference.md is stale: run `python docs/gen_reference.py > docs/reference.md`"


def test_reference_lists_every_command_and_option():
    import click

    from vsekit.cli import main

    text = (DOCS / "reference.md").read_text()
    ctx = click.Context(main)
    for name in main.list_commands(ctx):
        cmd = main.get_command(ctx, name)
        subs = [(f"{name} {s}", cmd.get_command(ctx, s)) for s in cmd.list_commands(ctx)] \
            if isinstance(cmd, click.Group) else [(name, cmd)]
        for path, sub in subs:
            section = text.split(f"\n## vsekit {path}\n", 1)[1].split("\n## ", 1)[0]
            for p in sub.params:
                if isinstance(p, click.Option) and not p.hidden:
                    assert f"`{p.opts[0]}`" in section, (path, p.opts[0])
            for choice in getattr(next((p.type for p in sub.params if p.name == "split"), None), "choices", []):
                assert f"`{choice}`" in section
