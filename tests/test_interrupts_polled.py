"""``Handling.polled``: a signal is recorded for the code to act on at its own boundary (the trainer's
step boundary); the same signal again at once (a launcher forwarding a terminal's Ctrl-C) is the same
request; a later second one stops at once."""

from __future__ import annotations

import os
import signal

import pytest

from vsekit import interrupts
from vsekit.interrupts import Interrupted, active, handling


def test_polled_records_then_a_later_second_signal_raises(monkeypatch):
    assert active() is None
    with handling() as h:
        assert active() is h
        with h.polled():
            os.kill(os.getpid(), signal.SIGTERM)
            assert h.pending == signal.SIGTERM           # recorded, nothing raised
            os.kill(os.getpid(), signal.SIGINT)          # at once: the same request
            assert h.pending == signal.SIGTERM
            monkeypatch.setattr(interrupts, "REPEAT_S", 0.0)
            with pytest.raises(Interrupted) as exc:
                os.kill(os.getpid(), signal.SIGINT)      # a deliberate second one
            assert exc.value.exit_code == 130
        h.clear()
        assert h.pending is None
    assert active() is None
