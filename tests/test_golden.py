"""Golden files: the exact rendered output of the analytical commands and of a saved run shown again, at 80 and at
120 columns (tests/golden/<case>-<width>.txt), compared character for character.

Rendering is made deterministic: the width comes from COLUMNS (cli/console.py), output goes to a pipe so rich writes
no colour or other escape codes, the hardware store is an empty folder, and the run is a committed trace with fixed
timings (tests/golden/tiny_trace.json, tiny_dry_run.json, tiny_batch_trace.json, tiny_journey_trace.json and
tiny_moe_trace.json, written by tests/golden/make_trace_fixture.py).

After an intended change to the output, regenerate every golden file and review the diff:

    LLMTRACE_UPDATE_GOLDEN=1 .venv/bin/python -m pytest tests/test_golden.py
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from typer.testing import CliRunner

from llmtrace.cli.app import app

GOLDEN = Path(__file__).resolve().parent / "golden"
UPDATE = os.environ.get("LLMTRACE_UPDATE_GOLDEN") == "1"
WIDTHS = (80, 120)
CASES: dict[str, list[str]] = {
    "flops": ["flops"],
    "flops-llama3-macs": ["flops", "--model", "llama3-8b", "--prompt-len", "2000", "--max-new-tokens", "500",
                          "--macs"],
    # a mixture of experts: active parameters, the router's rows, the experts a decode step reads by batch size
    "flops-mixtral": ["flops", "--model", "mixtral-8x7b", "--prompt-len", "64", "--max-new-tokens", "16", "--batch",
                      "4"],
    "roofline-mixtral": ["roofline", "--model", "mixtral-8x7b", "--hardware", "h100-sxm", "--tp", "2", "--batch", "8"],
    "kvmem": ["kvmem", "--model", "llama3-8b", "--seq", "2000", "--budget", "24GiB"],
    "models": ["models"],
    "roofline": ["roofline"],
    "roofline-tp": ["roofline", "--model", "llama2-70b", "--hardware", "h100-sxm", "--tp", "4", "--batch", "8"],
    "hardware": ["hardware"],
    "show": ["show", "tiny_trace.json"],
    "show-ops": ["show", "tiny_trace.json", "--detail", "ops"],
    "show-dry-run": ["show", "tiny_dry_run.json"],
    "show-batch": ["show", "tiny_batch_trace.json"],  # run --batch 3: prompts of three lengths
    "show-summary": ["show", "tiny_trace.json", "--detail", "summary"],
    # the layers view, with why each backend not taken was not (the route, under the summary)
    "show-kernels": ["show", "tiny_trace.json", "--detail", "kernels"],
    # sampled with top-k and top-p, with the logit lens and attention (sections 5c and 5d)
    "show-journey": ["show", "tiny_journey_trace.json"],
    # a mixture of experts (4 experts, 2 per token): its stages, and section 7b, the experts each token went to
    "show-moe": ["show", "tiny_moe_trace.json"],
    "diff": ["diff", "tiny_trace.json", "tiny_journey_trace.json"],
    "run-help": ["run", "--help"],  # the options in their groups (cli/run_options.py)
}


# The hardware store's folder: printed by `hardware`, so fixed; never created (listing profiles writes nothing).
CONFIG_HOME = "/nonexistent/llmtrace-golden-config"


def render(args: list[str], width: int) -> str:
    env = {"COLUMNS": str(width), "LINES": "40", "XDG_CONFIG_HOME": CONFIG_HOME, "NO_COLOR": "1",
           "FORCE_COLOR": None, "TTY_COMPATIBLE": None, "TTY_INTERACTIVE": None, "LLMTRACE_DEBUG": None}
    result = CliRunner().invoke(app, args, env=env)
    assert result.exit_code == 0, result.output
    return result.stdout


@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("case", list(CASES))
def test_rendered_output_matches_golden(case: str, width: int, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(GOLDEN)  # `show` prints the trace's path as given: relative, the same everywhere
    text = render(CASES[case], width)
    golden = GOLDEN / f"{case}-{width}.txt"
    if UPDATE:
        golden.write_text(text, encoding="utf-8")
    assert golden.exists(), f"no {golden.name}; create it with LLMTRACE_UPDATE_GOLDEN=1"
    assert text == golden.read_text(encoding="utf-8"), (
        f"{case} at {width} columns differs from {golden.name}; if the change is intended, regenerate with "
        "LLMTRACE_UPDATE_GOLDEN=1 and review the diff")


@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("case", list(CASES))
def test_no_line_wider_than_the_terminal(case: str, width: int) -> None:
    from rich.cells import cell_len

    golden = GOLDEN / f"{case}-{width}.txt"
    if not golden.exists():
        pytest.skip(f"no {golden.name} yet")
    wide = [line for line in golden.read_text(encoding="utf-8").splitlines() if cell_len(line) > width]
    assert not wide, f"{len(wide)} lines of {golden.name} are wider than {width} columns: {wide[:3]}"


def test_golden_output_has_no_escape_codes() -> None:
    for golden in GOLDEN.glob("*.txt"):
        assert "\x1b" not in golden.read_text(encoding="utf-8"), golden.name


def _scaled(trace: dict, factor: float) -> dict:
    """The fixture's run with every clock reading `factor` times as long: a repeat of it on a noisy machine."""
    scaled = {**trace, "stages": [{**s, "duration_ns": round(s["duration_ns"] * factor)} for s in trace["stages"]],
              "steps": [{**s, **{k: round(s[k] * factor) for k in ("forward_ns", "duration_ns")}}
                        for s in trace["steps"]],
              "tokenization": {**trace["tokenization"],
                               "duration_ns": round(trace["tokenization"]["duration_ns"] * factor)}}
    return scaled


@pytest.mark.parametrize("width", WIDTHS)
def test_repeat_view_matches_golden(width: int) -> None:
    """`run --repeat 3`'s view: medians and spreads of three runs of the fixture's generation."""
    import io
    import json

    from rich.cells import cell_len
    from rich.console import Console

    from llmtrace.cli.render_run_repeat import render_repeat
    from llmtrace.tracer.trace.repeat_summary import repeat_summary
    from llmtrace.tracer.trace.run_trace import Trace

    raw = json.loads((GOLDEN / "tiny_trace.json").read_text(encoding="utf-8"))
    traces = [Trace.from_json(json.dumps(_scaled(raw, f))) for f in (1.0, 1.25, 0.9)]
    out = io.StringIO()
    render_repeat(Console(file=out, width=width, color_system=None, force_terminal=False), repeat_summary(traces))
    text = out.getvalue()
    golden = GOLDEN / f"repeat-{width}.txt"
    if UPDATE:
        golden.write_text(text, encoding="utf-8")
    assert text == golden.read_text(encoding="utf-8")
    assert all(cell_len(line) <= width for line in text.splitlines())
