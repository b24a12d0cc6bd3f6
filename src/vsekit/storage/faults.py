"""Deterministic fault injection for the reliability tests and the fault study (docs/reliability.md).

This is the one module that reads the fault variables, and it reads them once per process (at the
first point reached; a process started later, such as a test's subprocess, reads its own). They
are a test harness, not a setting: nothing they hold changes what a run computes, only where a
process is killed or held.

Code calls :func:`point` just before each write that matters (``point("write_block:status")``).
With ``VSEKIT_FAULT=NAME`` in the environment the process ends there at once with
``os._exit(137)`` (the exit code of ``kill -9``): no ``finally`` blocks, no atexit handlers, no
flushes, exactly like a killed process. ``VSEKIT_FAULT=NAME@N`` ends it at the N-th time the point
is reached (1-based), so a test can let the first row block finish and kill the second.
Without either variable a point costs one test of a module global (``tests/test_crash_rerun.py``).
"""

from __future__ import annotations

import os
import threading

ENV = "VSEKIT_FAULT"
KILLED = 137
PAUSE_ENV, PAUSE_FILE_ENV, PAUSE_MAX_ENV = "VSEKIT_PAUSE", "VSEKIT_PAUSE_FILE", "VSEKIT_PAUSE_MAX_S"

_hits: dict[str, int] = {}
_lock = threading.Lock()
#: None until the first point reads the environment; then (fault spec, pause spec), or False when off
_config: tuple[str, str] | bool | None = None


def _read() -> tuple[str, str] | bool:
    global _config
    fault, pause_spec = os.environ.get(ENV, ""), os.environ.get(PAUSE_ENV, "")
    _config = (fault, pause_spec) if (fault or pause_spec) else False
    return _config


def point(name: str) -> None:
    """End the process here if ``VSEKIT_FAULT`` names this point (and its hit count is reached)."""
    config = _config if _config is not None else _read()
    if not config:
        return
    fault, pause_spec = config
    if pause_spec:
        _pause(pause_spec, name)
    if fault:
        want, _, nth = fault.partition("@")
        if want == name:
            with _lock:
                _hits[name] = _hits.get(name, 0) + 1
                hit = _hits[name]
            if hit >= int(nth or 1):
                os._exit(KILLED)


def _pause(spec: str, name: str) -> None:
    """With ``VSEKIT_PAUSE=NAME[@N]`` and ``VSEKIT_PAUSE_FILE=F``: at point NAME (its N-th hit), create ``F.reached``
    and wait until ``F`` exists (at most ``VSEKIT_PAUSE_MAX_S``, default 120 s). Tests use it to hold a
    run at a known point while a second run starts, without sleeps. Several points, each with its
    own file: ``VSEKIT_PAUSE=NAME[@N]=F,NAME2[@N2]=F2`` (e.g. one per job-array task)."""
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
