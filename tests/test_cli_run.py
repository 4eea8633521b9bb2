"""`llmtrace run` through typer's CliRunner and as a real subprocess, on the tiny random model."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from typer.testing import CliRunner

from llmtrace.cli.app import app
from llmtrace.tracer.trace.run_trace import Trace, load_schema

REPO = Path(__file__).resolve().parent.parent
runner = CliRunner()


def _run(*args: str) -> object:
    return runner.invoke(app, ["run", *args])


@pytest.fixture(autouse=True)
def _private_config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Every run here saves its roofline profile under tmp_path, never in the real ~/.config, and measures tiny."""
    from llmtrace.tracer.hardware import measure as hardware_measure

    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    monkeypatch.setitem(hardware_measure.QUICK, "cpu",
                        dict(repeats=1, gemm_target_seconds=0.0, gemm_max_n=128, copy_bytes=2**20))
    return tmp_path / "config" / "llmtrace" / "hardware.json"


def test_run_shows_the_journey_in_order(tiny_llama_dir: Path) -> None:
    result = _run("今天天气真", "--model", str(tiny_llama_dir), "--max-new-tokens", "3")
    assert result.exit_code == 0, result.output
    out = result.output
    titles = ["1 · Tokenization", "2 · Embedding", "3 · Positions", "4 · Transformer layers × 2", "5 · LM head",
              "6 · Decode", "8 · Summary"]
    positions = [out.index(t) for t in titles]
    assert positions == sorted(positions)
    assert "<0x" in out  # 今天天气真 spelled in byte pieces by the tiny SentencePiece vocabulary
    assert "layer 0" in out and "layer 1" in out
    assert "logits [1, " in out and "TTFT" in out and "tok/s" in out
    assert "stopped: --max-new-tokens reached · 3 tokens generated" in out


def test_detail_ops_expands_layers_into_stages(tiny_llama_dir: Path) -> None:
    result = _run("sky", "--model", str(tiny_llama_dir), "--max-new-tokens", "2", "--detail", "ops")
    assert result.exit_code == 0, result.output
    for label in ("Q|K|V proj", "RoPE q,k", "scores QKᵀ/√D", "softmax", "probs·V", "O proj", "gate|up (w1|w3)",
                  "silu(gate)·up", "down (w2)", "residual +"):
        assert label in result.output
    assert "traced: the fused path" in result.output
    assert "Explain in one sentence why the sky is blue." in result.output  # sample prompt by name


def test_staged_traces_q_k_v_gate_and_up_apart(tiny_llama_dir: Path) -> None:
    result = _run("sky", "--model", str(tiny_llama_dir), "--max-new-tokens", "2", "--detail", "ops", "--staged")
    assert result.exit_code == 0, result.output
    for label in ("Q proj", "K proj", "V proj", "gate (w1)", "up (w3)", "down (w2)", "traced: stage by stage"):
        assert label in result.output
    assert "Q|K|V proj" not in result.output
    # a dense model has no native decode step: its decode steps ran the stage modules, and the view says why
    assert "--staged: the decode steps ran the stage modules, each wrapped (no native decode step" in _unwrapped(
        result.output)


def test_staged_on_the_native_step_says_so(tiny_quantized: Any) -> None:
    import gguf

    path = tiny_quantized(gguf.GGMLQuantizationType.Q8_0)
    result = _run("sky", "--model", str(path), "--weights", "native", "--max-new-tokens", "3", "--staged")
    assert result.exit_code == 0, result.output
    text = _unwrapped(result.output)
    assert "--staged: each decode step ran the native step's stages apart in C" in text
    for label in ("Q proj", "K proj", "V proj", "gate (w1)", "up (w3)"):
        assert label in result.output


def _unwrapped(output: str) -> str:
    """The report's text with the panels' borders and line breaks taken out (a note wraps at the terminal's width)."""
    return " ".join(line.strip().strip("│").strip() for line in output.splitlines())


def test_json_to_stdout_is_the_trace_alone(tiny_llama_dir: Path) -> None:
    result = runner.invoke(app, ["run", "capital", "--model", str(tiny_llama_dir), "--max-new-tokens", "2",
                                 "--json", "-", "--temperature", "0.7", "--top-p", "0.9", "--seed", "5"])
    assert result.exit_code == 0, result.stderr
    data = json.loads(result.stdout)
    jsonschema.validate(data, load_schema())
    trace = Trace.from_dict(data)
    assert trace.settings.prompt == "The capital of France is"
    assert trace.settings.top_p == 0.9 and trace.steps[0].filters == ("temperature", "top_p")
    assert len(trace.generated_ids) == 2


def test_json_and_chrome_trace_files(tiny_llama_dir: Path, tmp_path: Path) -> None:
    trace_path, chrome_path = tmp_path / "t.json", tmp_path / "t.perfetto.json"
    result = _run("sky", "--model", str(tiny_llama_dir), "--max-new-tokens", "2", "--json", str(trace_path),
                  "--chrome-trace", str(chrome_path))
    assert result.exit_code == 0, result.output
    assert Trace.from_json(trace_path.read_text(encoding="utf-8")).generated_ids
    chrome = json.loads(chrome_path.read_text(encoding="utf-8"))
    assert any(e.get("name") == "decode step 1" for e in chrome["traceEvents"])


def test_no_trace_still_runs_and_says_so(tiny_llama_dir: Path) -> None:
    result = _run("sky", "--model", str(tiny_llama_dir), "--max-new-tokens", "2", "--no-trace")
    assert result.exit_code == 0, result.output
    assert "not traced (--no-trace)" in result.output and "8 · Summary" in result.output
    assert "Decode by stage" not in result.output


def test_decode_by_stage_shows_where_a_step_goes(tiny_llama_dir: Path) -> None:
    result = _run("sky", "--model", str(tiny_llama_dir), "--max-new-tokens", "4")
    assert result.exit_code == 0, result.output
    out = result.output
    assert out.index("6 · Decode ") < out.index("7 · Decode by stage") < out.index("8 · Summary")
    panel = out[out.index("7 · Decode by stage"):out.index("8 · Summary")]
    for label in ("RMSNorm (attention)", "Q|K|V proj", "gate|up (w1|w3)", "down (w2)", "LM head", "mean of 3 decode steps"):
        assert label in panel
    assert "Decode by stage" not in _run("sky", "--model", str(tiny_llama_dir), "--max-new-tokens", "4",
                                         "--detail", "summary").output


def test_dry_run_of_llama_7b() -> None:
    result = _run("--model", "llama-7b", "--dry-run", "--prompt-tokens", "4")
    assert result.exit_code == 0, result.output
    out = result.output
    assert "Transformer layers × 32" in out
    assert "32 layers, each turning [1, 4, 4096] into the same shape" in out
    assert out.count("= equal") == 2  # prefill and decode step: traced FLOPs equal estimate.py's
    assert "6 · Decode" not in out


@pytest.mark.parametrize("args, message", [
    (["sky", "--max-new-tokens", "0"], "--max-new-tokens must be at least 1"),
    (["sky", "--top-k", "5"], "--top-k has no effect when --temperature is 0"),
    (["sky", "--model", "./no/such/folder"], "no such file or folder"),
    (["sky", "--model", "llama-7b"], "has no weights"),
    ([], "no prompt"),
    (["--file", "/no/such/prompt.txt"], "cannot read prompt file"),
])
def test_bad_input_is_one_line_and_exit_2(args: list[str], message: str, tiny_llama_dir: Path) -> None:
    if "--model" not in args and args[:1] != []:
        args = [*args, "--model", str(tiny_llama_dir)]
    result = runner.invoke(app, ["run", *args])
    assert result.exit_code == 2, result.output
    assert message in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    assert "Traceback" not in result.output


def test_real_subprocess(tiny_llama_dir: Path, tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO), "XDG_CONFIG_HOME": str(tmp_path / "config")}
    out = tmp_path / "trace.json"
    proc = subprocess.run(
        [sys.executable, "-m", "llmtrace", "run", "Once upon a time", "--model", str(tiny_llama_dir),
         "--max-new-tokens", "2", "--json", str(out), "--threads", "1", "--no-roofline"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert "8 · Summary" in proc.stdout
    trace = Trace.from_json(out.read_text(encoding="utf-8"))
    assert trace.environment.threads == 1 and len(trace.generated_ids) == 2
    bad = subprocess.run([sys.executable, "-m", "llmtrace", "run", "sky", "--max-new-tokens", "-3"], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "at least 1" in bad.stderr


def test_summary_compares_with_this_machines_roofline(tiny_llama_dir: Path, tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    from llmtrace.tracer.hardware.profiles import THIS_MACHINE, HardwareProfile
    from llmtrace.tracer.hardware.store import save_measured_profile

    profile = HardwareProfile(
        name=THIS_MACHINE, label="test machine", memory_bandwidth=30e9, memory_bytes=24 * 2**30, fp32=120e9,
        tf32=None, bf16=None, fp16=None, fp8=None, int8=None, interconnect="none", interconnect_bandwidth=0.0,
        source="test", measured=True,
    )
    save_measured_profile(profile, {})
    # fp32 explicitly: the profile has only an fp32 ceiling, and --dtype auto may pick bf16 on this CPU.
    result = _run("sky", "--model", str(tiny_llama_dir), "--max-new-tokens", "3", "--dtype", "fp32")
    assert result.exit_code == 0, result.output
    assert ("roofline (eager kernels): this-machine fp32 peak 120 GFLOP/s, 30.0 GB/s, ridge 4.00 FLOP/B"
            in result.output)
    assert "memory-bound" in result.output and "of the bound" in result.output
    assert "measured this machine" not in result.output  # the saved profile is used as it is

    # A bf16 run has no bf16 ceiling in this profile: a clear note, no bound taken from the fp32 peak.
    result = _run("sky", "--model", str(tiny_llama_dir), "--max-new-tokens", "2", "--dtype", "bf16")
    assert result.exit_code == 0, result.output
    assert "has no bf16 peak FLOP/s (fp32 only)" in result.output and "of the bound" not in result.output


def test_first_run_measures_this_machine_and_saves_it(tiny_llama_dir: Path, _private_config: Path) -> None:
    from llmtrace.tracer.hardware.profiles import THIS_MACHINE
    from llmtrace.tracer.hardware.store import load_measured_profiles

    assert not _private_config.exists()
    result = _run("sky", "--model", str(tiny_llama_dir), "--max-new-tokens", "2", "--dtype", "bf16")
    assert result.exit_code == 0, result.output
    assert "roofline: measured this machine in" in result.output and "(fp32, bf16 GEMMs, copy)" in result.output
    profile = load_measured_profiles(_private_config)[THIS_MACHINE]
    assert profile.measured and profile.fp32 and profile.bf16 and profile.memory_bandwidth > 0
    assert "roofline (eager kernels): this-machine bf16 peak" in result.output and "of the bound" in result.output
    again = _run("sky", "--model", str(tiny_llama_dir), "--max-new-tokens", "2", "--dtype", "bf16")
    assert "measured this machine" not in again.output and "roofline (eager kernels): this-machine bf16" in again.output


def test_no_roofline_skips_the_measurement(tiny_llama_dir: Path, _private_config: Path) -> None:
    result = _run("sky", "--model", str(tiny_llama_dir), "--max-new-tokens", "2", "--no-roofline")
    assert result.exit_code == 0, result.output
    assert "roofline" not in result.output and not _private_config.exists()


@pytest.mark.parametrize("option", ["--json", "--chrome-trace"])
def test_unwritable_output_path_fails_before_the_model_runs(option: str, tiny_llama_dir: Path,
                                                            tmp_path: Path) -> None:
    result = _run("sky", "--model", str(tiny_llama_dir), "--max-new-tokens", "2", option,
                  str(tmp_path / "missing" / "t.json"))
    assert result.exit_code == 2, result.output
    assert "no folder" in result.stderr and len(result.stderr.strip().splitlines()) == 1
    assert "1 · Tokenization" not in result.output and "Traceback" not in result.output


def test_kept_column_names_only_the_filter_that_dropped_the_token() -> None:
    from llmtrace.cli.render_run import _kept_cell
    from llmtrace.tracer.trace.records import CandidateRecord

    def cand(k: bool, p: bool, m: bool) -> CandidateRecord:
        return CandidateRecord(token_id=1, piece="a", logit=1.0, logit_penalized=1.0, prob_raw=0.1,
                               prob_tempered=0.1, kept_top_k=k, kept_top_p=p, kept_min_p=m, prob_final=0.0)

    assert _kept_cell(cand(True, False, False)) == "✗ top-p"  # min-p off keeps everything: not named
    assert _kept_cell(cand(False, False, False)) == "✗ top-k"
    assert _kept_cell(cand(True, True, False)) == "✗ min-p"
    assert _kept_cell(cand(True, True, True)) == "✓"


def test_sampling_run_shows_model_and_final_probabilities_survivors_and_the_drawn_seed(
        tiny_llama_dir: Path) -> None:
    result = _run("sky", "--model", str(tiny_llama_dir), "--max-new-tokens", "3", "--temperature", "0.7",
                  "--top-p", "0.9", "--no-roofline")
    assert result.exit_code == 0, result.output
    out = result.output
    assert "p model" in out and "p sampled" in out and "model p = " in out and "after sampling" in out
    assert "top-p 0.9 kept " in out and " bits" in out and "entropy " in out
    assert ": the fewest whose probabilities reach 0.9 (" in out  # and why: the mass they hold
    assert "✗ pm" not in out and "drawn: replay this run with --seed " in out
    greedy = _run("sky", "--model", str(tiny_llama_dir), "--max-new-tokens", "2", "--no-roofline")
    assert "p model" in greedy.output and "p sampled" not in greedy.output and "greedy keeps 1 token" in greedy.output
    assert "replay" not in greedy.output


def test_dry_run_follows_dtype() -> None:
    bf16 = _run("--model", "llama-7b", "--dry-run", "--prompt-tokens", "4", "--dtype", "bf16")
    fp32 = _run("--model", "llama-7b", "--dry-run", "--prompt-tokens", "4", "--dtype", "fp32")
    assert bf16.exit_code == 0 and fp32.exit_code == 0, bf16.output + fp32.output
    assert "dry run (meta device) bf16" in bf16.output and "in bfloat16" in bf16.output
    assert "13.21 GB" in bf16.output and "26.43 GB" in fp32.output  # 6.6 G parameters at 2 and 4 bytes
    assert bf16.output.count("= equal") == 2  # estimate.py is asked for bf16 weights too


def test_dry_run_says_where_its_prompt_length_came_from() -> None:
    given = _run("--model", "llama-7b", "--dry-run", "--prompt-len", "9")
    assert given.exit_code == 0, given.output
    assert "assuming 9 prompt tokens (as --prompt-len says)" in given.output
    counted = _run("x" * 7, "--model", "llama-7b", "--dry-run")
    assert "assuming 7 prompt tokens (one per character of the prompt; set --prompt-len)" in counted.output


def test_repeat_reports_medians_and_spreads_over_identical_runs(tiny_llama_dir: Path) -> None:
    from llmtrace.tracer.load.loader import load_model
    from llmtrace.tracer.run.generate import Generation
    from llmtrace.tracer.trace.records import RunSettings
    from llmtrace.tracer.trace.repeat_summary import repeat_summary

    loaded = load_model(str(tiny_llama_dir))
    settings = RunSettings(model=str(tiny_llama_dir), prompt="sky", max_new_tokens=4, temperature=0.8, seed=3)
    traces = [Generation(loaded, settings).run() for _ in range(3)]
    assert len({t.generated_ids for t in traces}) == 1  # same seed: same tokens, same work
    summary = repeat_summary(traces)
    assert summary.repeats == 3 and len(summary.ttft.samples) == 3
    decode = [t.steps[1:] for t in traces]
    per_token = sorted(sum(s.duration_ns for s in d) / 1e9 / len(d) for d in decode)
    assert summary.decode_per_token.median == pytest.approx(per_token[1])
    assert (summary.decode_per_token.fastest, summary.decode_per_token.slowest) == pytest.approx(
        (per_token[0], per_token[2]))
    roles = {s.role for s in summary.stages}
    assert "output" in roles and len(roles) == len(summary.stages)

    result = _run("sky", "--model", str(tiny_llama_dir), "--max-new-tokens", "3", "--repeat", "2", "--no-roofline")
    assert result.exit_code == 0, result.output
    assert "Repeated 2 times" in result.output and "decode per token" in result.output and "spread" in result.output
