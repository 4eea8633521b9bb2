"""Stopping a run: SIGTERM and SIGHUP end it as Ctrl-C does, and no signal can cut the final writes in half.

`timeout`, a cancelled CI job or a closed terminal send SIGTERM or SIGHUP; by default Python dies on them at once,
losing the whole run. `stop_signals_interrupt()` makes them raise KeyboardInterrupt, so the generation loop stops at
the current step and the trace is still written (exit 128 + the signal's number). `deferred_interrupts()` holds
SIGINT, SIGTERM and SIGHUP while the output files are written: a second Ctrl-C then stops the command right after
the files are whole, not halfway through them.
"""

from __future__ import annotations

import signal
import threading
from contextlib import contextmanager
from typing import Any, Iterator

STOP_SIGNALS = tuple(s for s in (signal.SIGINT, signal.SIGTERM, getattr(signal, "SIGHUP", None)) if s is not None)


class Received:
    """The last stop signal seen (None: none)."""

    def __init__(self) -> None:
        self.signum: int | None = None

    @property
    def name(self) -> str:
        """What stopped the run, for the summary: "Ctrl-C" (SIGINT), "SIGTERM", "SIGHUP"; "" when none came."""
        if self.signum is None:
            return ""
        return "Ctrl-C" if self.signum == signal.SIGINT else signal.Signals(self.signum).name

    @property
    def exit_code(self) -> int:
        """128 + the signal's number, as a shell reports a process the signal ended (130 for Ctrl-C)."""
        return 128 + (self.signum or signal.SIGINT)


def _main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


@contextmanager
def stop_signals_interrupt() -> Iterator[Received]:
    """Within the block, SIGTERM and SIGHUP raise KeyboardInterrupt like SIGINT; which one came is recorded."""
    received = Received()
    if not _main_thread():  # signal handlers can only be set from the main thread (e.g. a test runner's worker)
        yield received
        return

    def interrupt(signum: int, _frame: Any) -> None:
        received.signum = signum
        raise KeyboardInterrupt

    previous = {s: signal.signal(s, interrupt) for s in STOP_SIGNALS}
    try:
        yield received
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


@contextmanager
def deferred_interrupts(received: Received | None = None) -> Iterator[None]:
    """Hold stop signals until the block ends, then raise KeyboardInterrupt if one came."""
    if not _main_thread():
        yield
        return
    pending: list[int] = []
    previous = {s: signal.signal(s, lambda signum, _frame: pending.append(signum)) for s in STOP_SIGNALS}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    if pending:
        if received is not None:
            received.signum = pending[-1]
        raise KeyboardInterrupt
