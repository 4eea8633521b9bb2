"""Read a small file llmtrace keeps (a saved store, a cache memo) without trusting what lies at its path.

What lies there may be a FIFO (open() blocks until a writer comes: forever), a device or a symlink to one
(/dev/zero reads without end: a plain read_bytes grew to 2.5 GB), or a file far larger than anything llmtrace
writes. So the file is opened with O_NONBLOCK (a FIFO's open returns at once), checked through its descriptor to
be a regular file (no race between a check of the path and the open), and read up to a cap. O_NOFOLLOW where the
caller asks: for files only llmtrace writes (the weights cache's memos); a user's config files may be symlinks
(dotfiles kept in a repository), so those follow links and rely on the regular-file check.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path


class NotARegularFile(OSError):
    """The path holds a FIFO, a device, a socket or (with follow_links=False) a symlink."""


class TooLarge(OSError):
    """The file holds more than the caller's cap."""


def _kind(mode: int) -> str:
    if stat.S_ISFIFO(mode):
        return "a FIFO"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    if stat.S_ISSOCK(mode):
        return "a socket"
    return "not a regular file"


def read_bounded(path: Path, limit: int, *, follow_links: bool = True) -> bytes:
    """The bytes of the regular file at `path`, at most `limit` of them. FileNotFoundError/NotADirectoryError when
    absent; IsADirectoryError for a folder; NotARegularFile (its message names what is there) or TooLarge, both
    OSErrors; other OSErrors as raised."""
    flags = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)
    if not follow_links:
        flags |= getattr(os, "O_NOFOLLOW", 0)
    try:
        fd = os.open(path, flags)
    except OSError as exc:
        if not follow_links and os.path.islink(path):  # ELOOP: O_NOFOLLOW met a symlink
            raise NotARegularFile(f"{path} is a symlink") from None
        raise exc
    try:
        st = os.fstat(fd)
        if stat.S_ISDIR(st.st_mode):  # as a plain read of a folder says
            raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), str(path))
        if not stat.S_ISREG(st.st_mode):
            raise NotARegularFile(f"{path} is {_kind(st.st_mode)}, not a regular file")
        parts, got = [], 0
        while got <= limit:  # one byte past the cap tells a file over it from one exactly at it
            chunk = os.read(fd, min(1 << 20, limit + 1 - got))
            if not chunk:
                break
            parts.append(chunk)
            got += len(chunk)
        if got > limit:
            raise TooLarge(f"{path} holds over {limit} bytes, more than llmtrace ever writes there")
        return b"".join(parts)
    finally:
        os.close(fd)
