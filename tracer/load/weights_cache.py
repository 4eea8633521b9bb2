"""A cache of converted weights: a GGUF file's dequantized, renamed tensors saved once as safetensors.

Where: the cache folder (llmtrace.tracer.core.cache_dirs: $LLMTRACE_CACHE_DIR, $XDG_CACHE_HOME/llmtrace or
~/.cache/llmtrace); entries go in its `weights/` folder, what is known about each source file in `weights/sources/`.

Never the wrong weights. An entry is found by the CONTENT of its source, not by where the source lies or what its
size and modification time say: `cp -p`, `rsync -t`, `touch -r` and archive extraction all write new bytes under an
old size and mtime, and a cache keyed on (path, size, mtime) served the old weights after them. The key is
  {source stem}-{XXH3-128 of the whole source file}-{dtype}-{CACHE_FORMAT}.safetensors
so a rewritten file, whatever its timestamps, is a different key, and two copies of one file share an entry.

Hashing a multi-GB GGUF on every load would cost seconds (a 7B Q4 file is ~4 GB), so the digest is computed once
and remembered, in `sources/`, next to the file's identity: (device, inode, size, mtime_ns, ctime_ns). Any write
to the file changes its ctime, and ctime cannot be set from user space (`touch -r`, `cp -p`, `rsync -t` and tar set
mtime only; changing the clock is the one way round it), so an unchanged identity means unchanged bytes and the
remembered digest is reused; a changed one (even a chmod) only costs one more hash, never a reconversion of equal
bytes. File systems stamp times from a coarse clock (ext4: one tick, ~4 ms), so a rewrite within the same tick as
the hash could keep the identity; as git does for its "racily clean" index entries, a digest is only remembered
when the file's last change is at least RACY_SECONDS older than the hash, otherwise the next load hashes again.
The file is stat'ed before hashing and again before the entry is stored: a file changed meanwhile gets no entry.
A load passes its opened source (tracer/load/gguf_source.py): the identity is its descriptor's, the hash is read
through it, and the entry is stored only when the conversion's own pass hashed to the same digest. A memo is read
without following a symlink, without blocking on a FIFO and up to a cap (tracer/core/bounded_read.py); one that is
not a small regular file is ignored, with a note, and the source hashed again.

Never damaged weights. Each entry's header records XXH3-128 of the whole entry (its header too, read with this
value as the placeholder it was written over), and every load checks it before the tensors are used: zeroed pages,
a NaN written into a weight, a torn copy, a header whose offsets, shapes or dtypes were changed all fail the check,
and the entry is removed and converted again (CachedWeights.note says so in one line); so is an entry that passes
it but then fails to load or to fit the model. The check reads the entry with read(), not through a map: an entry
truncated under it is a short read, not SIGBUS. XXH3 is not a
cryptographic hash: it guards against accidents, not against someone who can already write the cache folder. It
is the fastest well-kept checksum here (the `xxhash` package; BENCHMARKS.md "Weights cache checks" measures it
against hashlib's sha256 and blake2b, zlib's crc32 and the load it guards).

Creation is locked per entry (an flock on `<entry>.lock`): two first loads at once convert once, the second waits
and maps the first's entry. Entries are written to `<entry>.<pid>.partial` and renamed whole; partial files left by
a killed run are removed by the next store or eviction once their writer is gone.

Size: at most $LLMTRACE_CACHE_MAX_GB gigabytes (default 20; a 7B model is ~13.5 GB in bf16). After a store, the
least recently used entries go until the rest fit; a load marks its entry used (its mtime). The entry just
written always stays, even when it alone is over the cap.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import torch
import xxhash
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from llmtrace.tracer.checkpoint.safetensors_header import read_safetensors_header
from llmtrace.tracer.core.atomic_file import write_atomic
from llmtrace.tracer.core.bounded_read import NotARegularFile, TooLarge, read_bounded
from llmtrace.tracer.core.cache_dirs import CACHE_ENV, cache_root, private_folder
from llmtrace.tracer.core.errors import LlmtraceError
from llmtrace.tracer.load.gguf_source import OpenedFile

# bump when the conversion (names, Q/K order, dequantization) or the entry layout changes; 3: the checksum covers the
# entry's header; 4: i8dot's Q4_0/Q4_1 "groups" (held in a per-type plan's entry) interleave sixteen rows, not eight
CACHE_FORMAT = "4"
MAX_GB_ENV = "LLMTRACE_CACHE_MAX_GB"
DEFAULT_MAX_GB = 20.0
RACY_SECONDS = 2.0  # a digest is remembered only for a file unchanged this long before it was hashed
PARTIAL_SUFFIX = ".partial"
_CHUNK = 16 * 2**20
_CHECKSUM_KEY = "entry_xxh3_128"  # in each entry's __metadata__
_MEMO_MAX = 64 << 10  # a memo is ~300 bytes
_PLACEHOLDER = "0" * 32  # the width of an XXH3-128 hex digest: written first, replaced in place
_MAX_HEADER = 100 << 20  # safetensors' own cap on a header
_OWN_KEYS = frozenset({"source", "format", "source_xxh3_128", _CHECKSUM_KEY})  # metadata the cache itself writes


def weights_dir() -> Path:
    """The cache folder's weights/, once trusted (UntrustedPathError when another user could write it or the cache
    folder: tracer/core/cache_dirs.py); not created here."""
    private_folder(cache_root(), "cache folder", CACHE_ENV)
    return private_folder(cache_root() / "weights", "weights cache folder", CACHE_ENV)


# ---- what the source is ------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class SourceKey:
    """A source file as the cache knows it: its content digest and the identity it had when that was taken."""

    path: Path  # absolute
    digest: str  # XXH3-128 of the whole file, hex
    identity: tuple[int, ...]  # (st_dev, st_ino, st_size, st_mtime_ns, st_ctime_ns)
    note: str = field(default="", compare=False)  # one line when the memo was not a file to trust


def _identity(st: os.stat_result) -> tuple[int, ...]:
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def _path_digest(path: Path) -> str:
    return hashlib.sha256(str(path).encode("utf-8")).hexdigest()[:16]


def _memo_path(path: Path) -> Path:
    return weights_dir() / "sources" / f"{_path_digest(path)}.json"


def hash_file(source: Path | OpenedFile) -> str:
    """XXH3-128 of the file's bytes (hex): an OpenedFile's read through its descriptor, a path's streamed in 16 MiB
    chunks."""
    if isinstance(source, OpenedFile):
        return source.hash_file()
    h = xxhash.xxh3_128()
    with open(source, "rb") as fh:
        while chunk := fh.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def source_key(source: str | Path | OpenedFile) -> SourceKey:
    """The content key of `source`: the remembered digest while its identity is unchanged, else a fresh hash. An
    OpenedFile (a load's GGUFSource) is hashed through its descriptor, with the identity it was opened with; a
    path is opened here (OSError when it cannot be)."""
    if not isinstance(source, OpenedFile):
        try:
            with OpenedFile(source) as opened:
                return source_key(opened)
        except LlmtraceError as exc:
            raise OSError(str(exc)) from None
    path = source.path.resolve()
    identity = source.identity
    memo = _memo_path(path)
    known, note = _read_memo(memo)
    if known is not None and known.get("identity") == list(identity) and isinstance(known.get("digest"), str):
        return SourceKey(path, known["digest"], identity, note)
    started_ns = time.time_ns()
    digest = hash_file(source)
    if source.now() == identity and started_ns - max(identity[3], identity[4]) >= RACY_SECONDS * 1e9:
        try:
            memo.parent.mkdir(parents=True, exist_ok=True)
            write_atomic(memo, json.dumps({"path": str(path), "identity": list(identity), "digest": digest}))
        except OSError:
            pass  # a read-only cache: hash again next time
    return SourceKey(path, digest, identity, note)


def _read_memo(memo: Path) -> tuple[dict | None, str]:
    """The memo's object (None when there is none or it is unreadable: hash), and a note when what lies at its
    path is not a small regular file (a FIFO would block a plain open, /dev/zero would fill memory): written over
    once the source is hashed."""
    try:
        known = json.loads(read_bounded(memo, _MEMO_MAX, follow_links=False))
    except (NotARegularFile, TooLarge) as exc:
        return None, f"weights cache: {exc}; ignored, the source hashed again"
    except (OSError, ValueError, RecursionError):
        return None, ""  # none yet, or unreadable: hash
    return (known if isinstance(known, dict) else None), ""


# What an entry holds: a dtype (the dequantized tensors in it) or a variant name ("stored-int4pack-float32": the
# matrices as stored, packed for a kernel, beside the rest in that dtype).
Variant = torch.dtype | str


def _entry_path(key: SourceKey, dtype: Variant) -> Path:
    dtype_name = dtype if isinstance(dtype, str) else str(dtype).removeprefix("torch.")
    return weights_dir() / f"{key.path.stem}-{key.digest[:32]}-{dtype_name}-{CACHE_FORMAT}.safetensors"


def cache_path(source: str | Path | SourceKey, dtype: Variant) -> Path:
    """The cache file for this source's current content, in this dtype."""
    key = source if isinstance(source, SourceKey) else source_key(source)
    return _entry_path(key, dtype)


# ---- reading -----------------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class CachedWeights:
    """What a cache lookup found: the state dict (None: convert), a one-line note when an entry was dropped, and
    the entry's own metadata (what store() was given, e.g. the formats of packed weights)."""

    state: dict[str, torch.Tensor] | None
    note: str = ""
    metadata: dict[str, str] | None = None


def entry_checksum(path: Path) -> str:
    """XXH3-128 of the entry at `path`, all of it, its checksum field read as the placeholder store() wrote before
    it was known (so the header is covered too); OSError when the file holds no such field exactly once. Read with
    read(), never a map: a file truncated under the read is a short one here, where a map would raise SIGBUS."""
    h = xxhash.xxh3_128()
    with open(path, "rb") as fh:
        prefix = fh.read(8)
        n = int.from_bytes(prefix, "little") if len(prefix) == 8 else -1
        raw = fh.read(n) if 0 <= n <= _MAX_HEADER else b""
        if len(raw) != n or n < 0:
            raise OSError(f"{path}: torn header")
        start = raw.find(f'"{_CHECKSUM_KEY}":"'.encode())
        end = start + len(_CHECKSUM_KEY) + 4 + len(_PLACEHOLDER) + 1  # past the value's closing quote
        if start < 0 or raw.count(f'"{_CHECKSUM_KEY}":'.encode()) != 1 or raw[end - 1:end] != b'"':
            raise OSError(f"{path}: no checksum field in the header")
        h.update(prefix)
        h.update(raw[:start])
        h.update(f'"{_CHECKSUM_KEY}":"{_PLACEHOLDER}"'.encode())
        h.update(raw[end:])
        buf = bytearray(_CHUNK)
        view = memoryview(buf)
        try:
            while k := fh.readinto(buf):
                h.update(view[:k])
        finally:
            view.release()
    return h.hexdigest()


def load_cached(source: str | Path | SourceKey, dtype: Variant) -> CachedWeights:
    """The cached state dict, memory-mapped, after its checksum is verified; an entry that fails the check, or that
    cannot be loaded once it passes, is removed (the note says why): the caller converts again."""
    try:
        key = source if isinstance(source, SourceKey) else source_key(source)
    except OSError:
        return CachedWeights(None)
    path = _entry_path(key, dtype)
    if not path.is_file():
        return CachedWeights(None)
    why = _damage(path, key)
    if why:
        return dropped(path, f"was damaged ({why})")
    try:
        state = load_file(path)
        extra = read_safetensors_header(path).metadata
    except Exception as exc:  # noqa: BLE001 - whatever a checked entry still raises, the cure is to convert again
        return dropped(path, f"was unreadable ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})")
    if isinstance(dtype, torch.dtype):
        wrong = sorted({str(t.dtype).removeprefix("torch.") for t in state.values() if t.dtype != dtype})
        if wrong:
            return dropped(path, f"holds {', '.join(wrong)} tensors, not {str(dtype).removeprefix('torch.')}")
    try:
        os.utime(path)  # used now: the last to be evicted
    except OSError:
        pass  # a read-only cache still serves
    return CachedWeights(state, metadata={k: v for k, v in extra.items() if k not in _OWN_KEYS})


def dropped(path: Path, why: str) -> CachedWeights:
    """Remove the entry at `path`; the lookup's answer: convert again, and a note saying why."""
    path.unlink(missing_ok=True)
    return CachedWeights(None, f"weights cache: {path.name} {why}; converting again")


def _damage(path: Path, key: SourceKey) -> str:
    """Why the entry at `path` cannot be trusted, or "" when its header and checksum hold."""
    try:
        header = read_safetensors_header(path)
    except LlmtraceError:
        return "its header is torn or malformed"
    meta = header.metadata
    if meta.get("format") != CACHE_FORMAT or meta.get("source_xxh3_128") != key.digest:
        return "it was written for other source bytes or by another llmtrace"
    try:
        actual = entry_checksum(path)
    except (OSError, ValueError):
        return "its bytes cannot be read or its header has no checksum"
    if actual != meta.get(_CHECKSUM_KEY):
        return "its bytes fail their checksum"
    return ""


# ---- writing -----------------------------------------------------------------------------------------------------


@contextmanager
def creating(source: str | Path | SourceKey, dtype: Variant) -> Iterator[None]:
    """Hold the entry's creation lock: a second process converting the same source waits, then finds the entry.

    A cache folder that cannot be written (or a platform without flock) only loses the lock, never the load."""
    try:
        key = source if isinstance(source, SourceKey) else source_key(source)
        lock_path = _entry_path(key, dtype).with_suffix(".lock")
        lock_path.parent.mkdir(parents=True, exist_ok=True)
        # no symlink followed, no FIFO waited on (opening one to write blocks until a reader comes)
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0)
                     | getattr(os, "O_CLOEXEC", 0), 0o666)
        handle = os.fdopen(fd, "r+b")
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            handle.close()
            raise OSError(f"{lock_path} is not a regular file")
    except OSError:
        yield
        return
    try:
        import fcntl

        fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
    except (ImportError, OSError):
        pass
    try:
        yield
    finally:
        handle.close()  # releases the flock


def store(source: str | Path | SourceKey, dtype: Variant, state_dict: dict[str, torch.Tensor],
          metadata: dict[str, str] | None = None) -> Path | None:
    """Save the converted tensors with their checksums (a temporary name, then a rename: readers never see half).

    Returns the cache file, or None when it was not stored: the cache folder is not writable (a full or read-only
    disk only costs speed, never the load), or the source changed since it was hashed (its entry would lie).
    Older entries of the same source path are removed.
    """
    try:
        key = source if isinstance(source, SourceKey) else source_key(source)
        if _identity(key.path.stat()) != key.identity:
            return None  # rewritten while it was converted: these tensors may match neither version
        path = _entry_path(key, dtype)
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(f"{path.name}.{os.getpid()}{PARTIAL_SUFFIX}")
        try:
            tensors = {k: v.contiguous() for k, v in state_dict.items()}
            own = {"source": str(key.path), "format": CACHE_FORMAT, "source_xxh3_128": key.digest,
                   _CHECKSUM_KEY: _PLACEHOLDER}
            save_file(tensors, partial, metadata={**(metadata or {}), **own})
            _write_checksum(partial, entry_checksum(partial))
            os.replace(partial, path)
        finally:
            partial.unlink(missing_ok=True)
        _remove_superseded(key, path)
        evict(path.parent, max_bytes(), keep=path)
        return path
    except (OSError, SafetensorError, LlmtraceError):  # SafetensorError wraps I/O failures such as a full disk
        return None


def _write_checksum(partial: Path, checksum: str) -> None:
    """Put `checksum` in place of the placeholder in `partial`'s header. save_file cannot checksum bytes it has
    not written yet; replacing a fixed-width value in place keeps the header's length, so it is one write, and
    entry_checksum reads the value back as the placeholder it replaced."""
    with open(partial, "r+b") as fh:
        n = int.from_bytes(fh.read(8), "little")
        raw = fh.read(n)
        field = f'"{_CHECKSUM_KEY}":"{_PLACEHOLDER}"'.encode()
        at = raw.find(field)
        if at < 0 or raw.count(field) != 1:
            raise OSError(f"{partial}: no checksum placeholder in the header")
        fh.seek(8 + at)
        fh.write(f'"{_CHECKSUM_KEY}":"{checksum}"'.encode())
        fh.flush()
        os.fsync(fh.fileno())


def _remove_superseded(key: SourceKey, keep: Path) -> None:
    """Entries this source path had for older contents (any dtype's digest other than the current one), or in an
    older entry format (their names end in another CACHE_FORMAT: never looked up again)."""
    stem = key.path.stem
    for old in keep.parent.glob(f"{stem}-*.safetensors"):
        if old == keep or (key.digest[:32] in old.name and old.name.endswith(f"-{CACHE_FORMAT}.safetensors")):
            continue
        try:
            source = read_safetensors_header(old).metadata.get("source")
        except LlmtraceError:
            source = None
        if source == str(key.path):
            old.unlink(missing_ok=True)


def max_bytes() -> int:
    """The cache's size cap in bytes ($LLMTRACE_CACHE_MAX_GB, GB = 1e9 B; the default when unset or not a number)."""
    try:
        gigabytes = float(os.environ.get(MAX_GB_ENV, DEFAULT_MAX_GB))
    except ValueError:
        gigabytes = DEFAULT_MAX_GB
    if gigabytes != gigabytes:  # NaN
        gigabytes = DEFAULT_MAX_GB
    return int(min(max(gigabytes, 0.0), 1e9) * 1e9)


def _writer_alive(partial: Path) -> bool:
    """Whether the process named in `<entry>.<pid>.partial` still runs (it may still be writing)."""
    try:
        pid = int(partial.name[: -len(PARTIAL_SUFFIX)].rsplit(".", 1)[1])
    except (IndexError, ValueError):
        return False
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's live process
    return True


def evict(folder: Path, limit: int, keep: Path) -> list[Path]:
    """Remove leftovers of killed writes, then the least recently used entries of `folder` until the rest fit in
    `limit` bytes; never `keep`. Partial files of live writers count towards the size. Returns what was removed."""
    removed = []
    entries = []
    for entry in folder.iterdir():
        if not (entry.name.endswith(".safetensors") or entry.name.endswith(PARTIAL_SUFFIX)):
            continue
        try:
            st = entry.stat()
        except OSError:
            continue  # removed meanwhile
        if not stat.S_ISREG(st.st_mode):
            continue
        if entry.name.endswith(PARTIAL_SUFFIX):
            if not _writer_alive(entry):
                entry.unlink(missing_ok=True)
                removed.append(entry)
                continue
            entries.append((st.st_mtime_ns, st.st_size, entry, False))  # counted, never evicted
            continue
        entries.append((st.st_mtime_ns, st.st_size, entry, True))
    total = sum(size for _, size, _, _ in entries)
    for _, size, entry, evictable in sorted(entries):  # oldest use first
        if total <= limit:
            break
        if entry == keep or not evictable:
            continue
        entry.unlink(missing_ok=True)
        entry.with_suffix(".lock").unlink(missing_ok=True)
        total -= size
        removed.append(entry)
    return removed
