"""The habits of command-line users: --version, -h, '-' for standard input, sample prompts that say so, pipes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from llmtrace.cli.app import app
from llmtrace.cli.prompt_input import resolve_prompt, sample_prompt_names
from llmtrace.tracer.core.errors import BadArgumentError
from llmtrace.tracer.trace.run_trace import Trace

runner = CliRunner()
REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(autouse=True)
def _private_config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))


def test_version_comes_from_the_installed_metadata() -> None:
    from importlib.metadata import version

    result = runner.invoke(app, ["--version"])
    assert result.exit_code == 0 and result.stdout == f"llmtrace {version('llmtrace')}\n"


@pytest.mark.parametrize("command", [[], ["run"], ["show"], ["kvmem"]])
def test_dash_h_is_help(command: list[str]) -> None:
    short, long = runner.invoke(app, [*command, "-h"]), runner.invoke(app, [*command, "--help"])
    assert short.exit_code == 0 and short.stdout == long.stdout and "Usage: llmtrace" in short.stdout


def test_sample_names_come_from_the_package_data() -> None:
    assert sample_prompt_names() == sorted(p.stem for p in (REPO / "sample_prompts").glob("*.txt"))
    assert "capital" in sample_prompt_names() and "__init__" not in sample_prompt_names()


def test_a_sample_name_says_where_the_prompt_came_from_and_literal_keeps_the_word() -> None:
    sample = resolve_prompt("capital", None, literal=False, default=None)
    assert sample.text == "The capital of France is" and sample.source.startswith("sample prompt 'capital'")
    assert "--literal" in sample.source
    assert resolve_prompt("capital", None, literal=True, default=None).text == "capital"
    assert resolve_prompt("capital.txt", None, literal=False, default=None).text == "The capital of France is"
    for not_a_sample in ("../sample_prompts/capital", "Capital of Peru", "__init__", ".hidden"):
        given = resolve_prompt(not_a_sample, None, literal=False, default=None)
        assert given.text == not_a_sample and given.source == ""


def _dry(*args: str, stdin: str | None = None) -> object:
    return runner.invoke(app, ["run", *args, "--dry-run", "--model", "smollm2-135m", "--prompt-tokens", "4",
                               "--json", "-"], input=stdin)


def test_run_says_it_took_a_sample_and_literal_traces_the_word() -> None:
    sample = _dry("sky")
    assert sample.exit_code == 0, sample.stderr
    assert "prompt: sample prompt 'sky'" in sample.stderr
    assert Trace.from_json(sample.stdout).settings.prompt == "Explain in one sentence why the sky is blue."
    literal = _dry("sky", "--literal")
    assert literal.exit_code == 0 and "prompt:" not in literal.stderr
    assert Trace.from_json(literal.stdout).settings.prompt == "sky"


@pytest.mark.parametrize("how", [["-"], ["--file", "-"]])
def test_dash_reads_the_prompt_from_stdin(how: list[str]) -> None:
    result = _dry(*how, stdin="The sky is\n")
    assert result.exit_code == 0, result.stderr
    assert Trace.from_json(result.stdout).settings.prompt == "The sky is" and "prompt: stdin" in result.stderr


def test_empty_stdin_is_one_line() -> None:
    result = _dry("-", stdin="")
    assert result.exit_code == 2 and "standard input was empty" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_resolve_prompt_errors() -> None:
    with pytest.raises(BadArgumentError, match="either as an argument or with --file"):
        resolve_prompt("x", Path("y"), literal=False, default=None)
    with pytest.raises(BadArgumentError, match="'-' to read standard input"):
        resolve_prompt(None, None, literal=False, default=None)
    assert resolve_prompt(None, None, literal=False, default="今天天气真").text == "今天天气真"
