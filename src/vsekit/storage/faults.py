"""Deterministic fault injection for the reliability tests (see docs/reliability.md).

Code calls :func:`point` just before each write that matters (``point("write_block:status")``).
With ``VSEKIT_FAULT=NAME`` in the environment the process ends there at once with
``os._exit(137)`` (the exit code of ``kill -9``): no ``finally`` blocks, no atexit handlers, no
flushes, exactly like a killed process. ``VSEKIT_FAULT=NAME@N`` ends it at the N-th time the point
is reached (1-based), so a test can let the first row block finish and kill the second.
Without the variable a point costs one dictionary lookup.
"""

from __future__ import annotations

import os
import threading

ENV = "VSEKIT_FAULT"
KILLED = 137

_hits: dict[str, int] = {}
_lock = threading.Lock()


def _hit(env: str, name: str, key: str) -> tuple[int, int]:
    """How many times point ``name`` was reached, if ``env`` (``NAME[@N]``) names it, and N; else (0, 0)."""
    spec = os.environ.get(env)
    if not spec:
        return 0, 0
    want, _, nth = spec.partition("@")
    if want != name:
        return 0, 0
    with _lock:
        _hits[key] = _hits.get(key, 0) + 1
        return _hits[key], int(nth or 1)


def point(name: str) -> None:
    """End the process here if ``VSEKIT_FAULT`` names this point (and its hit count is reached)."""
    pause(name)
    hit, nth = _hit(ENV, name, name)
    if hit and hit >= nth:
        os._exit(KILLED)


PAUSE_ENV, PAUSE_FILE_ENV, PAUSE_MAX_ENV = "VSEKIT_PAUSE", "VSEKIT_PAUSE_FILE", "VSEKIT_PAUSE_MAX_S"


def pause(name: str) -> None:
    """With ``VSEKIT_PAUSE=NAME[@N]`` and ``VSEKIT_PAUSE_FILE=F``: at point NAME (its N-th hit), create ``F.reached``
    and wait until ``F`` exists (at most ``VSEKIT_PAUSE_MAX_S``, default 120 s). Tests use it to hold a
    run at a known point while a second run starts, without sleeps. Several points, each with its
    own file: ``VSEKIT_PAUSE=NAME[@N]=F,NAME2[@N2]=F2`` (e.g. one per job-array task)."""
    spec = os.environ.get(PAUSE_ENV)
    if not spec:
        return
    for entry in spec.split(","):
        want, _, flag = entry.partition("=")
        point_name, _, nth = want.partition("@")
        if point_name != name:
            continue
        with _lock:
            key = f"pause:{want}"
            _hits[key] = _hits.get(key, 0) + 1
            hit = _hits[key]
        if hit != int(nth or 1):
            continue
        _wait(flag or os.environ[PAUSE_FILE_ENV])


def _wait(flag_file: str) -> None:
    import time
    from pathlib import Path

    flag = Path(flag_file)
    Path(f"{flag}.reached").touch()
    deadline = time.monotonic() + float(os.environ.get(PAUSE_MAX_ENV, 120))
    while not flag.exists() and time.monotonic() < deadline:
        time.sleep(0.02)
