"""Files a command writes (a trace, a Chrome trace): checked before the work, written with one-line errors."""

from __future__ import annotations

import os
from pathlib import Path

from llmtrace.tracer.core.errors import BadArgumentError


def check_writable(path: Path) -> None:
    """One line now, rather than a lost trace after the run: the folder must exist and accept the file."""
    folder = path.parent if str(path.parent) else Path(".")
    if path.is_dir():
        raise BadArgumentError(f"cannot write {path}: it is a folder; give a file path")
    if not folder.is_dir():
        raise BadArgumentError(f"cannot write {path}: no folder {folder}; create it or choose another path")
    if not os.access(folder, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise BadArgumentError(f"cannot write {path}: permission denied; choose a writable path")


def write_output(path: Path, text: str) -> None:
    """Write `text` (UTF-8); a failure is one line naming the path."""
    try:
        path.write_text(text, encoding="utf-8")
    except OSError as exc:
        raise BadArgumentError(f"cannot write {path} ({exc.strerror}); choose a writable path") from exc
