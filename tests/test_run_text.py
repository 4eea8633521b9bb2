"""What `run` and `show` print says each thing once, in the user's words: a short header, the model named one way,
warnings on stderr and wrapped, a chat's prompt and reply apart (issue 28, item 6). The views' exact text is pinned
by tests/golden; these check the rules that hold for any trace."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
from rich.cells import cell_len
from typer.testing import CliRunner

from llmtrace.cli.app import app

GOLDEN = Path(__file__).resolve().parent / "golden"
runner = CliRunner()


def _show(path: Path, *args: str, width: int = 80) -> str:
    result = runner.invoke(app, ["show", str(path), *args], env={"COLUMNS": str(width), "NO_COLOR": "1"})
    assert result.exit_code == 0, result.output
    return result.stdout


@pytest.mark.parametrize("fixture", ["tiny_trace.json", "tiny_journey_trace.json", "tiny_batch_trace.json"])
def test_the_header_is_three_lines_at_80_columns(fixture: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The trace's line, the model and its shape, how it was loaded: all before the first panel, none wrapped."""
    monkeypatch.chdir(GOLDEN)
    text = _show(Path(fixture))
    header = text[:text.index("╭")].splitlines()
    assert len(header) == 3, header
    assert all(cell_len(line) <= 80 for line in text.splitlines())


def test_the_summary_says_the_kernels_only_in_the_header(tmp_path: Path) -> None:
    """A trace with a kernel choice: the header's kernels line is not repeated in the summary."""
    doc = json.loads((GOLDEN / "tiny_trace.json").read_text(encoding="utf-8"))
    doc["kernels"] = {"picked": "fp32", "dtype": "fp32", "weights": "dense", "decode_kernel": "mv",
                      "source": "default", "numerics": "exact", "rule": "the fastest acceptable candidate", "candidates": [], "measured_seconds": 0.0}
    path = tmp_path / "t.json"
    path.write_text(json.dumps(doc), encoding="utf-8")
    text = _show(path)
    header, summary = text[:text.index("╭")], text[text.index("8 · Summary"):]
    assert "kernels fp32 dense, mv (exact) · default\n" in header
    assert not any(line.lstrip("│ ").startswith("kernels") for line in summary.splitlines())


def test_a_chat_shows_prompt_and_reply_apart(tmp_path: Path) -> None:
    doc = json.loads((GOLDEN / "tiny_trace.json").read_text(encoding="utf-8"))
    path = tmp_path / "chat.json"
    plain = _show(GOLDEN / "tiny_trace.json")
    assert "The sky is blue because" + doc["generated_text"][:3] in plain  # a continuation: one text
    doc["settings"]["chat"] = True
    path.write_text(json.dumps(doc), encoding="utf-8")
    lines = _show(path).splitlines()
    prompt = next(i for i, line in enumerate(lines) if "prompt: The sky is blue because" in line)
    assert "reply:" in lines[prompt + 1] and doc["generated_text"][:3] in lines[prompt + 1]


def test_warnings_go_to_stderr_wrapped(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    from llmtrace.cli.console import warn

    monkeypatch.delenv("COLUMNS", raising=False)
    message = "roofline: measured this machine in 725 ms (fp32 GEMMs, copy); not saved: " + "other processes " * 8
    warn(message)
    out, err = capsys.readouterr()
    assert out == ""
    lines = err.splitlines()
    assert lines[0].startswith("warning: roofline:") and len(lines) > 1
    assert all(cell_len(line) <= 80 for line in lines)
    assert " ".join(" ".join(lines).split()) == " ".join(f"warning: {message}".split())


@pytest.mark.parametrize(("file", "name"), [
    ("SmolLM2-135M-Instruct.Q4_1.gguf", "SmolLM2-135M-Instruct"), ("llama-2-7b.Q4_K_M.gguf", "llama-2-7b"),
    ("Qwen2-0.5B-Instruct-IQ2_XS.gguf", "Qwen2-0.5B-Instruct"), ("mistral-7b-v0.1.f16.gguf", "mistral-7b-v0.1"),
    ("model.gguf", "model"), ("Q4_0.gguf", "Q4_0"),
])
def test_a_gguf_is_named_by_its_file(file: str, name: str) -> None:
    from llmtrace.tracer.checkpoint.resolve import gguf_model_name

    assert gguf_model_name(f"/some/folder/{file}") == name


def test_the_model_has_one_name_in_the_spinner_and_every_view(tiny_quantized: Any, tmp_path: Path) -> None:
    """The loading spinner (model_name) and the config every view prints (config.name) agree: a GGUF is its file's
    name, without the quantization."""
    import gguf

    from llmtrace.tracer.checkpoint.resolve import classify_model, model_name, resolve_model

    path = tmp_path / "Tiny-Chat.Q8_0.gguf"
    shutil.copyfile(tiny_quantized(gguf.GGMLQuantizationType.F32), path)
    source = classify_model(str(path))
    assert model_name(source) == resolve_model(source).config.name == "Tiny-Chat"
