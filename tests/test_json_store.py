"""The one reader and writer of the saved measurements' files (tracer/core/json_store.py), and the three stores
that use it: every way a file can be wrong is one typed line naming the file, never a traceback."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

import pytest

from llmtrace.tracer.core.errors import BadArgumentError, ConfigError, LlmtraceError
from llmtrace.tracer.core.json_store import StoreFormat, read_store, write_store


class Damaged(ConfigError):
    """A stand-in problem class, so the tests see which class the reader raises."""


FMT = StoreFormat("test store", 3, ("things",), Damaged, BadArgumentError)
FIXED = StoreFormat("test store", 3, ("things",), Damaged, BadArgumentError, fix="delete it",
                    older="before things had names")
LEGACY = StoreFormat("test store", 1, ("things", "extras"), Damaged, BadArgumentError, added=("extras",),
                     unversioned=True)


def _problem(path: Path, fmt: StoreFormat = FMT) -> str:
    with pytest.raises(Damaged) as raised:
        read_store(path, fmt)
    message = str(raised.value)
    assert message.startswith(f"{path}: ") and "\n" not in message
    return message


def test_no_file_and_no_folder_read_as_an_empty_store(tmp_path: Path) -> None:
    assert read_store(tmp_path / "absent.json", FMT) == {"version": 3, "things": {}}
    (tmp_path / "a-file").write_text("x")
    assert read_store(tmp_path / "a-file" / "store.json", FMT) == {"version": 3, "things": {}}  # NotADirectoryError


@pytest.mark.parametrize("content, said", [
    (b'{"version": 3, "things": {"a": [1, 2', "not valid JSON (Expecting"),  # truncated mid-write
    (b"", "not valid JSON (Expecting value"),
    (b'{"version": 3, "things": {"\xff": 1}}', "not valid JSON (not UTF-8 at byte 27)"),
    (b"[" * 100_000 + b"]" * 100_000, "not valid JSON (nested too deeply)"),
])
def test_text_that_is_not_json(tmp_path: Path, content: bytes, said: str) -> None:
    path = tmp_path / "store.json"
    path.write_bytes(content)
    message = _problem(path)
    assert message.startswith(f"{path}: {said}") and not message.endswith("; ")


@pytest.mark.parametrize("content, said", [
    ("[]", "not a version-3 test store (a JSON list, not an object)"),
    ('"text"', "not a version-3 test store (a JSON string, not an object)"),
    ("3", "not a version-3 test store (a JSON number, not an object)"),
    ("null", "not a version-3 test store (a JSON null, not an object)"),
    ("true", "not a version-3 test store (a JSON boolean, not an object)"),
])
def test_a_top_level_value_that_is_not_an_object(tmp_path: Path, content: str, said: str) -> None:
    path = tmp_path / "store.json"
    path.write_text(content)
    assert _problem(path) == f"{path}: {said}"


@pytest.mark.parametrize("version, said", [
    (None, "not a version-3 test store (version None)"),  # no "version" key
    ("3", "not a version-3 test store (version '3')"),
    (True, "not a version-3 test store (version True)"),  # a bool is an int to Python, not a version
    (2, "saved by an older llmtrace (version 2)"),
    (4, "saved by a newer llmtrace (version 4; this one reads 3)"),
])
def test_another_version(tmp_path: Path, version: object, said: str) -> None:
    path = tmp_path / "store.json"
    data = {"things": {}} if version is None else {"version": version, "things": {}}
    path.write_text(json.dumps(data))
    assert _problem(path) == f"{path}: {said}"


def test_an_older_version_says_why_and_the_fix(tmp_path: Path) -> None:
    path = tmp_path / "store.json"
    path.write_text('{"version": 1, "things": {}}')
    assert _problem(path, FIXED) == f"{path}: saved by an older llmtrace (version 1, before things had names); delete it"
    path.write_text("{")
    assert _problem(path, FIXED).endswith("; delete it")


@pytest.mark.parametrize("content", ['{"version": 3}', '{"version": 3, "things": []}', '{"version": 3, "things": 1}'])
def test_a_section_that_is_not_an_object(tmp_path: Path, content: str) -> None:
    path = tmp_path / "store.json"
    path.write_text(content)
    assert _problem(path) == f"{path}: no 'things' object"


def test_an_unreadable_file(tmp_path: Path) -> None:
    path = tmp_path / "store.json"
    path.mkdir()  # reading a folder fails for root too, unlike a chmod
    assert _problem(path) == f"{path}: cannot read (Is a directory); check its permissions"


def test_an_unversioned_file_and_an_added_section(tmp_path: Path) -> None:
    path = tmp_path / "store.json"
    path.write_text('{"things": {"a": 1}}')
    assert read_store(path, LEGACY) == {"things": {"a": 1}, "extras": {}}
    path.write_text('{"things": {"a": 1}, "extras": []}')
    assert _problem(path, LEGACY) == f"{path}: no 'extras' object"
    path.write_text('{"extras": {}}')
    assert _problem(path, LEGACY) == f"{path}: no 'things' object"  # only the added section may be absent


def test_write_then_read_back(tmp_path: Path) -> None:
    path = tmp_path / "new" / "folder" / "store.json"
    data = {"things": {"b": {"x": 1.5}, "a": [1, "two"]}}
    assert write_store(path, data, FMT, "the things") == path
    assert read_store(path, FMT) == {"version": 3, **data}  # the version is stamped on
    assert path.read_text().endswith("\n") and json.loads(path.read_text())["version"] == 3
    assert sorted(p.name for p in path.parent.iterdir()) == ["store.json"]  # no temporary file left


def test_a_refused_write_is_the_unwritable_error(tmp_path: Path) -> None:
    blocker = tmp_path / "blocker"
    blocker.write_text("a file where the folder should be")
    with pytest.raises(BadArgumentError) as raised:
        write_store(blocker / "store.json", {"things": {}}, FMT, "the things")
    message = str(raised.value)
    assert message.startswith(f"cannot save the things to {blocker / 'store.json'} (")
    assert message.endswith("; set XDG_CONFIG_HOME to a writable folder") and "\n" not in message


# ---- the three stores read through it -------------------------------------------------------------------------


def _kernel_store(path: Path) -> object:
    from llmtrace.tracer.hardware import kernel_store
    return kernel_store.load_choice("m", "x", path)


def _decode_ceilings(path: Path) -> object:
    from llmtrace.tracer.hardware import decode_ceilings
    return decode_ceilings.load_ceilings("cpu", "shapes", "dense fp32", path)


def _hardware(path: Path) -> object:
    from llmtrace.tracer.hardware import store
    return store.load_measured_profiles(path)


@pytest.mark.parametrize("load, problem, fix", [
    (_kernel_store, "StoreProblem", ""),
    (_decode_ceilings, "DecodeCeilingsProblem", ""),
    (_hardware, "HardwareError", "; delete it and run `llmtrace hardware --measure`"),
])
@pytest.mark.parametrize("content, said", [
    (b"[" * 100_000, "not valid JSON (nested too deeply)"),  # json.loads raises RecursionError, not ValueError
    (b"\xff{}", "not valid JSON (not UTF-8 at byte 0)"),
    (b'{"version": 99}', "saved by a newer llmtrace (version 99;"),
])
def test_each_store_reports_a_damaged_file_in_one_line(tmp_path: Path, load: Callable[[Path], object],
                                                       problem: str, fix: str, content: bytes, said: str) -> None:
    path = tmp_path / "store.json"
    path.write_bytes(content)
    with pytest.raises(LlmtraceError) as raised:
        load(path)
    message = str(raised.value)
    assert type(raised.value).__name__ == problem
    assert message.startswith(f"{path}: {said}") and message.endswith(fix) and "\n" not in message
