"""`llmtrace run --tp 2` for real: two spawned ranks on gloo over the tiny random model (a few seconds each, most of
it two processes importing torch). Same tokens and logits as one device, every rank's records and collectives in the
trace, and the failures: a rank that dies, one that hangs, a Ctrl-C, each ended with one line and a partial trace."""

from __future__ import annotations

import json
import platform
from pathlib import Path

import jsonschema
import pytest
from typer.testing import CliRunner

from llmtrace.cli.app import app
from llmtrace.tracer.core.dtypes import FP32
from llmtrace.tracer.load.loader import load_model
from llmtrace.tracer.run.generate import generate
from llmtrace.tracer.run.tp_launch import run_tensor_parallel
from llmtrace.tracer.trace.chrome import chrome_trace
from llmtrace.tracer.trace.records import RunSettings
from llmtrace.tracer.trace.run_trace import STOP_INTERRUPTED, STOP_MAX_NEW_TOKENS, STOP_RANK_FAILED, Trace, load_schema
from llmtrace.tracer.trace.tp_summary import tensor_parallel_summary

runner = CliRunner()
PROMPT = "The capital of France is"
# The process group's timeout: how long a collective waits for a missing rank. A run that ends well waits for
# none, so its timeout is generous (a loaded machine may pause a rank for seconds: no test may depend on the pace);
# a rank made to hang is found after FAULT_TIMEOUT_S, which bounds that test's time.
TIMEOUT_S = 120.0
FAULT_TIMEOUT_S = 3.0


def _settings(model: Path, tokens: int = 5) -> RunSettings:
    return RunSettings(model=str(model), prompt=PROMPT, max_new_tokens=tokens, dtype="fp32", temperatures=())


@pytest.fixture(scope="module")
def tp2_trace(tiny_llama_dir: Path) -> Trace:
    result = run_tensor_parallel(_settings(tiny_llama_dir), FP32, 2, threads=1, timeout_s=TIMEOUT_S)
    assert result.status == "ok"
    return result.trace


def test_tp2_generates_the_one_device_tokens_and_logits(tiny_llama_dir: Path, tp2_trace: Trace) -> None:
    one = generate(load_model(str(tiny_llama_dir), dtype=FP32), _settings(tiny_llama_dir))
    assert tp2_trace.generated_ids == one.generated_ids  # greedy
    assert tp2_trace.stop_reason == STOP_MAX_NEW_TOKENS
    for mine, theirs in zip(tp2_trace.steps, one.steps, strict=True):
        for a, b in zip(mine.candidates, theirs.candidates, strict=True):  # the top logits, fp32, after the gather
            assert a.token_id == b.token_id
            assert abs(a.logit - b.logit) <= 1e-4


def test_every_rank_and_collective_is_in_the_trace(tp2_trace: Trace, tiny_llama_dir: Path) -> None:
    setup = tp2_trace.tensor_parallel
    backend = "shm" if platform.machine().lower() in ("x86_64", "amd64") else "gloo"  # shared memory on x86-64
    assert (setup.tp, setup.backend, setup.launcher, setup.exit_codes) == (2, backend, "spawn", (0, 0))
    assert setup.link is not None and setup.link.bus_bandwidth > 0
    assert [r.rank for r in tp2_trace.rank_stages] == [1]
    other = tp2_trace.rank_stages[0]
    assert len(other.stages) == len(tp2_trace.stages) and len(other.steps) == len(tp2_trace.steps)
    n_layers = tp2_trace.config.n_layers
    for rank in (0, 1):
        mine = [c for c in tp2_trace.collectives if c.rank == rank]
        assert len(mine) == len(tp2_trace.steps) * (2 * n_layers + 2)
        decode = [c for c in mine if c.phase == "decode" and c.kind == "all_reduce"]
        assert {c.payload_bytes for c in decode} == {tp2_trace.config.dim * 4}
        assert all(c.bytes_sent == c.payload_bytes for c in decode)  # ring, N = 2: 2(N-1)/N = 1
        assert all(c.ranks == (0, 1) for c in mine)
    # every collective lies inside its rank's forward of its step
    steps = {(s.phase, s.step): (s.start_ns, s.start_ns + s.forward_ns) for s in tp2_trace.steps}
    for c in tp2_trace.collectives:
        if c.rank == 0:
            lo, hi = steps[(c.phase, c.step)]
            assert lo <= c.start_ns and c.end_ns <= hi


def test_the_trace_json_validates_and_reads_back(tp2_trace: Trace) -> None:
    data = json.loads(tp2_trace.to_json())
    jsonschema.validate(data, load_schema())
    assert Trace.from_json(tp2_trace.to_json()) == tp2_trace
    # every stage record names its rank, the base rank's own too (issue 28: they read null, so per-rank shares
    # came out as {null: 0.5, 1: 0.5})
    work = data["stage_work"]  # the stage rows index it: [work, step, layer, start_ns, duration_ns]
    ranks = [work[row[0]]["rank"] for row in data["stages"]] + [
        work[row[0]]["rank"] for r in data["rank_stages"] for row in r["stages"]]
    assert sorted(set(ranks)) == [0, 1] and ranks.count(0) == ranks.count(1) == len(data["stages"])
    assert all(work[row[0]]["rank"] == r["rank"] for r in data["rank_stages"] for row in r["stages"])


def test_chrome_trace_has_a_track_per_rank_with_its_all_reduces(tp2_trace: Trace) -> None:
    events = chrome_trace(tp2_trace)["traceEvents"]
    names = {e["tid"]: e["args"]["name"] for e in events if e["name"] == "thread_name"}
    assert sorted(names) == [1, 2] and names[2].startswith("rank 1")
    for tid in (1, 2):
        reduces = [e for e in events if e["tid"] == tid and e.get("cat") == "collective"]
        assert any(e["name"] == "all_reduce after layers.0.attention.wo" for e in reduces)
        assert any(e["name"] == "all_gather after output" for e in reduces)
        assert any(e["tid"] == tid and e.get("cat") == "linear" for e in events)


def test_summary_sets_measured_communication_beside_the_prediction(tp2_trace: Trace) -> None:
    summary = tensor_parallel_summary(tp2_trace)
    decode = next(p for p in summary.phases if p.phase == "decode")
    assert decode.collectives_per_step == 2 * tp2_trace.config.n_layers + 2
    assert decode.layer_allreduce_payload_bytes == tp2_trace.config.dim * 4
    assert decode.measured_layer_allreduce_ns > 0 and decode.measured_comm_ns_per_token > 0
    # roofline --tp's formula with this run's measured bandwidth: ring bytes / bus bandwidth per all-reduce
    expected = decode.layer_allreduce_payload_bytes / summary.bus_bandwidth * 1e9
    assert decode.predicted_layer_allreduce_ns == pytest.approx(expected)
    assert decode.predicted_layer_ns_per_step == pytest.approx(expected * 2 * tp2_trace.config.n_layers)
    assert [r.rank for r in summary.ranks] == [0, 1]
    assert summary.ranks[0].decode_flops_per_step == summary.ranks[1].decode_flops_per_step > 0
    # each rank's own peak resident set (rank 0's is the trace's; the other's travels in its rank_stages)
    assert summary.ranks[0].peak_rss_bytes == tp2_trace.peak_rss_bytes > 0
    assert summary.ranks[1].peak_rss_bytes == tp2_trace.rank_stages[0].peak_rss_bytes > 0


@pytest.mark.parametrize("fault, how", [("die:1:2", "rank 1 died (exit code 17) in decode step 2"),
                                        ("hang:1:2", "rank 1 hung in decode step 2")])
def test_a_rank_that_dies_or_hangs_ends_the_run_with_a_partial_trace(tiny_llama_dir: Path, fault: str,
                                                                     how: str) -> None:
    result = run_tensor_parallel(_settings(tiny_llama_dir, tokens=8), FP32, 2, threads=1,
                                 timeout_s=FAULT_TIMEOUT_S, fault=fault)
    assert result.status.startswith(how) and "\n" not in result.status
    trace = result.trace
    assert trace.stop_reason == STOP_RANK_FAILED
    assert trace.tensor_parallel.status == result.status
    assert [s.step for s in trace.steps] == [0, 1]  # the prefill and decode step 1, which both ranks completed
    assert trace.tensor_parallel.exit_codes[1] == (17 if fault.startswith("die") else None)  # None: killed
    jsonschema.validate(json.loads(trace.to_json()), load_schema())


def test_ctrl_c_stops_every_rank_after_the_same_step(tiny_llama_dir: Path) -> None:
    tokens = 200  # the launcher looks every 0.1 s and may see a later step first: room to stop well before the end

    seen: list[int] = []

    def progress(what: str) -> None:  # the launcher's watch loop calls this: a Ctrl-C arriving there
        if what.startswith("ranks in decode step "):  # the first it sees from step 1 on (it may skip some)
            seen.append(int(what.removeprefix("ranks in decode step ")))
            raise KeyboardInterrupt

    result = run_tensor_parallel(_settings(tiny_llama_dir, tokens=tokens), FP32, 2, threads=1, timeout_s=TIMEOUT_S,
                                 progress=progress)
    trace = result.trace
    assert result.status == "ok" and trace.stop_reason == STOP_INTERRUPTED
    # the step the ranks were in when the Ctrl-C came is finished (the gate stops them before the next one they
    # begin), and they stop within a few steps of it, far from the token limit
    assert len(seen) == 1 and seen[0] <= len(trace.decode_steps) <= seen[0] + 5 < tokens - 1
    assert trace.tensor_parallel.exit_codes == (0, 0)
    assert len(trace.rank_stages[0].steps) == len(trace.steps)  # both ranks stopped after the same step


def test_cli_tp2_writes_the_trace_and_shows_the_section(tiny_llama_dir: Path, tmp_path: Path) -> None:
    out, chrome = tmp_path / "t.json", tmp_path / "c.json"
    result = runner.invoke(app, ["run", PROMPT, "--model", str(tiny_llama_dir), "--tp", "2", "--max-new-tokens", "3",
                                 "--dtype", "fp32", "--json", str(out), "--chrome-trace", str(chrome),
                                 "--tp-timeout", "120"])
    assert result.exit_code == 0, result.output
    assert "Tensor parallel · 2 ranks" in result.output and "roofline --tp predicts" in result.output
    trace = Trace.from_json(out.read_text(encoding="utf-8"))
    assert trace.tensor_parallel.tp == 2 and len(trace.generated_ids) == 3
