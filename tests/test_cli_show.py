"""`llmtrace show`: a trace saved by `llmtrace run --json` renders again as `run` showed it, without the model."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from llmtrace.cli.app import app

REPO = Path(__file__).resolve().parent.parent
runner = CliRunner()


@pytest.fixture(autouse=True)
def _private_config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))


def _between(text: str, start: str, end: str) -> str:
    return text[text.index(start):text.index(end)]


@pytest.fixture
def saved(tiny_llama_dir: Path, tmp_path: Path) -> tuple[str, Path]:
    path = tmp_path / "run.json"
    result = runner.invoke(app, ["run", "sky", "--model", str(tiny_llama_dir), "--max-new-tokens", "4",
                                 "--detail", "ops", "--no-roofline", "--json", str(path)])
    assert result.exit_code == 0, result.output
    return result.output, path


def test_show_renders_the_sections_run_printed(saved: tuple[str, Path]) -> None:
    live, path = saved
    result = runner.invoke(app, ["show", str(path), "--detail", "ops"])
    assert result.exit_code == 0, result.output
    shown = result.output
    # Sections 1-5 and the decode-by-stage panel come from the records alone: the same text, character for character.
    assert _between(shown, "1 · Tokenization", "6 · Decode ") == _between(live, "1 · Tokenization", "6 · Decode ")
    assert (_between(shown, "7 · Decode by stage", "8 · Summary")
            == _between(live, "7 · Decode by stage", "8 · Summary"))
    # The decode stream becomes its final table; the summary has the same numbers.
    for text in (live, shown):
        assert "4/4 tokens" in text and "Q|K|V proj" in text
    assert _between(shown, "8 · Summary", "KV cache:") == _between(live, "8 · Summary", "KV cache:")
    assert "5b · Sampling lesson" in shown
    assert f"{path}: llmtrace " in shown and "roofline: left out of a saved trace" in shown


def test_show_writes_a_chrome_trace(saved: tuple[str, Path], tmp_path: Path) -> None:
    _, path = saved
    out = tmp_path / "t.perfetto.json"
    result = runner.invoke(app, ["show", str(path), "--detail", "summary", "--chrome-trace", str(out)])
    assert result.exit_code == 0, result.output
    spans = [e for e in json.loads(out.read_text())["traceEvents"] if e["ph"] == "X"]
    assert {"prefill", "decode step 1", "layer 0", "attention.wqkv"} <= {e["name"] for e in spans}
    assert "Decode by stage" not in result.output  # --detail summary


def test_show_a_dry_run(tmp_path: Path) -> None:
    path = tmp_path / "dry.json"
    assert runner.invoke(app, ["run", "--model", "llama-7b", "--dry-run", "--json", str(path)]).exit_code == 0
    result = runner.invoke(app, ["show", str(path)])
    assert result.exit_code == 0, result.output
    assert "32 layers, each turning [1, 5, 4096]" in result.output and "= equal" in result.output


@pytest.mark.parametrize("content, message", [
    (None, "no file"),
    ("{", "not valid JSON"),
    ('{"schema": "llmtrace.flops/1"}', "not an llmtrace trace"),
    ('{"schema": "llmtrace.trace", "schema_version": 1}', "does not match the schema"),
])
def test_bad_trace_files_are_one_line_and_exit_2(content: str | None, message: str, tmp_path: Path) -> None:
    path = tmp_path / "trace.json"
    if content is not None:
        path.write_text(content)
    proc = subprocess.run([sys.executable, "-c", "from llmtrace.cli.app import main; main()", "show", str(path)], cwd=REPO,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1 and message in proc.stderr and "Traceback" not in proc.stderr


def test_show_needs_no_torch(saved: tuple[str, Path]) -> None:
    _, path = saved
    proc = subprocess.run([sys.executable, "-X", "importtime", "-c", "from llmtrace.cli.app import main; main()", "show",
                           str(path)], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr[-2000:]
    modules = {line.rsplit("|", 1)[1].strip() for line in proc.stderr.splitlines() if line.startswith("import time:")}
    assert "llmtrace.cli.render_run_report" in modules  # the show command was loaded
    assert not {m for m in modules if m.split(".")[0] in ("torch", "numpy")}


def test_an_unwritable_chrome_trace_path_fails_before_rendering(saved: tuple[str, Path], tmp_path: Path) -> None:
    _, path = saved
    result = runner.invoke(app, ["show", str(path), "--chrome-trace", str(tmp_path / "missing" / "t.json")])
    assert result.exit_code == 2 and "1 · Tokenization" not in result.output
