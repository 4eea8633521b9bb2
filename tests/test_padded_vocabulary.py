"""A folder whose embedding is longer than its tokenizer (padded vocabularies are common in HF folders): a run that
draws a padding row prints, saves, reports and lenses it as `<unnamed N>` instead of dying of sentencepiece's
OUT_OF_RANGE (found at 7B with a 2,000-piece tokenizer over a 32,000-row embedding)."""

from __future__ import annotations

import html
import json
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from llmtrace.cli.app import app
from tiny_llama import hf_config_dict, write_tiny_llama

PADDING = 64
runner = CliRunner()


@pytest.fixture(scope="module")
def padded_folder(tmp_path_factory: pytest.TempPathFactory, sp_model_bytes: bytes, sp_vocab_size: int) -> Path:
    """The tiny LLaMA with PADDING rows past the tokenizer; the head's padding rows scaled x10 so that greedy picks
    them (the largest of 64 scaled dot products beats the largest unscaled one)."""
    folder = write_tiny_llama(tmp_path_factory.mktemp("padded"), hf_config_dict(sp_vocab_size + PADDING),
                              tokenizer_model=sp_model_bytes)
    tensors = load_file(str(folder / "model.safetensors"))
    tensors["lm_head.weight"][sp_vocab_size:] *= 10.0
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder


def test_a_drawn_padding_row_reads_as_unnamed_everywhere(padded_folder: Path, sp_vocab_size: int,
                                                         tmp_path: Path) -> None:
    saved, report = tmp_path / "run.json", tmp_path / "run.html"
    result = runner.invoke(app, ["run", "The capital of France is", "--model", str(padded_folder),
                                 "--max-new-tokens", "4", "--lens", "--no-roofline", "--threads", "1",
                                 "--json", str(saved), "--html", str(report)])
    assert result.exit_code == 0, result.output
    data = json.loads(saved.read_text(encoding="utf-8"))
    steps = data["steps"]
    padded = [s for s in steps if s["token_id"] >= sp_vocab_size]
    assert padded, [s["token_id"] for s in steps]  # the scaled rows won at least one step
    for step in padded:
        name = f"<unnamed {step['token_id']}>"
        assert step["piece"] == name
        assert name in data["generated_text"]
        assert name in result.output
        assert html.escape(name) in report.read_text(encoding="utf-8")
    lens_pieces = {t["piece"] for lens in data["lens"] for layer in lens["layers"] for t in layer["top"]}
    assert any(p.startswith("<unnamed ") for p in lens_pieces)
    shown = runner.invoke(app, ["show", str(saved)])
    assert shown.exit_code == 0, shown.output
    assert f"<unnamed {padded[0]['token_id']}>" in shown.output
