"""A cache of converted weights: a GGUF file's dequantized, renamed tensors saved once as safetensors.

Where: $LLMTRACE_CACHE_DIR if set, else $XDG_CACHE_HOME/llmtrace, else ~/.cache/llmtrace; files go in its
`weights/` folder. Key: the source file's absolute path, size and modification time, the dtype, and
CACHE_FORMAT (bumped whenever the conversion changes), so an edited or replaced source file, or a new llmtrace
that converts differently, never reads stale weights. A newer entry for the same source and dtype replaces the
older. Reading memory-maps the file (safetensors), so a cached load costs page-cache reads, not dequantization.

Size: at most $LLMTRACE_CACHE_MAX_GB gigabytes (default 20; a 7B model is ~13.5 GB in bf16). After a store, the
least recently used entries go until the rest fit; a load marks its entry used (its mtime). The entry just
written always stays, even when it alone is over the cap.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

CACHE_FORMAT = "1"  # bump when the conversion (names, Q/K order, dequantization) changes
CACHE_ENV = "LLMTRACE_CACHE_DIR"
MAX_GB_ENV = "LLMTRACE_CACHE_MAX_GB"
DEFAULT_MAX_GB = 20.0


def cache_root() -> Path:
    """The llmtrace cache folder ($LLMTRACE_CACHE_DIR, $XDG_CACHE_HOME/llmtrace or ~/.cache/llmtrace)."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "llmtrace"


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]


def cache_path(source: str | Path, dtype: torch.dtype) -> Path:
    """The cache file for this source file's current size and mtime, in this dtype."""
    source = Path(source).resolve()
    stat = source.stat()
    dtype_name = str(dtype).removeprefix("torch.")
    version = _digest(f"{stat.st_size}|{stat.st_mtime_ns}|{CACHE_FORMAT}")
    return cache_root() / "weights" / f"{source.stem}-{_digest(str(source))}-{dtype_name}-{version}.safetensors"


def load_cached(source: str | Path, dtype: torch.dtype) -> dict[str, torch.Tensor] | None:
    """The cached state dict, memory-mapped, or None when absent or unreadable (an unreadable entry is removed)."""
    try:
        path = cache_path(source, dtype)
    except OSError:
        return None
    if not path.is_file():
        return None
    try:
        state = load_file(path)
    except (SafetensorError, OSError, ValueError, RuntimeError):
        path.unlink(missing_ok=True)  # a torn or corrupt entry: convert again rather than fail
        return None
    try:
        os.utime(path)  # used now: the last to be evicted
    except OSError:
        pass  # a read-only cache still serves
    return state


def store(source: str | Path, dtype: torch.dtype, state_dict: dict[str, torch.Tensor]) -> Path | None:
    """Save the converted tensors (written to a temporary name, then renamed, so readers never see half a file).

    Returns the cache file, or None when the cache folder is not writable (a full or read-only disk only costs
    speed, never the load). Older entries for the same source and dtype are removed.
    """
    try:
        path = cache_path(source, dtype)
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(f"{path.name}.{os.getpid()}.partial")
        try:
            save_file({k: v.contiguous() for k, v in state_dict.items()}, partial,
                      metadata={"source": str(Path(source).resolve()), "format": CACHE_FORMAT})
            os.replace(partial, path)
        finally:
            partial.unlink(missing_ok=True)
        stem = path.name.rsplit("-", 1)[0]  # everything but the size/mtime/format digest
        for old in path.parent.glob(f"{stem}-*.safetensors"):
            if old != path:
                old.unlink(missing_ok=True)
        evict(path.parent, max_bytes(), keep=path)
        return path
    except (OSError, SafetensorError):  # SafetensorError wraps I/O failures such as a full disk
        return None


def max_bytes() -> int:
    """The cache's size cap in bytes ($LLMTRACE_CACHE_MAX_GB, GB = 1e9 B; the default when unset or not a number)."""
    try:
        gigabytes = float(os.environ.get(MAX_GB_ENV, DEFAULT_MAX_GB))
    except ValueError:
        gigabytes = DEFAULT_MAX_GB
    return int(max(gigabytes, 0.0) * 1e9)


def evict(folder: Path, limit: int, keep: Path) -> list[Path]:
    """Remove the least recently used entries of `folder` until the rest fit in `limit` bytes; never `keep`.
    Returns what was removed."""
    entries = []
    for entry in folder.glob("*.safetensors"):
        try:
            stat = entry.stat()
        except OSError:
            continue  # removed meanwhile
        entries.append((stat.st_mtime_ns, stat.st_size, entry))
    total = sum(size for _, size, _ in entries)
    removed = []
    for _, size, entry in sorted(entries):  # oldest use first
        if total <= limit:
            break
        if entry == keep:
            continue
        entry.unlink(missing_ok=True)
        total -= size
        removed.append(entry)
    return removed
