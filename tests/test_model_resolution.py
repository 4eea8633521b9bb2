"""One `--model` resolver for every command: the same inputs are the same kind of model, and the same bad inputs
give the same one line (exit 2) in flops, kvmem, roofline, run --dry-run and run; a GGUF is known by its magic."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Callable

import pytest
from test_cli_analytical import invoke_main
from tiny_gguf import sentencepiece_vocab, write_tiny_gguf

from llmtrace.tracer.checkpoint import gguf_header
from llmtrace.tracer.checkpoint.resolve import GGUF, HF, PRESET, classify_model, resolve_model
from llmtrace.tracer.core.config import ModelConfig
from llmtrace.tracer.core.errors import ConfigError, FileFormatError, UnknownPresetError
from llmtrace.tracer.load.hf_loader import load_hf_state_dict


@pytest.fixture(autouse=True)
def _private_hub_cache(private_dirs: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_CACHE", str(private_dirs / "hf-cache"))


@pytest.fixture(scope="module")
def tiny_gguf(make_tiny_llama: Callable[..., Path], sp_model_bytes: bytes,
              tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = make_tiny_llama("resolution", seed=2)
    config = ModelConfig.from_hf_json(folder)
    path = tmp_path_factory.mktemp("resolution") / "tiny.gguf"
    return write_tiny_gguf(path, config, load_hf_state_dict(folder, config), sentencepiece_vocab(sp_model_bytes))


def _commands(model: str) -> dict[str, list[str]]:
    return {
        "flops": ["flops", "-m", model, "--json"],
        "kvmem": ["kvmem", "-m", model, "--json"],
        "roofline": ["roofline", "-m", model, "--json"],
        "run --dry-run": ["run", "--dry-run", "-m", model],
        "run": ["run", "hi", "-m", model, "--max-new-tokens", "1", "--no-roofline"],
    }


# ---- the same file, the same kind, in every command ---------------------------------------------------------------


def test_a_gguf_without_its_suffix_is_a_gguf_everywhere(tiny_gguf: Path, tmp_path: Path,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    renamed = shutil.copy(tiny_gguf, tmp_path / "model.bin")
    source = classify_model(str(renamed))
    assert (source.kind, source.path) == (GGUF, Path(renamed))
    name = resolve_model(str(renamed)).config.name
    for command, args in _commands(str(renamed)).items():
        code, out, err = invoke_main(args, capsys)
        assert code == 0, f"{command}: {err}"
        assert name in out, command
    flops = json.loads(invoke_main(["flops", "-m", str(renamed), "--json"], capsys)[1])
    assert flops["checkpoint"]["format"] == "gguf" and flops["checkpoint"]["files"] == [str(renamed)]


def test_kinds(tiny_gguf: Path, tiny_llama_dir: Path, tmp_path: Path) -> None:
    one_gguf = tmp_path / "one"
    one_gguf.mkdir()
    shutil.copy(tiny_gguf, one_gguf / "m.gguf")
    cases = {
        "llama-7b": (PRESET, None, None),
        " LLaMA-7B ": (PRESET, None, None),
        str(tiny_llama_dir): (HF, tiny_llama_dir, tiny_llama_dir / "config.json"),
        str(tiny_llama_dir / "config.json"): (HF, tiny_llama_dir, tiny_llama_dir / "config.json"),
        str(tiny_llama_dir / "model.safetensors"): (HF, tiny_llama_dir, tiny_llama_dir / "config.json"),
        str(tiny_gguf): (GGUF, tiny_gguf, None),
        str(one_gguf): (GGUF, one_gguf / "m.gguf", None),
    }
    for spec, expected in cases.items():
        source = classify_model(spec)
        assert (source.kind, source.path, source.config_path) == expected, spec
        assert source.spec == spec
    assert classify_model(" LLaMA-7B ").preset.name == "llama-7b"


# ---- the same bad input, the same line, in every command ----------------------------------------------------------


def _bad_magic(t: Path) -> str:
    (t / "fake.gguf").write_bytes(b"GGML" + bytes(64))
    return str(t / "fake.gguf")


def _empty_folder(t: Path) -> str:
    (t / "empty").mkdir()
    return str(t / "empty")


def _text_file(t: Path) -> str:
    (t / "notes.txt").write_text("not a model")
    return str(t / "notes.txt")


def _lone_safetensors(t: Path) -> str:
    (t / "lone").mkdir()
    (t / "lone" / "model.safetensors").write_bytes(b"\0" * 16)
    return str(t / "lone" / "model.safetensors")


BAD_MODELS: dict[str, tuple[Callable[[Path], str], type[Exception], str]] = {
    "missing path": (lambda t: str(t / "no" / "model.gguf"), ConfigError, "no such file or folder"),
    "missing relative path": (lambda t: "./no/such/folder", ConfigError, "no such file or folder"),
    "unknown preset": (lambda t: "llama-7c", UnknownPresetError, "did you mean llama-7b"),
    "hub id not cached": (lambda t: "someorg/some-model", ConfigError, "fetch it with `hf download someorg/some-model`"),
    "folder without a model": (_empty_folder, ConfigError, "folder has no config.json"),
    "not a model file": (_text_file, ConfigError, "not a model folder, config.json or GGUF file"),
    "safetensors without config": (_lone_safetensors, ConfigError, "needs the config.json of its model"),
    "gguf name, wrong magic": (_bad_magic, FileFormatError, "not a GGUF file"),
}


@pytest.mark.parametrize("case", list(BAD_MODELS))
def test_bad_model_is_the_same_line_in_every_command(case: str, tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    make, error, expected = BAD_MODELS[case]
    spec = make(tmp_path)
    with pytest.raises(error, match=expected):
        resolve_model(spec)
    lines = {}
    for command, args in _commands(spec).items():
        code, out, err = invoke_main(args, capsys)
        assert code == 2 and out == "", command
        assert len(err.splitlines()) == 1, f"{command}: {err}"
        lines[command] = err.strip()
    assert len(set(lines.values())) == 1, lines
    assert expected in lines["flops"] and lines["flops"].startswith("llmtrace: error: ")


# ---- a GGUF's header is parsed once per load ----------------------------------------------------------------------


def test_a_load_parses_the_gguf_header_once(tiny_gguf: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Counted at the bottom (the header parser and the config constructor), whatever name a caller imports."""
    from llmtrace.tracer.load.loader import load_model

    calls = {"header": 0, "config": 0}
    parse, from_metadata = gguf_header._parse, ModelConfig.from_gguf_metadata.__func__

    def counted_parse(*args, **kwargs):
        calls["header"] += 1
        return parse(*args, **kwargs)

    def counted_config(cls, *args, **kwargs):
        calls["config"] += 1
        return from_metadata(cls, *args, **kwargs)

    monkeypatch.setattr(gguf_header, "_parse", counted_parse)
    monkeypatch.setattr(ModelConfig, "from_gguf_metadata", classmethod(counted_config))
    for kwargs in ({}, {"dry_run": True}, {}):  # convert, dry run, from the converted-weights cache
        calls.update(header=0, config=0)
        loaded = load_model(str(tiny_gguf), **kwargs)
        assert calls == {"header": 1, "config": 1}, kwargs
        assert loaded.tokenizer is not None


def test_flops_prompt_reads_the_gguf_header_once(tiny_gguf: Path, monkeypatch: pytest.MonkeyPatch,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """The config and the tokenizer that counts --prompt come from one read of the header, vocabulary included."""
    parses = []
    parse = gguf_header._parse
    monkeypatch.setattr(gguf_header, "_parse", lambda *a, **k: parses.append(1) or parse(*a, **k))
    code, out, err = invoke_main(["flops", "-m", str(tiny_gguf), "--prompt", "Once upon a time", "--json"], capsys)
    assert code == 0, err
    assert json.loads(out)["prompt_tokenizer"] == str(tiny_gguf) and len(parses) == 1
