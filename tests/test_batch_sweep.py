"""The batch sweep (llmtrace.tracer.run.batch_sweep): what it measures, what it predicts, how it reads a crossover.

Timings here are never asserted (speed lives in BENCHMARKS.md); the structure, the prediction (the roofline's own
figure for the same contexts) and the knee arithmetic are, on a tiny random model.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from llmtrace.tracer.core.dtypes import FP32
from llmtrace.tracer.core.errors import BadArgumentError
from llmtrace.tracer.hardware.profiles import HardwareProfile
from llmtrace.tracer.load.loader import load_model
from llmtrace.tracer.roofline.analysis import roofline
from llmtrace.tracer.run.batch_sweep import knee, measure_decode_steps, parse_batches, sweep

# A CPU-like measured profile: 100 GFLOP/s fp32, 20 GB/s -> ridge 5 FLOPs/byte.
MACHINE = HardwareProfile("this-machine", "test CPU", 20e9, 16 * 2**30, 100e9, None, None, None, None, None,
                          "none", 0.0, "test", measured=True)


def test_parse_batches() -> None:
    assert parse_batches("1,2,4, 8") == (1, 2, 4, 8)
    for bad in ("", "1,x", "4,2", "0,1", "1,1"):
        with pytest.raises(BadArgumentError, match="--batches"):
            parse_batches(bad)


def test_knee_is_where_the_flat_and_the_sloped_roof_meet() -> None:
    # flat at 10 ms, then 1 ms per sequence from batch 16: 16 -> 16 ms, 32 -> 32 ms; the line t = B meets t = 10
    assert knee([1, 2, 4, 8, 16, 32], [0.010, 0.010, 0.010, 0.011, 0.016, 0.032]) == pytest.approx(10.0)
    assert knee([1, 2, 4], [0.010, 0.010, 0.010]) is None  # still flat: no crossover in the sweep
    assert knee([1, 2], [0.01, 0.02]) is None  # two points cannot show two roofs


def test_batched_greedy_decode_keeps_every_sequence_on_its_batch_1_tokens(tiny_llama_dir: Path) -> None:
    """The prompt repeated B times: each row's greedy tokens equal the batch-1 run's (fp32)."""
    loaded = load_model(str(tiny_llama_dir))
    model = loaded.model
    ids = loaded.tokenizer.encode("The sky is blue")

    def greedy(batch: int) -> torch.Tensor:
        model.setup_cache(batch, len(ids) + 6)
        with torch.no_grad():
            logits = model.prefill(torch.tensor([ids] * batch))
            out = []
            for _ in range(6):
                nxt = logits.argmax(-1, keepdim=True)  # (B, 1)
                out.append(nxt)
                logits = model.decode_one(nxt)
        return torch.cat(out, dim=1)  # (B, 6)

    one = greedy(1)
    four = greedy(4)
    assert four.shape == (4, 6) and all(torch.equal(row, one[0]) for row in four)
    assert len(measure_decode_steps(model, ids, 3, 4)) == 4


def test_sweep_measures_every_batch_and_predicts_with_the_roofline(tiny_llama_dir: Path) -> None:
    loaded = load_model(str(tiny_llama_dir))
    ids = loaded.tokenizer.encode("Once upon a time")
    calls = []
    result = sweep(loaded, MACHINE, ids, (1, 2, 4), steps=3, repeats=2, progress=lambda d, t: calls.append((d, t)))
    assert calls[-1] == (6, 6) and len(calls) == 6
    assert result.kernels == "eager"  # what llmtrace's model runs
    assert [r.batch for r in result.rows] == [1, 2, 4]
    for row in result.rows:
        report = roofline(loaded.config, MACHINE, prompt_len=len(ids), new_tokens=4, batch=row.batch, dtype=FP32,
                          check_fit=False, kernels="eager")
        assert row.predicted_step_s == report.generation.time_per_output_token_seconds
        assert row.measured_min_s <= row.measured_step_s <= row.measured_max_s
        assert row.measured_over_predicted == pytest.approx(row.measured_step_s / row.predicted_step_s)
        assert row.measured_tokens_per_s == pytest.approx(row.batch / row.measured_step_s)
    assert result.predicted_crossover == report.crossover.crossover_batch
    with pytest.raises(BadArgumentError, match="at least 2 decode steps"):
        sweep(loaded, MACHINE, ids, (1, 2), steps=1)
