"""Where llmtrace keeps what it makes once and reuses (converted weights, compiled kernels), and whether it may trust
what is there. Pure Python.

$LLMTRACE_CACHE_DIR if set, else $XDG_CACHE_HOME/llmtrace, else ~/.cache/llmtrace. Each user of the cache owns one
folder under it (weights/: llmtrace.tracer.load.weights_cache; native/: llmtrace.tracer.model.native_kernel).

A cache folder holds code this process runs (the compiled kernel is dlopened, and dlopen runs a library's
constructors before anything can check it) and weights it computes with; the config folder holds the saved kernel
choices and hardware profiles. So, as ssh does with ~/.ssh and pip with its cache, llmtrace refuses (one line,
UntrustedPathError) a folder that another user could have written: one that is not the user's own or that group or
others may write, or one reached through a folder that another user owns or may write (a world-writable folder is
allowed on the way only with its sticky bit, as /tmp has: others can then not rename or remove what is ours). A
folder that does not exist yet is fine: whoever creates it, llmtrace does, as the user.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from llmtrace.tracer.core.errors import LlmtraceError

CACHE_ENV = "LLMTRACE_CACHE_DIR"


class UntrustedPathError(LlmtraceError):
    """A cache or config folder, or a file in one, that another user could have written."""


def cache_root() -> Path:
    """The llmtrace cache folder ($LLMTRACE_CACHE_DIR, $XDG_CACHE_HOME/llmtrace or ~/.cache/llmtrace)."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "llmtrace"


def private_folder(path: Path, what: str, setting: str, create: bool = False) -> Path:
    """`path` once it is trusted: the user's own, written by no one else, reached only through folders that no other
    user can change (UntrustedPathError naming the folder, why, and `setting`, the variable that moves it, otherwise).
    `create`: make it (and its parents) first, private to the user (0o700). A folder that does not exist is returned
    unchecked when not created."""
    if create:
        _check_chain(path, what, setting)  # never create inside a folder another user controls
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
    if not create and not path.exists():
        return path
    _check_chain(path, what, setting)
    return path


def check_owned_file(fd: int, path: Path, what: str) -> os.stat_result:
    """The fstat of an opened file once it is a regular file of the user's own that group and others cannot write
    (UntrustedPathError otherwise): a file inside a private folder may still have been chmod-ed or chown-ed."""
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        raise UntrustedPathError(f"{what} {path} is not a regular file; delete it and run again")
    if st.st_uid != os.geteuid():
        raise UntrustedPathError(f"{what} {path} belongs to uid {st.st_uid}, not to you (uid {os.geteuid()}): "
                                 f"llmtrace will not load it; delete it and run again")
    if st.st_mode & 0o022:
        raise UntrustedPathError(f"{what} {path} can be written by {_writers(st.st_mode)} (mode "
                                 f"{stat.S_IMODE(st.st_mode):04o}): llmtrace will not load it; delete it and run again")
    return st


def _check_chain(path: Path, what: str, setting: str) -> None:
    """The folder itself (when it exists) must be the user's and not writable by group or others; every folder
    above it, as written and as symlinks resolve, the user's or root's and, when others may write it, sticky."""
    absolute = Path(os.path.abspath(path))
    real = Path(os.path.realpath(path))
    fix = f"set {setting} to a folder only you can write"
    uid = os.geteuid()
    try:
        st = os.stat(real)
    except FileNotFoundError:
        st = None
    except OSError as exc:
        raise UntrustedPathError(f"cannot check the {what} {path} ({exc.strerror or exc}); {fix}") from None
    if st is not None and stat.S_ISDIR(st.st_mode):  # not a folder: nothing can be read from it (its use fails)
        if st.st_uid != uid:
            raise UntrustedPathError(f"the {what} {path} belongs to uid {st.st_uid}, not to you (uid {uid}), who could "
                                     f"plant code or data llmtrace would use; {fix}")
        if st.st_mode & 0o022:
            raise UntrustedPathError(f"the {what} {path} can be written by {_writers(st.st_mode)} (mode "
                                     f"{stat.S_IMODE(st.st_mode):04o}), who could plant code or data llmtrace would "
                                     f"use; run `chmod go-w {path}` or {fix}")
    seen = set()
    for parent in (*absolute.parents, *real.parents):
        if parent in seen:
            continue
        seen.add(parent)
        try:
            pst = os.stat(parent)
        except FileNotFoundError:
            continue  # not created yet
        except OSError:
            continue  # not searchable: the folder itself then cannot be reached either, which its use reports
        if pst.st_uid not in (uid, 0):
            raise UntrustedPathError(f"the {what} {path} is inside {parent}, which belongs to uid {pst.st_uid}, who "
                                     f"could replace it; {fix}")
        if pst.st_mode & 0o022 and not pst.st_mode & stat.S_ISVTX:
            raise UntrustedPathError(f"the {what} {path} is inside {parent}, which {_writers(pst.st_mode)} can write "
                                     f"(mode {stat.S_IMODE(pst.st_mode):04o}, no sticky bit) and so replace it; {fix}")


def _writers(mode: int) -> str:
    return " and ".join(who for who, bit in (("its group", 0o020), ("others", 0o002)) if mode & bit)
