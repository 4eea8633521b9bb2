"""Decode time per step over batch sizes on the bundled model, measured beside the roofline's prediction for this
machine (llmtrace.tracer.run.batch_sweep), and the measured and predicted crossover.

This machine's ceilings are measured in the same process first (fp32 GEMM FLOP/s and copy bandwidth, the fastest
of `--ceiling-repeats` runs each, as `llmtrace hardware --measure` does), so prediction and measurement see the
same machine state. The weights are copied out of the memory-mapped cache first (see bench_roofline.py: idle
page-cache pages are evicted on this VM). The prediction uses the eager kernel model: what llmtrace's model runs.

    flock /tmp/llmtrace-bench.lock .venv/bin/python -m benchmarks.bench_batch_sweep --batches 1,2,4,8,16,32,64
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, replace

PROMPT = "The capital of France is"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", default="1,2,4,8,16,32,64")
    parser.add_argument("--steps", type=int, default=16, help="decode steps timed per batch per repeat")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--ceiling-repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--gemm-max-n", type=int, default=1024, help="largest GEMM of the ceilings measurement")
    parser.add_argument("--json", action="store_true", help="print the raw results as JSON")
    args = parser.parse_args()

    import torch

    from llmtrace.tracer.core.dtypes import FP32
    from llmtrace.tracer.hardware.measure import measure_machine, profile_from_measurement
    from llmtrace.tracer.load.loader import load_model
    from llmtrace.tracer.run.batch_sweep import parse_batches, sweep

    torch.set_num_threads(args.threads)
    batches = parse_batches(args.batches)
    loaded = load_model(None, dtype=FP32)
    with torch.no_grad():
        for param in loaded.model.parameters():  # unique parameters: a tied LM head stays tied
            param.data = param.data.clone()
    ids = loaded.tokenizer.encode(PROMPT)
    # GEMMs up to 1024: enough to reach the peak on a few CPU cores, and minutes shorter than 4096 on a busy machine
    measurement = measure_machine(dtypes=(FP32,), repeats=args.ceiling_repeats, gemm_max_n=args.gemm_max_n)
    profile = replace(profile_from_measurement(measurement), source="bench_batch_sweep, measured in the same run")

    def progress(done: int, total: int) -> None:
        print(f"\r{done}/{total} measurements", end="", file=sys.stderr, flush=True)

    result = sweep(loaded, profile, ids, batches, steps=args.steps, repeats=args.repeats, progress=progress)
    print(file=sys.stderr)
    if args.json:
        print(json.dumps(asdict(result), indent=2))
        return
    print(f"{result.model}, prompt {result.prompt_len} tokens, {result.decode_steps} decode steps x "
          f"{result.repeats} repeats per batch, {result.threads} threads, {result.kernels} kernels")
    print(f"ceilings: {result.compute_dtype} {result.peak_flops / 1e9:,.1f} GFLOP/s, "
          f"{result.memory_bandwidth / 1e9:,.2f} GB/s, ridge {result.ridge_point:.2f} FLOPs/byte")
    print("| batch | measured ms/step (min-max) | predicted ms/step | bound | measured / predicted | "
          "measured tok/s | predicted tok/s |")
    print("|---:|---:|---:|---|---:|---:|---:|")
    for r in result.rows:
        print(f"| {r.batch} | {r.measured_step_s * 1e3:.1f} ({r.measured_min_s * 1e3:.1f}-"
              f"{r.measured_max_s * 1e3:.1f}) | {r.predicted_step_s * 1e3:.1f} | {r.predicted_bound} | "
              f"{r.measured_over_predicted:.2f} | {r.measured_tokens_per_s:,.0f} | {r.predicted_tokens_per_s:,.0f} |")

    def fmt(x: float | None) -> str:
        return "none in the sweep" if x is None else f"{x:.1f}"

    print(f"crossover: predicted {result.predicted_crossover} (exact; two-roof knee of the predicted times "
          f"{fmt(result.predicted_knee)}), measured {fmt(result.measured_crossover)}")


if __name__ == "__main__":
    main()
