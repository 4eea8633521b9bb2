"""What `run` says while nothing else shows: the weights loading (bytes and a bar), then the prefill.

At 7B a load takes seconds to minutes and a 128-token prefill tens of seconds; without these lines the terminal sat
blank until the first panel. Both are status lines (a spinner and one line, gone once done), updated at most a few
times a second: the loaders call back after every tensor (hundreds a model).
"""

from __future__ import annotations

import time
from typing import Any, Callable

BAR_CELLS = 20


def bar(done: int, total: int, cells: int = BAR_CELLS) -> str:
    """`done` of `total` as a bar of `cells` characters: "━━━━━━╺───" (full cells, a half, the rest)."""
    filled = cells * done / total if total else cells
    full = int(filled)
    half = "╺" if filled - full >= 0.5 and full < cells else ""
    return "━" * full + half + "─" * (cells - full - len(half))


class LoadingBar:
    """load_model's `loading` callback: the status line "loading <what> ━━━╺──── 1.23 / 3.87 GB", redrawn at most
    every `interval` seconds and once at the end."""

    def __init__(self, status: Any, what: str, interval: float = 0.1,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.status = status
        self.what = what
        self.interval = interval
        self.clock = clock
        self._next = float("-inf")

    def __call__(self, done: int, total: int) -> None:
        now = self.clock()
        if now < self._next and done < total:
            return
        self._next = now + self.interval
        self.status.update(f"loading {self.what} {bar(done, total)} {done / 1e9:.2f} / {total / 1e9:.2f} GB")


def prefill_line(tokens: int, layers: int, warmup: bool) -> str:
    """The status line while the prompt runs through the model, until the first panel."""
    first = ", an untimed warm-up pass first" if warmup else ""
    return f"prefill: {tokens:,} prompt tokens through {layers} layers{first} …"
