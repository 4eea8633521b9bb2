"""The weights cache never serves wrong weights (issue 10): it is keyed on the source's content, checks every entry's
tensor bytes before use, cleans what killed writes leave, and locks each entry's creation."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Callable

import pytest
import torch
from tiny_gguf import sentencepiece_vocab, write_tiny_gguf

from llmtrace.tracer.core.config import ModelConfig
from llmtrace.tracer.core.dtypes import FP32
from llmtrace.tracer.load import weights_cache
from llmtrace.tracer.load.hf_loader import load_hf_state_dict
from llmtrace.tracer.load.loader import LoadedModel, load_model
from llmtrace.tracer.load.weights_cache import cache_path, source_key

TOKENS = torch.tensor([[1, 5, 9, 4]])


@pytest.fixture(autouse=True)
def _private_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("LLMTRACE_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache" / "weights"


@pytest.fixture(scope="module")
def tiny_source(make_tiny_llama: Callable[..., Path], sp_model_bytes: bytes) -> tuple[ModelConfig, dict, dict]:
    folder = make_tiny_llama("cache-source", seed=3)
    config = ModelConfig.from_hf_json(folder)
    return config, load_hf_state_dict(folder, config), sentencepiece_vocab(sp_model_bytes)


@pytest.fixture
def write(tiny_source: tuple[ModelConfig, dict, dict], tmp_path: Path) -> Callable[..., Path]:
    """write(name, scale) -> a tiny GGUF whose weights are the source's times `scale` (same size for any scale)."""
    config, state, vocab = tiny_source

    def make(name: str = "tiny.gguf", scale: float = 1.0) -> Path:
        return write_tiny_gguf(tmp_path / name, config, {k: v * scale for k, v in state.items()}, vocab=vocab)

    return make


def _logits(loaded: LoadedModel) -> torch.Tensor:
    with torch.no_grad():
        return loaded.model(TOKENS)


@pytest.mark.parametrize("remembered", [False, True], ids=["hashed-each-load", "digest-remembered"])
def test_a_same_size_same_mtime_rewrite_misses_the_cache(remembered: bool, write: Callable[..., Path],
                                                         tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`cp -p`, `rsync -t`, `touch -r`: new bytes under the old size and mtime must not get the old weights."""
    if remembered:
        monkeypatch.setattr(weights_cache, "RACY_SECONDS", 0.0)  # remember the digest at once (by identity)
    path = write("model.gguf", scale=1.0)
    first = load_model(str(path))
    assert load_model(str(path)).from_cache
    old = path.stat()
    other = write("other.gguf", scale=0.5)
    assert other.stat().st_size == old.st_size
    path.write_bytes(other.read_bytes())  # in place: same inode, same size
    os.utime(path, ns=(old.st_atime_ns, old.st_mtime_ns))  # as touch -r / cp -p / rsync -t leave it
    assert path.stat().st_mtime_ns == old.st_mtime_ns and path.stat().st_size == old.st_size
    reloaded = load_model(str(path))
    assert not reloaded.from_cache
    assert torch.equal(_logits(reloaded), _logits(load_model(str(other), use_cache=False)))
    assert not torch.equal(_logits(reloaded), _logits(first))


def test_the_digest_is_remembered_by_identity_and_rehashed_after_any_change(
        write: Callable[..., Path], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(weights_cache, "RACY_SECONDS", 0.0)
    path = write()
    hashed: list[Path] = []
    real_hash = weights_cache.hash_file
    monkeypatch.setattr(weights_cache, "hash_file", lambda p: hashed.append(p) or real_hash(p))
    key = source_key(path)
    assert source_key(path) == key and len(hashed) == 1  # the second look-up reads the memo
    path.chmod(0o600)  # any change of the inode (here only its ctime) means hashing again: never a stale digest
    assert source_key(path).digest == key.digest and len(hashed) == 2


def test_a_just_written_file_is_hashed_again_until_its_times_settle(write: Callable[..., Path],
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """Racy identities: a file changed within RACY_SECONDS of the hash could be rewritten within the same clock
    tick, so its digest is not remembered."""
    monkeypatch.setattr(weights_cache, "RACY_SECONDS", 3600.0)
    path = write()
    source_key(path)
    assert not list((weights_cache.weights_dir() / "sources").glob("*.json"))


def _damage_entry(entry: Path, how: str) -> None:
    data = bytearray(entry.read_bytes())
    start = 8 + int.from_bytes(data[:8], "little")
    middle = start + (len(data) - start) // 2
    if how == "zeroed":
        data[middle:middle + 4096] = bytes(4096)
    elif how == "nan":
        data[middle - middle % 4:middle - middle % 4 + 4] = b"\x00\x00\xc0\x7f"  # a float32 NaN
    elif how == "one-bit":
        data[middle] ^= 0x01
    elif how == "header":
        data[10:14] = b"}}}}"
    elif how == "torn":
        data = data[: len(data) // 2]
    entry.write_bytes(bytes(data))


@pytest.mark.parametrize("how", ["zeroed", "nan", "one-bit", "header", "torn"])
def test_a_damaged_entry_is_detected_dropped_and_converted_again(how: str, write: Callable[..., Path]) -> None:
    path = write()
    first = load_model(str(path))
    entry = cache_path(path, torch.float32)
    _damage_entry(entry, how)
    second = load_model(str(path))
    assert not second.from_cache
    assert second.cache_note.startswith(f"weights cache: {entry.name} was damaged (") and "converting again" in \
        second.cache_note and "\n" not in second.cache_note
    assert torch.equal(_logits(second), _logits(first))
    third = load_model(str(path))
    assert third.from_cache and third.cache_note == "" and torch.equal(_logits(third), _logits(first))


def test_an_entry_records_its_source_digest_and_entry_checksum(write: Callable[..., Path]) -> None:
    from llmtrace.tracer.checkpoint.safetensors_header import read_safetensors_header

    path = write()
    load_model(str(path))
    entry = cache_path(path, torch.float32)
    header = read_safetensors_header(entry)
    assert header.metadata["source_xxh3_128"] == weights_cache.hash_file(path)
    # issue 27: the checksum covers the whole entry, its header too (read with the field as its placeholder)
    assert header.metadata["entry_xxh3_128"] == weights_cache.entry_checksum(entry)
    assert header.metadata["source"] == str(path.resolve())


def test_leftovers_of_killed_writes_are_removed_and_live_ones_counted(write: Callable[..., Path],
                                                                     _private_cache: Path) -> None:
    path = write()
    _private_cache.mkdir(parents=True)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    leftover = _private_cache / f"tiny-0123-float32-2.safetensors.{dead.pid}.partial"
    leftover.write_bytes(b"x" * 1000)
    live = _private_cache / f"tiny-4567-float32-2.safetensors.{os.getpid()}.partial"
    live.write_bytes(b"x" * 1000)
    load_model(str(path))  # the store sweeps the folder
    assert not leftover.exists() and live.exists()
    removed = weights_cache.evict(_private_cache, limit=0, keep=cache_path(path, torch.float32))
    assert live.exists() and live not in removed  # counted, never taken from a writer that may still run


def test_two_first_loads_at_once_convert_once(write: Callable[..., Path], tmp_path: Path) -> None:
    path = write()
    code = ("import sys; from llmtrace.tracer.load.loader import load_model; "
            "m = load_model(sys.argv[1]); print('cache' if m.from_cache else 'converted')")
    env = {**os.environ, "LLMTRACE_CACHE_DIR": str(tmp_path / "cache")}
    procs = [subprocess.Popen([sys.executable, "-c", code, str(path)], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(2)]
    results = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], results
    assert sorted(out.strip() for out, _ in results) == ["cache", "converted"]  # the second waited for the first
    assert len(list((tmp_path / "cache" / "weights").glob("*.safetensors"))) == 1
    assert not list((tmp_path / "cache" / "weights").glob("*.partial"))


def test_a_run_names_the_damaged_entry_in_one_line(write: Callable[..., Path], tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from llmtrace.cli.app import app

    path = write()
    load_model(str(path), dtype=FP32)
    _damage_entry(cache_path(path, torch.float32), "nan")
    result = CliRunner().invoke(app, ["run", "sky", "--model", str(path), "--dtype", "fp32", "--max-new-tokens",
                                      "1", "--no-roofline"])
    assert result.exit_code == 0, result.output
    notes = " ".join(result.stderr.split()).split("note: ")[1:]  # on stderr, wrapped at the terminal's width
    assert len(notes) == 1 and notes[0].startswith("weights cache:") and "fail their checksum" in notes[0]
    assert "converting again" in notes[0] and "note:" not in result.stdout


def test_the_memo_is_plain_json_naming_the_file(write: Callable[..., Path], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(weights_cache, "RACY_SECONDS", 0.0)
    path = write()
    key = source_key(path)
    (memo,) = (weights_cache.weights_dir() / "sources").glob("*.json")
    assert json.loads(memo.read_text()) == {"path": str(path.resolve()), "identity": list(key.identity),
                                            "digest": key.digest}
    memo.write_text("[" * 100_000)  # a damaged memo is only a miss
    assert source_key(path) == key
