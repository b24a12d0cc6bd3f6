"""The exact command that (re)makes a feature set, rebuilt from its provenance attrs.

Messages that tell the user to resume, repair or retry a set quote it, so the advice can be pasted.
Storage knows no stage: each stage registers which sets it makes (a test on their attrs) and the
arguments that make one again (:func:`register`; ``vsekit.extract.job`` and ``vsekit.fne.derived``
do, when they are imported, as every command that makes or reads such a set imports them).
"""

from __future__ import annotations

import shlex
from typing import Any, Callable, Mapping

#: (stage, makes(attrs) -> bool, args(store path, set name, attrs) -> argv), in registration order
_RULES: list[tuple[str, Callable[[Mapping[str, Any]], bool], Callable[[str, str, Mapping[str, Any]], list[str]]]] = []


def register(stage: str, makes: Callable[[Mapping[str, Any]], bool],
             args: Callable[[str, str, Mapping[str, Any]], list[str]]) -> None:
    """Stage ``stage`` makes the sets whose attrs satisfy ``makes``; ``args(store, name, attrs)`` is
    the command line (``["vsekit", ...]``) that makes one again. Registering a stage again replaces it."""
    _RULES[:] = [r for r in _RULES if r[0] != stage]
    _RULES.append((stage, makes, args))


def remake_command(store, name: str, *extra: str) -> str:
    """The command that makes feature set ``name`` of ``store``, ``extra`` arguments appended."""
    attrs = store.features(name).attrs
    for _stage, makes, args in _RULES:
        if makes(attrs):
            return shlex.join([*args(str(store.path), name, attrs), *extra])
    return f"the command that made {name!r} (see `vsekit info {store.path} {name}`)"


def root_set(store, name: str) -> str:
    """The first ancestor of ``name`` that no stage derived (the extraction its failures come from)."""
    seen = name
    while True:
        parent = store.features(seen).attrs.get("parent")
        if not parent or not store.has_features(parent):
            return seen
        seen = parent

