"""How far a load has got, in bytes of the checkpoint's tensors, for whoever shows it (run's loading bar).

A 7B checkpoint takes seconds to minutes to load; the loaders report each tensor as they finish it to the callback
`load_model(loading=...)` installed for the load (a context variable: no loader signature carries it, and a load in
another thread reports to its own), as (bytes done, bytes in all). Nothing is reported where none was installed.
"""

from __future__ import annotations

from contextlib import contextmanager
from contextvars import ContextVar
from typing import Callable, Iterator

Callback = Callable[[int, int], None]  # (bytes done, bytes in all)

_current: ContextVar[list | None] = ContextVar("llmtrace_load_progress", default=None)


@contextmanager
def reporting(callback: Callback | None, total: int) -> Iterator[None]:
    """Report the loads inside this block to `callback` (None: nowhere), `total` bytes in all."""
    token = _current.set([callback, 0, total] if callback is not None and total > 0 else None)
    try:
        yield
    finally:
        _current.reset(token)


def advance(nbytes: int) -> None:
    """A loader finished `nbytes` more of the checkpoint's tensors."""
    state = _current.get()
    if state is None:
        return
    callback, done, total = state
    state[1] = done = min(total, done + nbytes)
    callback(done, total)
