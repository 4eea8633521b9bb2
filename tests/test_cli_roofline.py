"""`llmtrace roofline` and `llmtrace hardware` as a user runs them: real subprocesses, exit codes, stdout/stderr."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from rich.console import Console

from llmtrace.cli.render_roofline import chart_points, render_report, roofline_chart, why_line
from llmtrace.tracer.core.dtypes import INT4
from llmtrace.tracer.core.presets import get_preset
from llmtrace.tracer.hardware.profiles import get_profile
from llmtrace.tracer.roofline.analysis import roofline

REPO = Path(__file__).resolve().parent.parent

# Runs the real entry point, then reports on stderr whether torch (or numpy) got imported along the way.
_WRAPPER = """
import sys
from llmtrace.cli.app import main
try:
    main(sys.argv[1:])
except SystemExit as exc:
    code = exc.code
print(f"IMPORTED torch={'torch' in sys.modules} numpy={'numpy' in sys.modules}", file=sys.stderr)
sys.exit(code)
"""


def llmtrace(*args: str, config_home: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, XDG_CONFIG_HOME=str(config_home), COLUMNS="120")
    return subprocess.run([sys.executable, "-c", _WRAPPER, *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=120)


def _imports(stderr: str) -> str:
    return [line for line in stderr.splitlines() if line.startswith("IMPORTED")][-1]


def _error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if not line.startswith("IMPORTED")]


def test_roofline_json_answers_the_seed_question_without_torch(tmp_path: Path) -> None:
    out = llmtrace("roofline", "--json", config_home=tmp_path)
    assert out.returncode == 0, out.stderr
    assert _imports(out.stderr) == "IMPORTED torch=False numpy=False"
    assert _error_lines(out.stderr) == []  # stdout alone carries the JSON
    data = json.loads(out.stdout)
    assert data["model"] == "llama-7b" and data["machine"]["hardware"] == "a100-80gb"
    assert data["prefill"]["bound"] == "compute" and data["last_decode"]["bound"] == "memory"
    assert 145 < data["generation"]["tokens_per_s_per_sequence"] < 156
    assert data["machine"]["ridge_point"] == pytest.approx(312 / 2.039)
    assert (data["kernels"], data["kernels_from"]) == ("fused", "default")
    assert data["memory"]["activation_bytes_per_device"] > 0
    eager = json.loads(llmtrace("roofline", "--json", "--kernels", "eager", config_home=tmp_path).stdout)
    assert (eager["kernels"], eager["kernels_from"]) == ("eager", "option")
    assert eager["prefill"]["activation_bytes"] > data["prefill"]["activation_bytes"]


def test_roofline_text_with_tp(tmp_path: Path) -> None:
    out = llmtrace("roofline", "--model", "llama2-70b", "--hardware", "h100-sxm", "--tp", "4", "--batch", "8",
                   config_home=tmp_path)
    assert out.returncode == 0, out.stderr
    assert _imports(out.stderr) == "IMPORTED torch=False numpy=False"
    text = out.stdout
    for needle in ("4 × NVIDIA H100 80GB SXM", "Why decode is slow", "memory-bound", "Tensor parallelism over 4",
                   "all-reduce", "Decode step at S=639 over batch sizes", "decode becomes compute-bound from batch",
                   "Roofline of h100-sxm"):
        assert needle in text, needle


def test_hardware_lists_profiles_without_torch(tmp_path: Path) -> None:
    out = llmtrace("hardware", "--json", config_home=tmp_path)
    assert out.returncode == 0, out.stderr
    assert _imports(out.stderr) == "IMPORTED torch=False numpy=False"
    data = json.loads(out.stdout)
    names = [p["name"] for p in data["profiles"]]
    assert "a100-80gb" in names and "m3-max" in names and "this-machine" not in names
    a100 = next(p for p in data["profiles"] if p["name"] == "a100-80gb")
    assert a100["fp16"] == 312e12 and a100["ridge_point"]["fp16"] == pytest.approx(312 / 2.039)
    text = llmtrace("hardware", config_home=tmp_path)
    assert text.returncode == 0 and "rtx-4090" in text.stdout and "llmtrace hardware --measure" in text.stdout


@pytest.mark.parametrize("args, message", [
    (["--hardware", "a100-80"], "unknown hardware 'a100-80'; did you mean a100-80gb"),
    (["--hardware", "this-machine"], "run `llmtrace hardware --measure`"),
    (["--model", "llama2-70b", "--dtype", "int4", "--tp", "3"], "--tp 3 does not divide llama2-70b's 64 query heads"),
    (["--batch", "0"], "--batch"),
    (["--model", "llama2-70b"], "does not fit on a100-80gb"),
    (["--model", "llama-7b", "--hardware", "m2-max", "--tp", "2"], "m2-max has no interconnect"),
    (["--model", "no-such-model"], "unknown model 'no-such-model'"),
    (["--model", "llama3.1-8b", "--hardware", "h100", "--prompt-len", "32768", "--kernels", "eager"],
     "eager kernels' largest activations 128.0 GiB"),
])
def test_bad_input_is_one_line_and_exit_2(tmp_path: Path, args: list[str], message: str) -> None:
    out = llmtrace("roofline", *args, config_home=tmp_path)
    assert out.returncode == 2
    lines = _error_lines(out.stderr)
    assert len(lines) == 1 and message in lines[0], out.stderr
    assert lines[0].startswith("llmtrace: error:")
    assert out.stdout == ""


def test_measure_then_roofline_on_this_machine(tmp_path: Path) -> None:
    """Tiny sizes (128x128 GEMM, 1 MiB copy, one run each): about a second plus torch's import."""
    out = llmtrace("hardware", "--measure", "--dtypes", "fp32", "--max-n", "128", "--copy-mib", "1",
                   "--repeats", "1", "--json", config_home=tmp_path)
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert data["profile"]["name"] == "this-machine" and data["profile"]["measured"] is True
    assert data["measurement"]["gemms"][0]["n"] == 128
    assert Path(data["saved_to"]) == tmp_path / "llmtrace" / "hardware.json"

    pred = llmtrace("roofline", "--hardware", "this-machine", "--model", "smollm2-135m", "--dtype", "fp32",
                    "--json", config_home=tmp_path)
    assert pred.returncode == 0, pred.stderr
    assert _imports(pred.stderr) == "IMPORTED torch=False numpy=False"  # reading the profile needs no torch
    machine = json.loads(pred.stdout)["machine"]
    assert machine["measured"] is True and machine["compute_dtype"] == "fp32"
    assert json.loads(pred.stdout)["kernels"] == "eager"  # this machine runs llmtrace's own (eager) model
    assert machine["memory_bandwidth"] == data["profile"]["memory_bandwidth"]

    no_fp16 = llmtrace("roofline", "--hardware", "this-machine", "--model", "smollm2-135m", "--dtype", "fp16",
                       config_home=tmp_path)
    assert no_fp16.returncode == 2 and "this-machine has no fp16 peak" in _error_lines(no_fp16.stderr)[0]


def test_bad_measure_request(tmp_path: Path) -> None:
    out = llmtrace("hardware", "--measure", "--dtypes", "int8", config_home=tmp_path)
    assert out.returncode == 2 and "cannot measure 'int8'" in _error_lines(out.stderr)[0]


# ---- the chart ----------------------------------------------------------------------------------------------


def test_why_line_says_which_side_of_the_ridge() -> None:
    a100 = get_profile("a100-80gb")
    low = why_line(roofline(get_preset("llama-7b"), a100, prompt_len=512, new_tokens=128))
    assert "153× below the ridge point: the step is memory-bound" in low
    high = why_line(roofline(get_preset("llama-7b"), a100, prompt_len=16, new_tokens=2, batch=512))
    assert "× above the ridge point: the step is compute-bound" in high and "below" not in high


def test_chart_puts_each_pass_on_the_roof() -> None:
    report = roofline(get_preset("llama-7b"), get_profile("a100-80gb"), prompt_len=512, new_tokens=128)
    points = chart_points(report)
    assert [p.mark for p in points] == ["P", "D", "d", "B"]
    # prefill (294 FLOPs/byte) is past the ridge: on the flat compute roof; decode (1.0) on the slanted one
    assert points[0].flops_per_s == 312e12
    assert points[1].flops_per_s == pytest.approx(2.039e12 * points[1].intensity)
    lines = [line.plain for line in roofline_chart(312e12, 2.039e12, points, width=60, height=14)]
    grid = lines[:14]
    top_roof_row = next(i for i, line in enumerate(grid) if "─" in line)
    assert "P" in grid[top_roof_row]  # on the compute roof
    decode_row = next(i for i, line in enumerate(grid) if "D" in line)
    assert decode_row > top_roof_row + 4  # far below: ~150x less attainable FLOP/s
    assert "1T" in "".join(grid) and "100T" in "".join(grid)
    assert lines[15].split() == ["0.1", "1", "10", "100", "1k"]


def test_render_report_in_80_columns() -> None:
    report = roofline(get_preset("llama3-8b"), get_profile("rtx-4090"), prompt_len=1000, new_tokens=200,
                      dtype=INT4, batch=4)
    console = Console(width=80, record=True, file=open(os.devnull, "w"))
    render_report(console, report)
    text = console.export_text()
    assert "int4 weights are dequantized in the kernel and multiplied in fp16" in text
    assert "Why decode is slow" in text and "…" not in text  # nothing cut off at 80 columns
