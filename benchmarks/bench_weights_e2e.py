"""End to end `llmtrace run` under several `--weights`, alternated: decode tok/s (the sample prompt "capital",
64 greedy tokens) and 128-token prefill tok/s (bench_vs_peers' 128-token prompt, 1 new token), each a fresh CLI
process as a user runs it (`--no-trace --summary-json`, the summary's figures), rounds interleaved so a slow spell
of a shared machine hits every setting.

    /work/tools/quiet .venv/bin/python -m benchmarks.bench_weights_e2e --weights "native Q4_1:i8dot,Q8_0:native" --rounds 3

Run `llmtrace run capital --max-new-tokens 1` once before, so `--weights auto`'s first-run measurement is not timed
(and is made alone, under the same `quiet`).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

REPO = Path(__file__).resolve().parent.parent


def summary(args: list[str]) -> dict:
    done = subprocess.run([sys.executable, "-m", "llmtrace", "run", *args, "--no-trace", "--summary-json"], cwd=REPO,
                          check=True, capture_output=True, text=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--weights", default="auto native",
                        help="--weights values separated by spaces (a per-type plan has commas)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--decode-tokens", type=int, default=64)
    parser.add_argument("--skip-prefill", action="store_true")
    args = parser.parse_args()
    from benchmarks.bench_vs_peers import PROMPT_TOKENS, prompt_of
    from llmtrace.tracer.load.loader import load_model

    text, ids = prompt_of(load_model(None, weights="native").tokenizer, PROMPT_TOKENS)
    settings = args.weights.split()
    decode: dict[str, list[float]] = {w: [] for w in settings}
    prefill: dict[str, list[float]] = {w: [] for w in settings}
    formats: dict[str, str] = {}
    print("load average before:", os.getloadavg(), flush=True)
    for round_ in range(args.rounds):
        for weights in settings:
            got = summary(["capital", "--weights", weights, "--max-new-tokens", str(args.decode_tokens)])
            decode[weights].append(got["decode_tokens_per_second"])
            formats[weights] = got["weight_format"]
            line = f"  round {round_ + 1} --weights {weights:8} decode {got['decode_tokens_per_second']:6.1f} tok/s"
            if not args.skip_prefill:
                long = summary([text, "--literal", "--weights", weights, "--max-new-tokens", "1"])
                assert long["prompt_tokens"] == len(ids), long["prompt_tokens"]
                prefill[weights].append(long["prefill_tokens_per_second"])
                line += f", {len(ids)}-token prefill {long['prefill_tokens_per_second']:6.1f} tok/s"
            print(line, flush=True)
    for weights in settings:
        cells = f"decode median {statistics.median(decode[weights]):.1f} tok/s"
        if prefill[weights]:
            cells += f", prefill median {statistics.median(prefill[weights]):.1f} tok/s"
        print(f"--weights {weights}: {formats[weights]}: {cells}")
    print("load average after:", os.getloadavg())


if __name__ == "__main__":
    main()
