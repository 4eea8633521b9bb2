"""llmtrace's version, from the installed distribution's metadata (pyproject.toml is the one place it is written)."""

from __future__ import annotations

from functools import lru_cache
from importlib import metadata


@lru_cache(maxsize=1)
def llmtrace_version() -> str:
    """The installed llmtrace's version, e.g. "0.1.0"; "unknown" when running from files that were never installed."""
    try:
        return metadata.version("llmtrace")
    except metadata.PackageNotFoundError:
        return "unknown"
