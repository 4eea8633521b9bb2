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
    """A run's roofline profile is saved under tmp_path, never in the real ~/.config, and measured tiny."""
    from llmtrace.tracer.hardware import measure as hardware_measure

    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    monkeypatch.setitem(hardware_measure.QUICK, "cpu",
                        dict(repeats=1, gemm_target_seconds=0.0, gemm_max_n=128, copy_bytes=2**20))


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


# ---- files: .gz, atomic, '-' -----------------------------------------------------------------------------------


def test_gz_outputs_are_gzip_and_show_reads_them_and_stdin(tiny_llama_dir: Path, tmp_path: Path) -> None:
    import gzip

    trace_gz, chrome_gz = tmp_path / "t.json.gz", tmp_path / "t.perfetto.json.gz"
    result = runner.invoke(app, ["run", "The sky is", "--model", str(tiny_llama_dir), "--max-new-tokens", "2",
                                 "--no-roofline", "--json", str(trace_gz), "--chrome-trace", str(chrome_gz)])
    assert result.exit_code == 0, result.output
    raw = trace_gz.read_bytes()
    assert raw[:2] == b"\x1f\x8b"
    trace = Trace.from_json(gzip.decompress(raw).decode())
    assert trace.settings.prompt == "The sky is"
    assert json.loads(gzip.decompress(chrome_gz.read_bytes()))["traceEvents"]
    assert sorted(p.name for p in tmp_path.iterdir() if "partial" in p.name) == []  # no temporary left behind

    from_file = runner.invoke(app, ["show", str(trace_gz), "--detail", "summary"])
    from_stdin = runner.invoke(app, ["show", "-", "--detail", "summary"], input=raw)
    assert from_file.exit_code == 0 and from_stdin.exit_code == 0, from_file.output + from_stdin.output
    assert "8 · Summary" in from_file.stdout
    header = f"{trace.environment.device_name}"  # the header ends with the device's name, wrapped where it is long
    assert after_header(from_stdin.stdout, header) == after_header(from_file.stdout, header)


def after_header(text: str, ending: str) -> str:
    """`text` after its first lines up to the one that ends `ending` (however the header wrapped its words)."""
    lines, want = text.split("\n"), " ".join(ending.split())
    for k in range(1, len(lines) + 1):
        if " ".join(" ".join(lines[:k]).split()).endswith(want):
            return "\n".join(lines[k:])
    raise AssertionError(f"no header ending {ending!r} in {text[:300]!r}")


def test_a_failed_write_keeps_the_old_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    from llmtrace.cli import output_files

    target = tmp_path / "t.json"
    target.write_text("old")

    def refuse(src: str, dst: str) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", refuse)
    with pytest.raises(BadArgumentError, match="No space left on device"):
        output_files.write_output(target, "new")
    assert target.read_text() == "old" and [p.name for p in tmp_path.iterdir()] == ["t.json"]


@pytest.mark.parametrize("data, message", [(b"\x1f\x8b\x08\x00broken", "damaged gzip"),
                                           (b"\xff\xfe\x00", "not UTF-8"), (b"{}", "not an llmtrace trace")])
def test_show_bad_input_is_one_line(data: bytes, message: str, tmp_path: Path) -> None:
    (tmp_path / "bad.json").write_bytes(data)
    result = runner.invoke(app, ["show", str(tmp_path / "bad.json")])
    assert result.exit_code == 2 and message in result.stderr and len(result.stderr.strip().splitlines()) == 1


def test_a_closed_pipe_drops_the_report_but_not_the_trace(tiny_llama_dir: Path, tmp_path: Path) -> None:
    """`llmtrace run ... --json t.json | head -0`: the reader is gone before the first line."""
    import os
    import subprocess
    import sys

    read, write = os.pipe()
    os.close(read)  # every write to stdout now fails with EPIPE
    env = {**os.environ, "XDG_CONFIG_HOME": str(tmp_path / "config")}
    done = subprocess.run([sys.executable, "-m", "llmtrace", "run", "capital", "--model", str(tiny_llama_dir),
                           "--max-new-tokens", "2", "--no-roofline", "--json", str(tmp_path / "t.json")],
                          stdout=write, stderr=subprocess.PIPE, text=True, env=env, timeout=300)
    os.close(write)
    assert done.returncode == 0 and done.stderr == "", done.stderr
    assert Trace.from_json((tmp_path / "t.json").read_text()).settings.prompt == "The capital of France is"


# ---- the summary block --------------------------------------------------------------------------------------------


def test_summary_block_is_in_the_trace_and_one_line_on_stdout(tiny_llama_dir: Path, tmp_path: Path) -> None:
    import jsonschema

    from llmtrace.tracer.trace.run_trace import load_schema
    from llmtrace.tracer.trace.summary import run_summary

    path = tmp_path / "t.json"
    result = runner.invoke(app, ["run", "sky", "--model", str(tiny_llama_dir), "--max-new-tokens", "3",
                                 "--summary-json", "--json", str(path)])
    assert result.exit_code == 0, result.stderr
    assert result.stdout.count("\n") == 1  # one line, the report on stderr
    line = json.loads(result.stdout)
    data = json.loads(path.read_text())
    assert list(data)[:3] == ["schema", "schema_version", "summary"] and data["summary"] == line
    jsonschema.validate(data, load_schema())
    trace = Trace.from_dict(data)
    s = run_summary(trace)
    assert line["ttft_ns"] == s.ttft_ns > 0
    assert line["prompt_tokens"] == s.prompt_tokens and line["generated_tokens"] == 3
    assert line["decode_tokens_per_second"] == s.decode_tokens_per_second > 0
    assert line["prefill_tokens_per_second"] == pytest.approx(s.prompt_tokens / (s.prefill.forward_ns / 1e9))
    assert line["prefill_flops"] == s.prefill.totals.flops == sum(x.flops for x in trace.stages_of("prefill"))
    assert line["decode_flops"] == s.decode.totals.flops > 0
    assert line["decode_bytes_read"] == s.decode.totals.bytes_read
    assert line["kv_live_bytes"] == trace.steps[-1].kv_live_bytes and line["peak_rss_bytes"] == trace.peak_rss_bytes
    verdict = line["roofline"]
    assert verdict["hardware"] == "this-machine" and verdict["prefill_bound"] in ("compute", "memory")
    assert verdict["decode_percent_of_bound"] > 0


def test_summary_json_without_tracing_has_no_flops(tiny_llama_dir: Path) -> None:
    result = runner.invoke(app, ["run", "sky", "--model", str(tiny_llama_dir), "--max-new-tokens", "2",
                                 "--summary-json", "--no-trace", "--no-roofline"])
    assert result.exit_code == 0, result.stderr
    line = json.loads(result.stdout)
    assert line["prefill_flops"] is None and line["bytes_written"] is None and line["roofline"] is None
    assert line["decode_tokens_per_second"] > 0


def test_summary_json_and_json_to_stdout_collide() -> None:
    result = runner.invoke(app, ["run", "sky", "--summary-json", "--json", "-"])
    assert result.exit_code == 2 and "both write to stdout" in result.stderr
