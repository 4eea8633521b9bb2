"""Trust what is on disk (issue 27, items 1, 2, 4 and 6): a GGUF replaced or rewritten during a run is never cached
with the wrong weights; one truncated during a load ends in one line, exit 2, not SIGBUS; stores and memos that are
FIFOs, devices or huge files neither block nor fill memory; a cache entry whose header was changed is dropped and
converted again. File races are driven by deterministic hooks at the named points of a load, never by sleeps."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st
from tiny_gguf import sentencepiece_vocab, write_tiny_gguf

from llmtrace.tracer.core.config import ModelConfig
from llmtrace.tracer.core.errors import FileFormatError, LlmtraceError
from llmtrace.tracer.core.json_store import StoreFormat, read_store
from llmtrace.tracer.load import loader, weights_cache
from llmtrace.tracer.load.hf_loader import load_hf_state_dict
from llmtrace.tracer.load.loader import LoadedModel, load_model

REPO = Path(__file__).resolve().parent.parent
TOKENS = torch.tensor([[1, 5, 9, 4, 7]])


@pytest.fixture(autouse=True)
def _private_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("LLMTRACE_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache" / "weights"


@pytest.fixture(scope="module")
def tiny_source(make_tiny_llama: Callable[..., Path], sp_model_bytes: bytes) -> tuple[ModelConfig, dict, dict]:
    folder = make_tiny_llama("disk-trust", seed=5)
    config = ModelConfig.from_hf_json(folder)
    return config, load_hf_state_dict(folder, config), sentencepiece_vocab(sp_model_bytes)


def _write(tiny_source: tuple[ModelConfig, dict, dict], path: Path, scale: float = 1.0) -> Path:
    config, state, vocab = tiny_source
    return write_tiny_gguf(path, config, {k: v * scale for k, v in state.items()}, vocab=vocab)


def _logits(loaded: LoadedModel) -> torch.Tensor:
    with torch.no_grad():
        return loaded.model(TOKENS)


def _swap_names(data: bytes, a: bytes, b: bytes) -> bytes:
    """`data` with the two equally long tensor names `a` and `b` swapped in its header."""
    assert len(a) == len(b) and data.count(a) == 1 and data.count(b) == 1
    out = bytearray(data)
    i, j = data.index(a), data.index(b)
    out[i:i + len(a)], out[j:j + len(b)] = b, a
    return bytes(out)


# ---- item 1: a file replaced or rewritten between its header and its data ---------------------------------------


@pytest.mark.parametrize("how", ["renamed over", "rewritten in place"])
@pytest.mark.parametrize("when", ["before the cache key", "after the cache key"])
def test_a_file_replaced_during_a_load_is_never_cached_with_wrong_weights(
        when: str, how: str, tiny_source: tuple[ModelConfig, dict, dict], tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A's header is read (resolve_model); at the hook the path gets B: same size, other tensor bytes (scaled) and
    another header (blk.0's K and V names swapped), as a download or a `cp` over it would. The run either loads A
    whole or refuses in one line; afterwards the cache serves A's copy A's weights and the path's B B's weights."""
    path = _write(tiny_source, tmp_path / "model.gguf")
    a_bytes = path.read_bytes()
    b_bytes = _swap_names(_write(tiny_source, tmp_path / "b-plain.gguf", scale=0.5).read_bytes(),
                          b"blk.0.attn_k.weight", b"blk.0.attn_v.weight")
    assert len(b_bytes) == len(a_bytes)
    (tmp_path / "a-ref.gguf").write_bytes(a_bytes)
    (tmp_path / "b-ref.gguf").write_bytes(b_bytes)
    ref_a = _logits(load_model(str(tmp_path / "a-ref.gguf"), weights="dense", use_cache=False))
    ref_b = _logits(load_model(str(tmp_path / "b-ref.gguf"), weights="dense", use_cache=False))
    assert not torch.allclose(ref_a, ref_b)

    def replace_the_file() -> None:
        if how == "renamed over":
            (tmp_path / "incoming.gguf").write_bytes(b_bytes)
            os.replace(tmp_path / "incoming.gguf", path)
        else:
            with open(path, "r+b") as fh:  # same inode, same size
                fh.write(b_bytes)

    # the point between the header's read and the data's: where _load_gguf starts (after resolve_model and any
    # kernel measurement), or once the cache key is taken, just before the entry is looked up and the data read
    hooked, name = (loader, "tokenizer_from_gguf") if when == "before the cache key" else (weights_cache,
                                                                                         "load_cached")
    real = getattr(hooked, name)
    fired: list[bool] = []

    def hook(*args: Any, **kwargs: Any) -> Any:
        if not fired:
            fired.append(True)
            replace_the_file()
        return real(*args, **kwargs)

    monkeypatch.setattr(hooked, name, hook)
    try:
        first = load_model(str(path), weights="dense")
    except FileFormatError as exc:
        assert "\n" not in str(exc) and "changed while llmtrace read it" in str(exc)
    else:  # it ran: on A, whole
        assert torch.equal(_logits(first), ref_a)
    assert fired
    monkeypatch.setattr(hooked, name, real)
    assert torch.equal(_logits(load_model(str(path), weights="dense")), ref_b)  # the path now holds B
    (tmp_path / "a-copy.gguf").write_bytes(a_bytes)  # A's content elsewhere: its key is A's digest
    assert torch.equal(_logits(load_model(str(tmp_path / "a-copy.gguf"), weights="dense")), ref_a)
    assert torch.equal(_logits(load_model(str(path), weights="dense")), ref_b)


def test_a_header_read_from_one_file_is_refused_for_another(tiny_source: tuple[ModelConfig, dict, dict],
                                                             tmp_path: Path) -> None:
    from llmtrace.tracer.checkpoint.gguf_header import read_gguf_header
    from llmtrace.tracer.load.gguf_source import GGUFSource

    path = _write(tiny_source, tmp_path / "m.gguf")
    header = read_gguf_header(path)
    with GGUFSource(header) as source:  # unchanged: opens
        assert source.identity == header.identity
    path.write_bytes(path.read_bytes())  # the same bytes written again: a new ctime
    with pytest.raises(FileFormatError, match="changed while llmtrace read it"):
        GGUFSource(header)


# ---- item 2: a file truncated during its load ---------------------------------------------------------------------

_TRUNCATING_RUN = """
import os, runpy, sys
from llmtrace.tracer.load import gguf_loader
path, weights, hooked = sys.argv[1:4]
real = getattr(gguf_loader, hooked)
calls = []
def truncating(*args, **kwargs):
    calls.append(1)
    if len(calls) == 3:  # the third tensor is being converted: the file is cut to nothing under the load
        os.truncate(path, 0)
    return real(*args, **kwargs)
setattr(gguf_loader, hooked, truncating)
sys.argv = ["llmtrace", "run", "Hi", "--model", path, "--weights", weights, "--dtype", "fp32",
            "--max-new-tokens", "1", "--no-roofline"]
runpy.run_module("llmtrace", run_name="__main__")
"""


@pytest.mark.parametrize("weights", ["dense", "native"])
def test_a_file_truncated_during_its_load_is_one_line_exit_2_not_sigbus(
        weights: str, tiny_quantized: Callable[..., Path], tmp_path: Path) -> None:
    """Run in a child process so that SIGBUS (what reading a map of a shrunk file raised: exit 135 in a shell) shows
    as its exit status. Dense conversion and the native kernel's stored blocks (read into the weight arena)."""
    import gguf

    path = tmp_path / "model.gguf"
    shutil.copyfile(tiny_quantized(gguf.GGMLQuantizationType.Q8_0), path)
    hooked = "dequantize" if weights == "dense" else "pack_gguf"
    env = {**os.environ, "LLMTRACE_CACHE_DIR": str(tmp_path / "cache"), "XDG_CONFIG_HOME": str(tmp_path / "cfg")}
    proc = subprocess.run([sys.executable, "-c", _TRUNCATING_RUN, str(path), weights, hooked], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-2000:])
    assert proc.stderr.count("\n") == 1 and "changed while llmtrace read it" in proc.stderr, proc.stderr
    assert not list((tmp_path / "cache").rglob("*.safetensors"))  # nothing cached


_TRUNCATED_AFTER_LOAD = """
import os, sys, torch
from llmtrace.tracer.core.dtypes import FP32
from llmtrace.tracer.load.loader import load_model
path = sys.argv[1]
loaded = load_model(path, FP32, weights="native")
os.truncate(path, 4096)  # after the load: the matrices held in the file's map lose their pages
loaded.model.setup_cache(1, 8)
loaded.model.prefill(torch.tensor([[1, 5, 9]]))
print("the products ran on pages the file no longer has")
"""


def test_a_file_truncated_after_its_load_is_one_line_exit_2_not_sigbus(tiny_quantized: Callable[..., Path],
                                                                       tmp_path: Path) -> None:
    """The native kernel reads a Q8_0 file's blocks in place from its map (issue 31: load <= llama.cpp's): a product
    that touches a page past the new end of a truncated file raises SIGBUS, which the native library's handler
    (native/mapped_file.c) turns into the loader's one line and exit 2."""
    import gguf

    path = tmp_path / "model.gguf"
    shutil.copyfile(tiny_quantized(gguf.GGMLQuantizationType.Q8_0), path)
    env = {**os.environ, "LLMTRACE_CACHE_DIR": str(tmp_path / "cache"), "XDG_CONFIG_HOME": str(tmp_path / "cfg")}
    proc = subprocess.run([sys.executable, "-c", _TRUNCATED_AFTER_LOAD, str(path)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr[-2000:])
    assert proc.stderr == f"llmtrace: error: {path}: the file changed while llmtrace read it (replaced, rewritten " \
                          "or truncated by another program); nothing was cached: run again once it is complete\n"
    assert proc.stdout == ""


def test_a_short_read_of_a_header_says_truncated(tiny_source: tuple[ModelConfig, dict, dict],
                                                 tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The header is read through the descriptor too: a file that shrinks between its fstat and its read is a
    truncated header (one line), not SIGBUS."""
    from llmtrace.tracer.checkpoint import gguf_header

    path = _write(tiny_source, tmp_path / "m.gguf")
    real = gguf_header._pread_all

    def shrinking(fd: int, n: int) -> bytes:
        os.truncate(path, 100)
        return real(fd, n)

    monkeypatch.setattr(gguf_header, "_pread_all", shrinking)
    with pytest.raises(FileFormatError, match="truncated") as caught:
        gguf_header.read_gguf_header(path)
    assert "\n" not in str(caught.value)


# ---- item 4: stores and memos that are not regular files --------------------------------------------------------

FMT = StoreFormat("test store", 3, ("things",), LlmtraceError, LlmtraceError)


class Blocked(Exception):
    """Raised in a body that blocked (not an OSError: the readers under test must not take it for a failed read)."""


@contextmanager
def _no_longer_than(seconds: int) -> Iterator[None]:
    """Fail (Blocked) instead of hanging when the body blocks, as an open() of a FIFO without a writer does."""
    def expire(*_: object) -> None:
        raise Blocked(f"blocked for {seconds} s")

    old = signal.signal(signal.SIGALRM, expire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def _problem(path: Path) -> str:
    with _no_longer_than(10), pytest.raises(LlmtraceError) as caught:
        read_store(path, FMT)
    assert "\n" not in str(caught.value)
    return str(caught.value)


def test_a_store_that_is_a_fifo_is_a_problem_not_a_wait(tmp_path: Path) -> None:
    path = tmp_path / "kernels.json"
    os.mkfifo(path)
    assert _problem(path) == f"{path}: cannot be read: is a FIFO, not a regular file"


def test_a_store_over_the_cap_is_a_problem_not_a_read(tmp_path: Path) -> None:
    path = tmp_path / "kernels.json"
    path.write_text(json.dumps({"version": 3, "things": {}, "pad": "x" * (16 << 20)}))
    assert "more than llmtrace ever writes there" in _problem(path)
    from llmtrace.tracer.core.json_store import MAX_STORE_BYTES

    assert MAX_STORE_BYTES == 16 << 20
    path.write_text(json.dumps({"version": 3, "things": {"a": "x" * (MAX_STORE_BYTES - 100)}}))
    assert read_store(path, FMT)["things"]["a"].startswith("x")  # under the cap: read


def test_a_store_may_be_a_symlink_to_a_file(tmp_path: Path) -> None:
    real = tmp_path / "dotfiles" / "kernels.json"
    real.parent.mkdir()
    real.write_text('{"version": 3, "things": {"a": 1}}')
    (tmp_path / "kernels.json").symlink_to(real)
    assert read_store(tmp_path / "kernels.json", FMT)["things"] == {"a": 1}


# A child process under a 1.5 GB data limit: an unbounded read of /dev/zero dies there of MemoryError (exit 1)
# instead of taking the machine's memory.
_DEV_ZERO = """
import resource, sys
resource.setrlimit(resource.RLIMIT_DATA, (1536 << 20, 1536 << 20))
from pathlib import Path
which, target = sys.argv[1], Path(sys.argv[2])
if which == "store":
    from llmtrace.tracer.core.errors import LlmtraceError
    from llmtrace.tracer.core.json_store import StoreFormat, read_store
    try:
        read_store(target, StoreFormat("test store", 3, ("things",), LlmtraceError, LlmtraceError))
    except LlmtraceError as exc:
        print(exc)
else:
    from llmtrace.tracer.load import weights_cache
    print(weights_cache.source_key(target).note)
"""


def test_a_store_symlinked_to_dev_zero_does_not_fill_memory(tmp_path: Path) -> None:
    path = tmp_path / "hardware.json"
    path.symlink_to("/dev/zero")
    proc = subprocess.run([sys.executable, "-c", _DEV_ZERO, "store", str(path)], cwd=REPO, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout == f"{path}: cannot be read: is a device, not a regular file\n"


def _memo_of(path: Path) -> Path:
    memo = weights_cache._memo_path(path.resolve())
    memo.parent.mkdir(parents=True, exist_ok=True)
    return memo


def test_a_memo_that_is_a_fifo_is_ignored_with_a_note(tiny_source: tuple[ModelConfig, dict, dict],
                                                      tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(weights_cache, "RACY_SECONDS", 0.0)
    path = _write(tiny_source, tmp_path / "m.gguf")
    os.mkfifo(_memo_of(path))
    with _no_longer_than(20):
        key = weights_cache.source_key(path)
    assert key.digest == weights_cache.hash_file(path)
    assert key.note == f"weights cache: {_memo_of(path)} is a FIFO, not a regular file; ignored, the source hashed " \
                       "again"
    with _no_longer_than(20):
        again = weights_cache.source_key(path)  # the memo was written over with a file
    assert again == key and again.note == ""
    loaded = load_model(str(path), weights="dense")  # and a run says it in its cache note, once
    assert loaded.cache_note == ""


@pytest.mark.parametrize("target", ["/dev/zero", "elsewhere.json"])
def test_a_memo_that_is_a_symlink_is_not_followed(target: str, tiny_source: tuple[ModelConfig, dict, dict],
                                                  tmp_path: Path) -> None:
    path = _write(tiny_source, tmp_path / "m.gguf")
    memo = _memo_of(path)
    if target != "/dev/zero":
        target = str(tmp_path / target)
        Path(target).write_text(json.dumps({"path": str(path), "identity": [0], "digest": "0" * 32}))
    memo.symlink_to(target)
    env = {**os.environ, "LLMTRACE_CACHE_DIR": str(tmp_path / "cache")}
    proc = subprocess.run([sys.executable, "-c", _DEV_ZERO, "memo", str(path)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout == f"weights cache: {memo} is a symlink; ignored, the source hashed again\n"


def test_a_run_notes_a_memo_that_is_not_a_file(tiny_source: tuple[ModelConfig, dict, dict], tmp_path: Path) -> None:
    path = _write(tiny_source, tmp_path / "m.gguf")
    os.mkfifo(_memo_of(path))
    with _no_longer_than(60):
        loaded = load_model(str(path), weights="dense")
    assert loaded.cache_note == f"weights cache: {_memo_of(path)} is a FIFO, not a regular file; ignored, the " \
                                "source hashed again"


# ---- item 6: the entry's checksum covers its header ----------------------------------------------------------------

FUZZ = settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


class _Cached(tuple):
    """(the GGUF, its cache folder, its fp32 entry's bytes as first stored, the model's logits), shown short."""

    def __repr__(self) -> str:
        return f"cached entry of {self[0]}"


@pytest.fixture(scope="module")
def cached_model(tiny_source: tuple[ModelConfig, dict, dict], tmp_path_factory: pytest.TempPathFactory
                 ) -> tuple[Path, Path, bytes, torch.Tensor]:
    folder = tmp_path_factory.mktemp("entry")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("LLMTRACE_CACHE_DIR", str(folder / "cache"))
        path = _write(tiny_source, folder / "m.gguf")
        logits = _logits(load_model(str(path), weights="dense"))
        entry = weights_cache.cache_path(path, torch.float32)
        return _Cached((path, folder / "cache", entry.read_bytes(), logits))


def _entry_header(data: bytes) -> dict[str, Any]:
    return json.loads(data[8:8 + int.from_bytes(data[:8], "little")])


def _with_header(data: bytes, header: dict[str, Any]) -> bytes | None:
    """`data` with its safetensors header replaced by `header`, padded with spaces to the same length (offsets
    stay valid); None when the new header is longer."""
    n = int.from_bytes(data[:8], "little")
    raw = json.dumps(header, separators=(",", ":")).encode()
    if len(raw) > n:
        return None
    return data[:8] + raw + b" " * (n - len(raw)) + data[8 + n:]


_MUTATIONS = ("swap data_offsets", "dtype", "shape", "metadata value", "metadata key")
_DTYPES = ("I32", "F16", "BF16", "I8", "U8", "I16", "F64", "I64", "BOOL")


@FUZZ
@given(mutation=st.sampled_from(_MUTATIONS), first=st.integers(min_value=0), second=st.integers(min_value=0),
       dtype=st.sampled_from(_DTYPES), text=st.text(alphabet="abcdef0123456789", min_size=1, max_size=6))
def test_an_entry_whose_header_was_changed_is_dropped_and_converted_again(
        cached_model: tuple[Path, Path, bytes, torch.Tensor], monkeypatch: pytest.MonkeyPatch, mutation: str,
        first: int, second: int, dtype: str, text: str) -> None:
    """Any change of an entry's header (the tensors' offsets, dtypes, shapes; its metadata) fails the entry's
    checksum: the load drops it with a note and converts again, giving the model's own logits. Before issue 27 the
    checksum covered the tensor bytes alone: swapped offsets served other weights, an I32 dtype made the run fail."""
    from hypothesis import assume

    path, cache, pristine, logits = cached_model
    monkeypatch.setenv("LLMTRACE_CACHE_DIR", str(cache))
    entry = weights_cache.cache_path(path, torch.float32)
    header = _entry_header(pristine)
    names = sorted(k for k in header if k != "__metadata__")
    a, b = names[first % len(names)], names[second % len(names)]
    if mutation == "swap data_offsets":
        same_size = [n for n in names if n != a and header[n]["data_offsets"][1] - header[n]["data_offsets"][0] ==
                     header[a]["data_offsets"][1] - header[a]["data_offsets"][0]]
        assume(same_size)
        b = same_size[second % len(same_size)]
        header[a]["data_offsets"], header[b]["data_offsets"] = header[b]["data_offsets"], header[a]["data_offsets"]
    elif mutation == "dtype":
        header[a]["dtype"] = dtype
    elif mutation == "shape":
        shape = header[a]["shape"]
        assume(len(shape) == 2 and shape[0] != shape[1])
        header[a]["shape"] = [shape[1], shape[0]]
    elif mutation == "metadata value":
        key = sorted(header["__metadata__"])[first % len(header["__metadata__"])]
        assume(key != "entry_xxh3_128")
        header["__metadata__"][key] = header["__metadata__"][key][:-len(text)] + text
        assume(header["__metadata__"][key] != _entry_header(pristine)["__metadata__"][key])
    else:  # a key renamed, the header's length kept
        meta = header["__metadata__"]
        new_key = (text + "source")[:6]
        assume(new_key not in meta)
        meta[new_key] = meta.pop("source")
    changed = _with_header(pristine, header)
    assume(changed is not None and changed != pristine)
    entry.write_bytes(changed)
    loaded = load_model(str(path), weights="dense")
    assert not loaded.from_cache and torch.equal(_logits(loaded), logits)
    assert loaded.cache_note.startswith(f"weights cache: {entry.name} ") and "converting again" in \
        loaded.cache_note and "\n" not in loaded.cache_note
    assert load_model(str(path), weights="dense").from_cache  # converted again, stored whole


def _rechecksummed(entry: Path) -> None:
    """Give `entry` a checksum that holds for its bytes as they are now (an entry another program wrote whole)."""
    data = bytearray(entry.read_bytes())
    header = _entry_header(bytes(data))
    old = header["__metadata__"]["entry_xxh3_128"]
    field = f'"entry_xxh3_128":"{old}"'.encode()
    at = data.index(field)
    data[at:at + len(field)] = f'"entry_xxh3_128":"{"0" * 32}"'.encode()
    entry.write_bytes(bytes(data))
    weights_cache._write_checksum(entry, weights_cache.entry_checksum(entry))


@pytest.mark.parametrize("mutation", ["dtype I32", "shape", "missing tensor"])
def test_an_entry_that_passes_its_checksum_but_does_not_load_is_converted_again(
        mutation: str, cached_model: tuple[Path, Path, bytes, torch.Tensor], monkeypatch: pytest.MonkeyPatch) -> None:
    path, cache, pristine, logits = cached_model
    monkeypatch.setenv("LLMTRACE_CACHE_DIR", str(cache))
    entry = weights_cache.cache_path(path, torch.float32)
    header = _entry_header(pristine)
    names = sorted(k for k in header if k != "__metadata__")
    if mutation == "dtype I32":
        header[names[0]]["dtype"] = "I32"
    elif mutation == "shape":
        name = next(n for n in names if len(header[n]["shape"]) == 2 and len(set(header[n]["shape"])) == 2)
        header[name]["shape"] = header[name]["shape"][::-1]
    else:
        del header[names[-1]]
    changed = _with_header(pristine, header)
    assert changed is not None
    entry.write_bytes(changed)
    _rechecksummed(entry)
    assert weights_cache._damage(entry, weights_cache.source_key(path)) == ""  # it passes the check
    loaded = load_model(str(path), weights="dense")
    assert not loaded.from_cache and torch.equal(_logits(loaded), logits)
    assert loaded.cache_note.startswith(f"weights cache: {entry.name} ") and "converting again" in \
        loaded.cache_note and "\n" not in loaded.cache_note
    assert load_model(str(path), weights="dense").from_cache
