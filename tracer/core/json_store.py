"""The saved measurements' files (hardware.json, kernels.json, decode_kernels.json): one way to read and write them.

Each is one JSON object, `{"version": N, "<section>": {...}, ...}`, whose sections hold the records keyed by name
(profiles, machines, entries). The file comes from outside (hand edits, another llmtrace, a torn copy), so reading
it back turns every way it can be wrong into one typed, one-line error naming the file: absent is an empty store;
unreadable, not JSON (nested too deeply included: tracer/core/json_input.py), not an object, another version, or a
section that is not an object is the store's `problem`. Its caller decides what that means (a note and a fresh
measurement, or an error telling the user what to do). Checking the records inside the sections stays with each
store, which knows their fields. Writing is atomic (tracer/core/atomic_file.py) and creates the folder.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from llmtrace.tracer.core.atomic_file import write_atomic
from llmtrace.tracer.core.bounded_read import NotARegularFile, TooLarge, read_bounded
from llmtrace.tracer.core.errors import LlmtraceError
from llmtrace.tracer.core.json_input import parse_json


@dataclass(frozen=True, slots=True)
class StoreFormat:
    """What one kind of store file holds, and what its errors are."""

    name: str  # what messages call it: "kernel store"
    version: int  # the version this llmtrace reads and writes
    sections: tuple[str, ...]  # top-level objects holding the records, each {} in a new store
    problem: type[LlmtraceError]  # raised when the file cannot be read back
    unwritable: type[LlmtraceError]  # raised when it cannot be saved
    fix: str = ""  # what the user does about a problem, appended to its message ("" when the caller says it)
    older: str = ""  # why an older version is out of date ("before stored kernels were measured")
    added: tuple[str, ...] = ()  # sections added after files of this version were first written: absent reads as {}
    unversioned: bool = False  # a file without "version" is read as this version (hand-written files)

    def empty(self) -> dict[str, Any]:
        """A store with nothing saved yet."""
        return {"version": self.version, **{section: {} for section in self.sections}}


# A store holds a few records per machine and model (kernels.json ~2 KB an entry); one this large is not one llmtrace
# wrote, and reading it whole would only cost memory.
MAX_STORE_BYTES = 16 << 20


def read_store(path: Path, fmt: StoreFormat) -> dict[str, Any]:
    """The file's object, its version and sections checked; `fmt.empty()` when there is no file (or no folder).

    A FIFO, a device (or a symlink to one) or a file over MAX_STORE_BYTES is the store's `problem`, found without
    blocking or reading past the cap (tracer/core/bounded_read.py): its callers note it and measure again, as for
    any damaged store, and saving replaces it with a file."""
    try:
        raw = read_bounded(path, MAX_STORE_BYTES)
    except (FileNotFoundError, NotADirectoryError):
        return fmt.empty()
    except (NotARegularFile, TooLarge) as exc:
        raise _problem(fmt, path, f"cannot be read: {str(exc).removeprefix(f'{path} ')}") from None
    except OSError as exc:
        raise _problem(fmt, path, f"cannot read ({exc.strerror or exc}); check its permissions") from None
    data = parse_json(raw, str(path), fmt.problem, fmt.fix)
    if not isinstance(data, dict):
        raise _problem(fmt, path, f"not a version-{fmt.version} {fmt.name} (a JSON {_json_type(data)}, not an object)")
    version = data.get("version", fmt.version if fmt.unversioned else None)
    if not isinstance(version, int) or isinstance(version, bool):
        raise _problem(fmt, path, f"not a version-{fmt.version} {fmt.name} (version {version!r})")
    if version < fmt.version:
        why = f", {fmt.older}" if fmt.older else ""
        raise _problem(fmt, path, f"saved by an older llmtrace (version {version}{why})")
    if version > fmt.version:
        raise _problem(fmt, path, f"saved by a newer llmtrace (version {version}; this one reads {fmt.version})")
    for section in fmt.added:
        data.setdefault(section, {})
    for section in fmt.sections:
        if not isinstance(data.get(section), dict):
            raise _problem(fmt, path, f"no {section!r} object")
    return data


def write_store(path: Path, data: dict[str, Any], fmt: StoreFormat, saving: str) -> Path:
    """Save `data` (with this llmtrace's version) atomically, creating the folder; `fmt.unwritable` naming `saving`
    ("the profile") when the folder or the disk refuses."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, json.dumps({**data, "version": fmt.version}, indent=1, sort_keys=True) + "\n")
    except OSError as exc:
        raise fmt.unwritable(f"cannot save {saving} to {path} ({exc.strerror or exc}); set XDG_CONFIG_HOME to a "
                             "writable folder") from None
    return path


def _problem(fmt: StoreFormat, path: Path, what: str) -> LlmtraceError:
    return fmt.problem(f"{path}: {what}" + (f"; {fmt.fix}" if fmt.fix else ""))


def _json_type(value: Any) -> str:
    if isinstance(value, list):
        return "list"
    if isinstance(value, str):
        return "string"
    if value is None:
        return "null"
    return "boolean" if isinstance(value, bool) else "number"
