"""Tensor parallelism on the bundled SmolLM2-135M (3 KV heads, so --tp 3): the measured all-reduce time per layer
against `roofline --tp`'s prediction (bandwidth only) and the latency-aware one, and --tp 3 against one device.

One process launches everything, interleaved round by round so machine noise hits both alike: per round, one
`run_tensor_parallel` of the greedy generation over 3 spawned gloo ranks (1 torch thread each: 3 ranks on this
machine's cores oversubscribe 2 of them), then the same generation on one device (1 thread, stage by stage, as the
ranks run). Figures are medians over rounds of the base rank's records (tracer/trace/tp_summary.py).

    /work/tools/quiet .venv/bin/python -m benchmarks.bench_tp --rounds 3 --new-tokens 8
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time


def _cpu() -> str:
    with open("/proc/cpuinfo", encoding="utf-8") as f:
        return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), platform.machine())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--tp", type=int, default=3)
    args = parser.parse_args()

    import torch

    from llmtrace.tracer.core.dtypes import FP32
    from llmtrace.tracer.load.loader import load_model
    from llmtrace.tracer.run.generate import generate
    from llmtrace.tracer.run.tp_launch import run_tensor_parallel
    from llmtrace.tracer.trace.records import RunSettings
    from llmtrace.tracer.trace.tp_summary import tensor_parallel_summary

    torch.set_num_threads(1)
    settings = RunSettings(model="", prompt="The capital of France is", max_new_tokens=args.new_tokens,
                           dtype="fp32", temperatures=(), staged=True)
    one_device = load_model(None, dtype=FP32)
    rows: dict[str, list[float]] = {}

    def keep(name: str, value: float) -> None:
        rows.setdefault(name, []).append(value)

    start = time.perf_counter()
    for _ in range(args.rounds):
        result = run_tensor_parallel(settings, FP32, args.tp, threads=1, timeout_s=60)
        assert result.status == "ok", result.status
        trace = result.trace
        summary = tensor_parallel_summary(trace)
        keep("bus bandwidth (MB/s)", summary.bus_bandwidth / 1e6)
        keep("one decode-sized all-reduce, alone (us)", summary.small_allreduce_seconds * 1e6)
        for p in summary.phases:
            layers = trace.config.n_layers
            keep(f"{p.phase}: all-reduce payload (B)", p.layer_allreduce_payload_bytes)
            keep(f"{p.phase}: per layer measured (us)", p.measured_layer_ns_per_step / layers / 1e3)
            keep(f"{p.phase}: per layer roofline --tp (us)", p.predicted_layer_ns_per_step / layers / 1e3)
            keep(f"{p.phase}: per layer latency-aware (us)", 2 * p.latency_aware_layer_allreduce_ns / 1e3)
            keep(f"{p.phase}: collectives share of forward (%)", 100 * p.comm_share)
        decode = trace.decode_steps
        keep("tp: decode ms/token", statistics.median(s.forward_ns for s in decode) / 1e6)
        keep("tp: prefill ms", trace.prefill_step.forward_ns / 1e6)
        alone = generate(one_device, settings)
        keep("1 device: decode ms/token", statistics.median(s.forward_ns for s in alone.decode_steps) / 1e6)
        keep("1 device: prefill ms", alone.prefill_step.forward_ns / 1e6)
        assert alone.generated_ids == trace.generated_ids, "tp and one device disagree"
    elapsed = time.perf_counter() - start
    print(f"CPU: {_cpu()} ({os.cpu_count()} CPUs) · torch {torch.__version__} · {args.tp} gloo ranks x 1 thread · "
          f"bundled SmolLM2-135M fp32 · {args.new_tokens} new tokens · {args.rounds} rounds in {elapsed:.0f} s · "
          f"load average {os.getloadavg()[0]:.2f}")
    print("| figure | median | min | max |\n|---|---:|---:|---:|")
    def shown(v: float) -> str:
        return f"{v:,.0f}" if abs(v) >= 100 else f"{v:.3g}"

    for name, values in rows.items():
        print(f"| {name} | {shown(statistics.median(values))} | {shown(min(values))} | {shown(max(values))} |")


if __name__ == "__main__":
    main()
