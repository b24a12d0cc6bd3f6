"""The one description of an option: a dataclass field carrying its command-line flag, default,
help and how a set's attrs record it. ``vsekit extract`` builds its Click options from these fields
(``cli/extract.py``), ``extract()`` takes them as keyword arguments, and the remake command of a set
is rebuilt from them (:func:`vsekit.extract.job.remake_args`)."""

from __future__ import annotations

import dataclasses
from dataclasses import field
from typing import Any, Callable, Mapping


def option(default: Any, flag: str, help: str = "", *, choices: tuple | None = None, type: type | None = None,
           attr: str | None = None, when: Callable[[Mapping], bool] | None = None,
           render: Callable[[Any], list[str]] | None = None, secondary: str | None = None,
           metavar: str | None = None, show_default: bool = True, setting: bool = False,
           check: Callable[[Any], str | None] | None = None, unrecorded: Any = None) -> Any:
    """A dataclass field with what the CLI and ``remake`` need to know about it.

    ``secondary``: the off switch of a boolean (``--no-channels-last``, ``--no-progress``); ``render``: the arguments a value of the set's attrs
    gives in the remake command (default ``[flag, str(value)]``). ``setting``: a value the Plan
    carries as it is (``Plan.settings``), recorded in the set's attrs under ``attr`` when it is not
    the default (so sets made before the option existed keep their settings hash), and rendered in
    the remake command when recorded; ``check``: the reason a value is refused, or None;
    ``unrecorded``: what a set whose attrs lack ``attr`` was made with (rendered in its remake command,
    so that the command stays exact when the option's default changes; ``--decoder``: pil).
    """
    meta = {"flag": flag, "help": help, "choices": choices, "type": type, "attr": attr, "when": when,
            "render": render, "secondary": secondary, "metavar": metavar,
            "show_default": show_default, "setting": setting, "check": check, "unrecorded": unrecorded}
    return field(default=default, metadata=meta)


def fields_of(cls) -> list[dataclasses.Field]:
    """The fields of ``cls`` (or of an instance) that are options (they carry a flag)."""
    return [f for f in dataclasses.fields(cls) if f.metadata.get("flag")]
