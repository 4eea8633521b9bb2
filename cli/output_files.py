"""Files a command writes (a trace, a Chrome trace) and reads back: checked before the work, written atomically
(a reader never sees half a file, a failed write never clobbers the old one), gzip when the name ends in .gz, and
one-line errors."""

from __future__ import annotations

import gzip
import os
import sys
import tempfile
import zlib
from pathlib import Path

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
    if not os.access(folder, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise BadArgumentError(f"cannot write {path}: permission denied; choose a writable path")


def is_gzip_name(path: Path) -> bool:
    return path.name.endswith(".gz")


def write_output(path: Path, text: str) -> None:
    """Write `text` as UTF-8 (gzip-compressed when the name ends in .gz) through a temporary file in the same
    folder, renamed over `path` when complete; a failure is one line naming the path."""
    data = text.encode("utf-8")
    if is_gzip_name(path):
        data = gzip.compress(data, compresslevel=GZIP_LEVEL, mtime=0)  # mtime 0: the same trace, the same bytes
    folder = path.parent if str(path.parent) else Path(".")
    partial = None
    try:
        fd, partial = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".partial", dir=folder)
        with os.fdopen(fd, "wb") as out:
            out.write(data)
        os.chmod(partial, 0o666 & ~_umask())
        os.replace(partial, path)
        partial = None
    except OSError as exc:
        raise BadArgumentError(f"cannot write {path} ({exc.strerror}); choose a writable path") from exc
    finally:
        if partial is not None and os.path.exists(partial):
            os.unlink(partial)


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


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask
