"""Where llmtrace keeps what it makes once and reuses: converted weights, compiled kernels. Pure Python.

$LLMTRACE_CACHE_DIR if set, else $XDG_CACHE_HOME/llmtrace, else ~/.cache/llmtrace. Each user of the cache owns one
folder under it (weights/: llmtrace.tracer.load.weights_cache; native/: llmtrace.tracer.model.native_kernel).
"""

from __future__ import annotations

import os
from pathlib import Path

CACHE_ENV = "LLMTRACE_CACHE_DIR"


def cache_root() -> Path:
    """The llmtrace cache folder ($LLMTRACE_CACHE_DIR, $XDG_CACHE_HOME/llmtrace or ~/.cache/llmtrace)."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "llmtrace"
