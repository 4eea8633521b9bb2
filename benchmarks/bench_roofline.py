"""The roofline prediction for this machine against a measured generation on the bundled default model, and the
wall time of `llmtrace roofline` / `llmtrace hardware` against `python -c "import typer, rich"`.

Part 1 (prediction vs measurement), in one process, rounds interleaved so that machine noise hits both alike:
each round measures this machine's ceilings (fp32 GEMM FLOP/s, copy bandwidth: llmtrace.tracer.hardware.measure) and then
runs one greedy generation of the default model (SmolLM2-135M GGUF, dequantized to fp32) without hooks: one
prefill of the prompt, then N - 1 decode steps, each timed alone (perf_counter around model.prefill/decode_one).
Medians over rounds feed llmtrace.tracer.roofline.compare.compare_with_measured, the same call `llmtrace run` makes.
The weights are copied out of the memory-mapped cache first (see part_prediction for why).

Part 2 (CLI speed): fresh subprocesses, interleaved, medians.

    flock /tmp/llmtrace-bench.lock .venv/bin/python -m benchmarks.bench_roofline --rounds 5 --new-tokens 64
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PROMPT = "The capital of France is"


def measure_generation(loaded, ids: list[int], new_tokens: int) -> tuple[float, list[float]]:
    """(prefill seconds, [decode step seconds]) of one greedy generation, no hooks."""
    import torch

    from llmtrace.tracer.run.backends import backend_for

    model = loaded.model
    model.reset_cache()
    run = backend_for(model)
    tokens = torch.tensor([ids])
    start = time.perf_counter()
    logits = run.prefill(tokens)
    ttft = time.perf_counter() - start
    steps = []
    for _ in range(new_tokens - 1):
        next_id = logits.argmax(dim=-1, keepdim=True)  # (1, 1)
        start = time.perf_counter()
        logits = run.decode(next_id)
        steps.append(time.perf_counter() - start)
    return ttft, steps


def part_prediction(rounds: int, new_tokens: int) -> dict:
    import torch

    from llmtrace.tracer.core.dtypes import FP32
    from llmtrace.tracer.hardware.measure import measure_copy, measure_gemm, measure_machine, profile_from_measurement
    from llmtrace.tracer.load.loader import load_model
    from llmtrace.tracer.roofline.compare import compare_with_measured

    loaded = load_model(None, dtype=FP32)
    # The converted-weights cache is memory-mapped: on this VM the kernel evicts page-cache pages idle for a few
    # seconds (DAMON reclaim), so the first steps after each ceilings measurement re-read the weights from disk at
    # ~1 s per step. The roofline bounds a model whose weights are in memory: copy them into anonymous memory.
    with torch.no_grad():
        for param in loaded.model.parameters():  # unique parameters: a tied LM head stays tied
            param.data = param.data.clone()
    ids = loaded.tokenizer.encode(PROMPT)
    loaded.model.setup_cache(1, len(ids) + new_tokens)
    measure_generation(loaded, ids, 4)  # warm-up: first-touch of the memory-mapped weights, allocator

    bandwidths, flops, ttfts, decode_tps = [], [], [], []
    for _ in range(rounds):
        copy = measure_copy("cpu", 256 * 2**20, repeats=3)
        gemm = measure_gemm(FP32, "cpu", repeats=3)
        ttft, steps = measure_generation(loaded, ids, new_tokens)
        bandwidths.append(copy.bytes_per_s)
        flops.append(gemm.flops_per_s)
        ttfts.append(ttft)
        decode_tps.append(len(steps) / sum(steps))

    # A profile with the median ceilings of the rounds (one tiny measure_machine call supplies the device facts).
    base = measure_machine(dtypes=(FP32,), repeats=1, gemm_target_seconds=0.0, gemm_max_n=128, copy_bytes=2**20)
    profile = profile_from_measurement(base)
    from dataclasses import replace

    profile = replace(profile, fp32=statistics.median(flops), memory_bandwidth=statistics.median(bandwidths),
                      source=f"bench_roofline: medians of {rounds} interleaved rounds")
    cmp = compare_with_measured(
        loaded.config, profile, prompt_len=len(ids), new_tokens=new_tokens,
        measured_ttft_s=statistics.median(ttfts), measured_decode_tokens_per_s=statistics.median(decode_tps),
        dtype=FP32,
    )
    return {
        "model": loaded.source, "weight_format": loaded.weight_format, "threads": torch.get_num_threads(),
        "prompt_tokens": len(ids), "new_tokens": new_tokens, "rounds": rounds,
        "ceilings": {"fp32_flops_per_s": [round(f) for f in flops], "copy_bytes_per_s": [round(b) for b in bandwidths]},
        "measured": {"ttft_s": ttfts, "decode_tokens_per_s": decode_tps},
        "comparison": asdict(cmp),
    }


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-c", "import sys; from llmtrace.cli.app import main; main(sys.argv[1:])", *args]


def part_cli(runs: int) -> dict:
    commands = {
        "import typer, rich": [sys.executable, "-c", "import typer, rich"],
        "llmtrace roofline": _cli("roofline"),
        "llmtrace roofline --json": _cli("roofline", "--json"),
        "llmtrace hardware": _cli("hardware"),
    }
    env = dict(os.environ, COLUMNS="120")
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    times: dict[str, list[float]] = {name: [] for name in commands}
    for name, cmd in commands.items():  # one untimed run each: bytecode compiled, files in the page cache
        subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, check=True)
    for _ in range(runs):
        for name, cmd in commands.items():
            start = time.perf_counter()
            subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, check=True)
            times[name].append(time.perf_counter() - start)
    base = statistics.median(times["import typer, rich"])
    return {name: {"median_s": statistics.median(t), "ratio_to_typer_rich": statistics.median(t) / base}
            for name, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--cli-runs", type=int, default=15)
    parser.add_argument("--json", action="store_true", help="print the raw results as JSON")
    args = parser.parse_args()

    pred = part_prediction(args.rounds, args.new_tokens)
    cli = part_cli(args.cli_runs)
    if args.json:
        print(json.dumps({"prediction": pred, "cli": cli}, indent=2))
        return
    c = pred["comparison"]
    print(f"model: {pred['model']} ({pred['weight_format']}), {pred['threads']} threads, "
          f"prompt {pred['prompt_tokens']} tokens + {pred['new_tokens']} new, {pred['rounds']} rounds")
    print(f"ceilings (medians): fp32 {c['peak_flops'] / 1e9:,.1f} GFLOP/s, copy {c['memory_bandwidth'] / 1e9:,.2f} GB/s,"
          f" ridge {c['ridge_point']:.1f} FLOPs/byte")
    print(f"TTFT: bound {c['predicted_ttft_s'] * 1e3:.2f} ms ({c['prefill_bound']}-bound), "
          f"measured {c['measured_ttft_s'] * 1e3:.2f} ms -> {c['ttft_percent_of_bound']:.0f}% of the bound")
    print(f"decode: bound {c['predicted_decode_tokens_per_s']:.1f} tokens/s ({c['decode_bound']}-bound), "
          f"measured {c['measured_decode_tokens_per_s']:.1f} tokens/s -> {c['decode_percent_of_bound']:.0f}% "
          f"of the bound")
    for name, r in cli.items():
        print(f"{name:28s} {r['median_s'] * 1e3:7.1f} ms   x{r['ratio_to_typer_rich']:.2f}")


if __name__ == "__main__":
    main()
