"""What llmtrace does not read is refused in one line naming what its model code lacks (tracer/core/refusals.py),
through every reader and the CLI (exit 2), and README's table of what loads lists the registry as it is."""

from __future__ import annotations

import json
import re
from pathlib import Path

import gguf
import pytest
from typer.testing import CliRunner

from llmtrace.cli.app import app
from llmtrace.tracer.core.config import ModelConfig
from llmtrace.tracer.core.config_gguf import GGUF_ARCHITECTURES
from llmtrace.tracer.core.config_hf import HF_ARCHITECTURES
from llmtrace.tracer.core.errors import UnsupportedModelError
from llmtrace.tracer.core.refusals import REFUSALS, Refusal

README = Path(__file__).resolve().parents[1] / "README.md"
_CONFIG = {"vocab_size": 32, "hidden_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2,
           "intermediate_size": 32}
_NAMES = [(r, name) for r in REFUSALS for name in r.hf]
_TYPES = [(r, name) for r in REFUSALS for name in r.model_types]
_GGUF = [(r, name) for r in REFUSALS for name in r.gguf]


def _ends(refusal: Refusal) -> str:
    """What every refusal line of `refusal` ends with."""
    tail = f"it needs {refusal.missing}, which llmtrace's model code does not have"
    return tail + (f"; {refusal.instead}" if refusal.instead else "")


@pytest.mark.parametrize(("refusal", "arch"), _NAMES, ids=[n for _, n in _NAMES])
def test_every_refused_hf_architecture_names_what_is_missing(refusal: Refusal, arch: str) -> None:
    with pytest.raises(UnsupportedModelError) as exc:
        ModelConfig.from_hf_dict({**_CONFIG, "architectures": [arch]}, source="m/config.json")
    assert str(exc.value) == f"m/config.json: architecture {arch!r} is not read: {_ends(refusal)}"


@pytest.mark.parametrize(("refusal", "model_type"), _TYPES, ids=[n for _, n in _TYPES])
def test_a_config_without_architectures_is_refused_by_model_type(refusal: Refusal, model_type: str) -> None:
    with pytest.raises(UnsupportedModelError) as exc:
        ModelConfig.from_hf_dict({**_CONFIG, "model_type": model_type}, source="c.json")
    assert str(exc.value) == f"c.json: model type {model_type!r} is not read: {_ends(refusal)}"


@pytest.mark.parametrize(("refusal", "arch"), _GGUF, ids=[n for _, n in _GGUF])
def test_every_refused_gguf_architecture_names_what_is_missing(refusal: Refusal, arch: str) -> None:
    with pytest.raises(UnsupportedModelError) as exc:
        ModelConfig.from_gguf_metadata({"general.architecture": arch, f"{arch}.block_count": 2}, "m", "m.gguf")
    assert str(exc.value) == f"m.gguf: GGUF architecture {arch!r} is not read: {_ends(refusal)}"


def test_registries_are_disjoint() -> None:
    """A name is read or refused, never both, and refused for one reason."""
    hf = [n for r in REFUSALS for n in r.hf]
    types = [n for r in REFUSALS for n in r.model_types]
    ggufs = [n for r in REFUSALS for n in r.gguf]
    assert len(hf) == len(set(hf)) and len(types) == len(set(types)) and len(ggufs) == len(set(ggufs))
    assert not set(hf) & set(HF_ARCHITECTURES)
    assert not set(types) & {"llama", "mistral", "qwen2"}
    assert not set(ggufs) & set(GGUF_ARCHITECTURES)


def test_the_cli_refuses_a_deepseek_folder_in_one_line(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({**_CONFIG, "architectures": ["DeepseekV3ForCausalLM"],
                                                      "model_type": "deepseek_v3"}))
    result = CliRunner().invoke(app, ["flops", "--model", str(tmp_path)])
    assert result.exit_code == 2
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.output
    assert result.stderr == (f"llmtrace: error: {tmp_path / 'config.json'}: architecture 'DeepseekV3ForCausalLM' "
                             "is not read: it needs multi-head latent attention (MLA: K and V expanded from a "
                             "compressed latent) and routed + shared experts, which llmtrace's model code does not "
                             "have\n")


@pytest.mark.parametrize("arch", ["mamba", "clip"])  # a state-space model; llama.cpp's mmproj vision tower
def test_the_cli_refuses_a_state_space_or_vision_gguf_in_one_line(arch: str, tmp_path: Path) -> None:
    path = tmp_path / f"{arch}.gguf"
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(2)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    result = CliRunner().invoke(app, ["kvmem", "--model", str(path)])
    assert result.exit_code == 2
    missing = {"mamba": "state-space (Mamba) layers in place of attention",
               "clip": "a vision tower (image encoder and projector) beside the language model"}[arch]
    assert result.stderr == (f"llmtrace: error: {path}: GGUF architecture {arch!r} is not read: it needs {missing}, "
                             "which llmtrace's model code does not have\n")


def test_readme_lists_the_registry() -> None:
    """README's table of what loads has one row per refused family, naming every architecture of it and what is
    missing, and names no architecture as refused that the registry does not hold."""
    table = re.search(r"<!-- fact: table.loads -->\n(.*?)<!-- /fact -->", README.read_text(encoding="utf-8"), re.S)
    assert table is not None
    cells = [line.split("|") for line in table.group(1).splitlines()]
    assert all(len(c) == 5 for c in cells), "a cell holds a '|': the table's columns shift"
    rows = {c[1].strip(): c[3] for c in cells if len(c) > 3}
    for refusal in REFUSALS:
        row = rows[refusal.family]
        assert refusal.missing in row
        assert set(re.findall(r"`([^`]+)`", row.split(": needs ")[0])) == {*refusal.hf, *refusal.gguf}
    assert {c[1].strip() for c in cells if len(c) > 3 and c[2].strip() == "no"} == {r.family for r in REFUSALS}
