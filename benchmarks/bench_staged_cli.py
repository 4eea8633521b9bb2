"""`run --staged` decode tokens/s against the untraced default, as a user runs them (issue 12, item 4: "`--staged`
traced decode within 1.5x of the untraced default").

Each variant is a fresh `python -m llmtrace run PROMPT --max-new-tokens N --summary-json` process (the summary JSON
is its last stdout line), the variants alternated round by round so drift in the machine's load reaches all:
- staged: `--staged` (the native decode step's stages apart, timed in C, where the model has one);
- notrace: `--no-trace` (the default path untraced: the target's denominator);
- traced: no flag (the default path traced from inside);
- modules: `--staged` with the native staged step switched off in that process (tracer/run/select.py's
  _staged_native_reason patched to refuse), i.e. every decode step through the wrapped stage modules: what `--staged` ran before.

Run it alone on the machine: `/work/tools/quiet .venv/bin/python -m benchmarks.bench_staged_cli --rounds 3`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys

VARIANTS = {"staged": ["--staged"], "notrace": ["--no-trace"], "traced": [], "modules": ["--staged"]}
# The modules variant: the same CLI in a process where no step may take the native staged path.
_MODULES = ("import runpy, sys\n"
            "from llmtrace.tracer.run import select\n"
            "select._staged_native_reason = lambda *args: 'switched off for the benchmark'\n"
            "sys.argv = ['llmtrace'] + sys.argv[1:]\n"
            "runpy.run_module('llmtrace', run_name='__main__')\n")


def run_once(variant: str, prompt: str, tokens: int) -> dict:
    args = ["run", prompt, "--max-new-tokens", str(tokens), "--summary-json", *VARIANTS[variant]]
    command = [sys.executable, "-c", _MODULES, *args] if variant == "modules" else [sys.executable, "-m", "llmtrace",
                                                                                      *args]
    done = subprocess.run(command, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--prompt", default="capital")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--variants", default=",".join(VARIANTS))
    options = parser.parse_args()
    variants = options.variants.split(",")
    rates: dict[str, list[float]] = {v: [] for v in variants}
    for round_ in range(1, options.rounds + 1):
        for variant in variants:
            summary = run_once(variant, options.prompt, options.max_new_tokens)
            rates[variant].append(summary["decode_tokens_per_second"])
            print(f"round {round_} {variant:8s} {summary['decode_tokens_per_second']:7.2f} tok/s "
                  f"({summary['generated_tokens']} tokens, {summary['weight_format']})", flush=True)
    medians = {v: statistics.median(r) for v, r in rates.items()}
    print("\nvariant   decode tok/s median   rounds                    time / notrace")
    for variant in variants:
        ratio = medians["notrace"] / medians[variant] if "notrace" in medians else float("nan")
        rounds = " ".join(f"{r:.1f}" for r in rates[variant])
        print(f"{variant:8s}  {medians[variant]:19.2f}   {rounds:24s}  {ratio:.2f}x")


if __name__ == "__main__":
    main()
