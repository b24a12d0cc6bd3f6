"""Ctrl-C and SIGTERM, for every command that writes: the only module that installs signal handlers
(besides :func:`vsekit.clusters.jobqueue.import_jobqueue`'s guard against dask-jobqueue's own).

While :func:`handling` is active (the CLI wraps every command in it, ``extract()`` its run, a job
array task its loop), SIGINT and SIGTERM raise :class:`Interrupted` in the main thread, so locks are
released, cluster jobs cancelled and the kept rows reported as on Ctrl-C. :class:`Interrupted` is
the one exception of an interrupted run: a ``KeyboardInterrupt`` that carries the signal, hence the
exit code (``128 + signal``: 130 for Ctrl-C, 143 for SIGTERM), and the message to show the user.

- ``handling(on_signal=f)``: ``f(signum)`` runs first (the extraction loop kills its decoding
  processes there, so that torch's slow graceful shutdown is skipped);
- ``with h.deferred():`` holds a signal until the block ends (an array task finishes its commit);
- ``h.signum``: the signal that came, for code that learns of it indirectly (a RuntimeError of
  torch about workers the callback killed);
- ``with h.polled():`` records a signal (``h.pending``) for the code to act on at a boundary of its
  own choosing (the trainer: the next step boundary, where every rank agrees to stop, saves and
  raises :class:`Interrupted`); a second signal while one is pending (more than ``REPEAT_S`` after
  it: a launcher forwarding the terminal's Ctrl-C is the same request) is raised at once.
  :func:`active` is the innermost :func:`handling`'s object (None outside one).
"""

from __future__ import annotations

import contextlib
import signal
import threading
import time
from typing import Callable, Iterator


class Interrupted(KeyboardInterrupt):
    """A run stopped by SIGINT (exit 130) or SIGTERM (exit 143); ``str()`` is what to tell the user."""

    def __init__(self, message: str = "", signum: int = signal.SIGINT):
        super().__init__(message)
        self.message = message
        self.signum = int(signum)

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


def interrupted(exc: BaseException, message: str) -> Interrupted:
    """``exc`` (an :class:`Interrupted`, or Python's own ``KeyboardInterrupt`` for Ctrl-C) with ``message``."""
    return Interrupted(message, getattr(exc, "signum", signal.SIGINT))


#: under :meth:`Handling.polled`, a signal within this many seconds of the first is the same request
REPEAT_S = 2.0


class Handling:
    """What :func:`handling` yields: the signal that came (``signum``) and :meth:`deferred`."""

    def __init__(self, on_signal: Callable[[int], None] | None = None):
        self.on_signal = on_signal
        self.signum: int | None = None
        self._defer = 0
        self._poll = 0
        self._pending: int | None = None
        self._pending_at = 0.0

    @property
    def pending(self) -> int | None:
        """The signal held for the code to act on (under :meth:`polled` or :meth:`deferred`), or None."""
        return self._pending

    def clear(self) -> None:
        self._pending = None

    @contextlib.contextmanager
    def polled(self) -> Iterator[None]:
        """A signal during the block is only recorded in :attr:`pending` (a second one is raised)."""
        self._poll += 1
        try:
            yield
        finally:
            self._poll -= 1

    def _handler(self, signum, frame):
        self.signum = signum
        now = time.monotonic()
        if self._poll and (self._pending is None or now - self._pending_at < REPEAT_S):
            # the first signal, or the same one again at once (a terminal's Ctrl-C reaches a launcher
            # and its ranks, and the launcher forwards it): recorded for the step boundary
            if self._pending is None:
                self._pending, self._pending_at = signum, now
            return
        if self._defer:
            self._pending = signum
            return
        if self.on_signal is not None:
            self.on_signal(signum)
        raise Interrupted("", signum)

    @contextlib.contextmanager
    def deferred(self) -> Iterator[None]:
        """A signal during the block is raised when the block has ended."""
        self._defer += 1
        try:
            yield
        finally:
            self._defer -= 1
        if not self._defer and self._pending is not None:
            signum, self._pending = self._pending, None
            raise Interrupted("", signum)


@contextlib.contextmanager
def handling(on_signal: Callable[[int], None] | None = None) -> Iterator[Handling]:
    """SIGINT and SIGTERM raise :class:`Interrupted` while the block runs (main thread only; elsewhere
    nothing is installed); the previous handlers are put back afterwards."""
    h = Handling(on_signal)
    if threading.current_thread() is not threading.main_thread():
        yield h
        return
    previous = {sig: signal.signal(sig, h._handler) for sig in (signal.SIGINT, signal.SIGTERM)}
    _active.append(h)
    try:
        yield h
    finally:
        _active.remove(h)
        for sig, old in previous.items():
            signal.signal(sig, old)


_active: list[Handling] = []


def active() -> Handling | None:
    """The innermost active :func:`handling` (None outside one, or off the main thread)."""
    return _active[-1] if _active else None


__all__ = ["Interrupted", "active", "handling", "interrupted"]
