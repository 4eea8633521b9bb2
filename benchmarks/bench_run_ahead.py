"""Greedy decode steps run ahead in C against a step a call, side by side (tracer/run/generate.py's run-ahead).

The default `run` on the bundled model (`load_model(None)`: its measured kernel plan), bench_vs_peers' 128-token
prompt and 32 greedy tokens, four ways in every round, in turn: run ahead and a step a call
(`Generation(run_ahead=False)`), each untraced and traced. Decode tokens/s as bench_vs_peers times them: decode steps
over the wall from the PrefillDone event to the last TokenStep, so the Python between steps counts. A shared VM's
slow spells move whole rounds, so besides the medians the ratios are taken round by round (each pair ran seconds
apart) and their median given.

    /work/tools/quiet .venv/bin/python -m benchmarks.bench_run_ahead --rounds 10
    /work/tools/quiet .venv/bin/python -m benchmarks.bench_run_ahead --rounds 10 --temperature 0.7
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

from benchmarks.bench_vs_peers import PROMPT_TOKENS, prompt_of, time_llmtrace

WAYS = {  # name: (traced, run_ahead)
    "run ahead --no-trace": (False, True),
    "run ahead traced": (True, True),
    "a step a call --no-trace": (False, False),
    "a step a call traced": (True, False),
}
RATIOS = {  # name: (numerator way, denominator way): > 1 means the numerator decodes faster
    "run ahead / a step a call, --no-trace": ("run ahead --no-trace", "a step a call --no-trace"),
    "run ahead / a step a call, traced": ("run ahead traced", "a step a call traced"),
    "tracing overhead, run ahead (untraced / traced)": ("run ahead --no-trace", "run ahead traced"),
    "tracing overhead, a step a call (untraced / traced)": ("a step a call --no-trace", "a step a call traced"),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--decode-tokens", type=int, default=32)
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="draw at this temperature (seed 1) instead of greedy: both ways run the same draws")
    parser.add_argument("--json", action="store_true", help="print the results as JSON too")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from llmtrace.tracer.load.loader import load_model

    loaded = load_model(None)
    text, _ = prompt_of(loaded.tokenizer, PROMPT_TOKENS)
    rates: dict[str, list[float]] = {name: [] for name in WAYS}
    for _ in range(args.rounds + 1):  # the first round warms up
        for name, (traced, run_ahead) in WAYS.items():
            timing, _ = time_llmtrace(loaded, text, traced, False, args.decode_tokens, run_ahead, args.temperature)
            rates[name].append(timing[1])
    rates = {name: values[1:] for name, values in rates.items()}
    how = f"drawn at T={args.temperature:g}, seed 1" if args.temperature > 0 else "greedy"
    print(f"model: {loaded.source} ({loaded.weight_format}); {PROMPT_TOKENS}-token prompt, {args.decode_tokens} tokens "
          f"{how}, {args.threads} threads, {args.rounds} rounds")
    print("| way | decode tok/s, median | rounds |\n|---|---:|---|")
    for name, values in rates.items():
        print(f"| {name} | {statistics.median(values):.1f} | {' '.join(f'{v:.0f}' for v in values)} |")
    print("| ratio | median of rounds | rounds |\n|---|---:|---|")
    ratios = {}
    for name, (top, bottom) in RATIOS.items():
        paired = [a / b for a, b in zip(rates[top], rates[bottom])]
        ratios[name] = statistics.median(paired)
        print(f"| {name} | {ratios[name]:.2f} | {' '.join(f'{r:.2f}' for r in paired)} |")
    if args.json:
        print(json.dumps({"rates": rates, "ratios": ratios}, indent=1))


if __name__ == "__main__":
    main()
