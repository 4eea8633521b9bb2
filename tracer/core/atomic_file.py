"""Write a file so that its path holds either the old content or the whole new content, never half of either.

The text goes to a temporary file in the same folder (same file system, so the rename is atomic), is flushed to
disk with fsync, then renamed over the path. A write that fails midway (a full disk, an interrupt) removes the
temporary file and leaves the previous file at the path untouched. Each writer gets its own temporary name
(mkstemp), so two processes saving at once never remove each other's file; the last rename wins whole.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

PARTIAL_SUFFIX = ".partial"


def write_atomic(path: str | Path, content: str | bytes) -> None:
    """Write `content` (text as UTF-8, or bytes) to `path` atomically; OSError when the folder or the disk refuses."""
    path = Path(path)
    folder = path.parent if str(path.parent) else Path(".")
    data = content.encode("utf-8") if isinstance(content, str) else content
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{path.name}.", suffix=PARTIAL_SUFFIX)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.chmod(tmp, _default_mode(path))
        os.replace(tmp, path)
    except BaseException:  # KeyboardInterrupt included: never leave the temporary file behind
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def _default_mode(path: Path) -> int:
    """The mode of the file being replaced, or what a plain open() would create (0o666 less the umask)."""
    try:
        return path.stat().st_mode & 0o777
    except OSError:
        umask = os.umask(0)
        os.umask(umask)
        return 0o666 & ~umask
