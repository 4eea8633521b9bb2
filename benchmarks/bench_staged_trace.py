"""What `--staged` traced decode costs, step by step (issue 12: "within 1.5x of the untraced default").

On the bundled default model (default weights, greedy from "The capital of France is"), in one process, rounds
interleaved, one-token steps `decode_one` timed from the tracer's begin_step to its end_step:
- fused: the default path, untraced (what `run --no-trace` runs);
- staged: stage by stage (the modules backend), untraced: the staged model's own cost;
- traced: stage by stage under Tracer(mechanism="wrap") (what `run --staged` runs);
- baseline (with --baseline-hooks FILE): the same under the Tracer of another revision's tracer/trace/hooks.py
  (`git show REV:tracer/trace/hooks.py > FILE`), for before/after in one run.
Per variant: median, mean and upper quartile ms per step over every step of every round (the mean shows the
garbage collector's pauses, which land on a few steps), and the records() build per step (after the run).

    /work/tools/quiet .venv/bin/python -m benchmarks.bench_staged_trace --rounds 6 [--baseline-hooks FILE]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import time
from typing import Any

import torch

from llmtrace.tracer.load.loader import load_model
from llmtrace.tracer.trace.hooks import Tracer

PROMPT_IDS = [1, 504, 3575, 282, 4649, 314]  # "The capital of France is" (SmolLM2's tokenizer, with BOS)
STEPS = 30


def _baseline_tracer(path: str) -> type:
    spec = importlib.util.spec_from_file_location("baseline_hooks", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.Tracer


def one_round(model: Any, variant: str, tracer_class: type | None) -> tuple[list[int], float]:
    """STEPS decode steps after a prefill: each step's ns, and the records() build in ms per step."""
    from llmtrace.tracer.run.backends import backend_for
    from llmtrace.tracer.run.select import Request

    ids = torch.tensor([PROMPT_IDS])
    model.setup_cache(1, len(PROMPT_IDS) + STEPS + 1)
    tracer = tracer_class(model, mechanism="wrap") if tracer_class is not None else None
    run = backend_for(model, Request(backend=None if variant == "fused" else "modules"))
    times = []
    build_ms = 0.0
    try:
        with torch.no_grad():
            if tracer is not None:
                tracer.__enter__()
                tracer.begin_step("prefill", 0)
            token = run.prefill(ids).argmax(-1, keepdim=True)  # (1, 1)
            if tracer is not None:
                tracer.end_step()
            for step in range(1, STEPS + 1):
                start = time.perf_counter_ns()
                if tracer is not None:
                    tracer.begin_step("decode", step)
                logits = run.decode(token)
                if tracer is not None:
                    tracer.end_step()
                times.append(time.perf_counter_ns() - start)
                token = logits.argmax(-1, keepdim=True)
            if tracer is not None:
                start = time.perf_counter_ns()
                tracer.records()
                build_ms = (time.perf_counter_ns() - start) / 1e6 / (STEPS + 1)
    finally:
        if tracer is not None:
            tracer.__exit__(None, None, None)
    return times, build_ms


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--baseline-hooks", help="another revision's tracer/trace/hooks.py, timed as 'baseline'")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model = load_model(None).model
    variants: dict[str, type | None] = {"fused": None, "staged": None, "traced": Tracer}
    if args.baseline_hooks:
        variants["baseline"] = _baseline_tracer(args.baseline_hooks)
    for name, tracer_class in variants.items():  # warm-up: one-off kernel set-up, caches
        one_round(model, name, tracer_class)
    steps: dict[str, list[int]] = {name: [] for name in variants}
    builds: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(args.rounds):
        for name, tracer_class in variants.items():
            times, build_ms = one_round(model, name, tracer_class)
            steps[name] += times
            builds[name].append(build_ms)
    result = {}
    for name in variants:
        ms = [t / 1e6 for t in steps[name]]
        result[name] = {"median_ms": statistics.median(ms), "mean_ms": statistics.fmean(ms),
                        "p75_ms": statistics.quantiles(ms, n=4)[2],
                        "records_build_ms_per_step": statistics.median(builds[name])}
    for name in ("traced", "baseline"):
        if name in result:
            result[f"{name} / fused (median)"] = result[name]["median_ms"] / result["fused"]["median_ms"]
            result[f"{name} / fused (mean)"] = result[name]["mean_ms"] / result["fused"]["mean_ms"]
            result[f"{name} / staged (mean)"] = result[name]["mean_ms"] / result["staged"]["mean_ms"]
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
