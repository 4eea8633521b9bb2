"""Files a command writes (a trace, a Chrome trace) and reads back: checked before the work, written atomically
(tracer/core/atomic_file.py: a reader never sees half a file, a failed write never clobbers the old one), gzip
when the name ends in .gz, and one-line errors. Checked before the run: each path's folder exists and accepts
files, no two outputs share a path, and no output is one of the command's inputs (`show run.json
--chrome-trace run.json` would replace the trace it shows)."""

from __future__ import annotations

import gzip
import os
import sys
import zlib
from pathlib import Path

from llmtrace.tracer.core.atomic_file import write_atomic
from llmtrace.tracer.core.errors import BadArgumentError

STDIO = "-"
GZIP_MAGIC = b"\x1f\x8b"
# zlib level 6 (gzip's default) gives ~20x on a trace; 9 takes ~2x longer for a few percent.
GZIP_LEVEL = 6


def check_writable(path: Path) -> None:
    """One line now, rather than a lost trace after the run: the folder must exist and accept the file."""
    folder = path.parent if str(path.parent) else Path(".")
    if path.is_dir():
        raise BadArgumentError(f"cannot write {path}: it is a folder; give a file path")
    if not folder.is_dir():
        raise BadArgumentError(f"cannot write {path}: no folder {folder}; create it or choose another path")
    if path.exists() and not path.is_file():
        raise BadArgumentError(f"cannot write {path}: it is not a regular file (a FIFO or device); choose a file path")
    if not os.access(folder, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise BadArgumentError(f"cannot write {path}: permission denied; choose a writable path")


def is_gzip_name(path: Path) -> bool:
    return path.name.endswith(".gz")


def write_output(path: Path, text: str) -> None:
    """Write `text` as UTF-8 (gzip-compressed when the name ends in .gz) atomically (tracer/core/atomic_file.py);
    a failure is one line naming the path, and the previous file at it is kept."""
    data = text.encode("utf-8")
    if is_gzip_name(path):
        data = gzip.compress(data, compresslevel=GZIP_LEVEL, mtime=0)  # mtime 0: the same trace, the same bytes
    try:
        write_atomic(path, data)
    except OSError as exc:
        raise BadArgumentError(f"cannot write {path} ({exc.strerror or exc}); the previous file, if any, is kept; "
                               "choose a writable path or free some space") from exc


def read_input(path: Path, what: str, missing_hint: str = "") -> str:
    """The UTF-8 text of `path` ('-': standard input), gunzipped when it starts with gzip's magic bytes, whatever
    its name. `what` names the file in errors ("trace"); `missing_hint` follows "no file PATH"."""
    try:
        data = sys.stdin.buffer.read() if str(path) == STDIO else path.read_bytes()
    except FileNotFoundError:
        raise BadArgumentError(f"no file {path}{'; ' + missing_hint if missing_hint else ''}") from None
    except OSError as exc:
        raise BadArgumentError(f"cannot read {path} ({exc.strerror}); check the path") from exc
    if data[:2] == GZIP_MAGIC:
        try:
            data = gzip.decompress(data)
        except (OSError, EOFError, zlib.error) as exc:
            raise BadArgumentError(f"{path} is a damaged gzip file ({exc}); write the {what} again") from exc
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise BadArgumentError(f"{path} is not UTF-8 text ({exc}); is it a {what}?") from exc


def check_outputs(outputs: dict[str, Path | None], inputs: dict[str, Path | None] | None = None) -> None:
    """Refuse, before any work, two options writing one file and an output that would replace an input.

    `outputs` and `inputs` map an option's name (as the user typed it, e.g. "--json") to its path or None."""
    seen: dict[Path, str] = {}
    for option, path in (inputs or {}).items():
        if path is not None:
            seen[_identity(path)] = option
    for option, path in outputs.items():
        if path is None:
            continue
        key = _identity(path)
        if key in seen:
            other = seen[key]
            what = "the input it reads" if other in (inputs or {}) else f"{other} too"
            raise BadArgumentError(f"{option} {path} would overwrite {what}; give each output its own path")
        seen[key] = option


def _identity(path: Path) -> Path:
    """The path with links and `..` resolved, so that `t.json` and `./dir/../t.json` are the same file."""
    try:
        return path.resolve()
    except (OSError, RuntimeError):  # a symlink loop: compare as written
        return path.absolute()
