"""Decode tokens/s of two trees side by side on one model, greedy and drawn, and where each step's time went
(issue 30: whether any of the sampler must stay in C).

Each tree runs in its own child processes (its own llmtrace, its own native library), in turn (A B A B ...); a
child loads the model, warms up with one run, then times `--runs` runs per way of a `--decode-tokens` decode from a
short prompt: greedy and drawn at `--temperature` (seed 1). Per way: decode tokens/s as bench_vs_peers times them
(decode steps over the wall from the PrefillDone event to the last TokenStep), and the median per decode step of
the StepRecord's forward_ns and sample_ns (run ahead: C's clock readings; the sampler's time is the choice of the
next token). A shared host's slow spells move whole children, so the paired ratio of each child pair (seconds apart)
is given, and its median.

    /work/tools/quiet .venv/bin/python -m benchmarks.bench_sampler_ab /work/wt/base /work/wt/new \\
        --model /tmp/scale_models/llama-1b.Q4_0.random.gguf --pairs 4
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this repo's benchmarks beside the tree's llmtrace
from benchmarks.tree_child import run_in_tree  # noqa: E402

PROMPT = "The history of the city begins with a small settlement on the river"


def child(model: str, runs: int, decode_tokens: int, temperature: float, threads: int) -> dict[str, Any]:
    import torch

    torch.set_num_threads(threads)
    from llmtrace.tracer.load.loader import load_model
    from benchmarks.bench_vs_peers import timed_generation
    from llmtrace.tracer.load.loader import load_model
    from llmtrace.tracer.trace.records import RunSettings

    loaded = load_model(model or None)

    def once(t: float) -> tuple[float, list[int], list[int], Any]:
        settings = RunSettings(model=model, prompt=PROMPT, max_new_tokens=decode_tokens, dtype="auto", trace=False,
                               temperature=t, seed=1 if t > 0 else None)
        rate, trace = timed_generation(loaded, settings)
        decode = [s for s in trace.steps if s.phase == "decode"]
        return (rate, [s.forward_ns for s in decode], [s.sample_ns for s in decode],
                [s.token_id for s in trace.steps])

    out: dict[str, Any] = {"source": loaded.source, "format": loaded.weight_format}
    ways = {"greedy": 0.0, f"T={temperature:g}": temperature}
    for name, t in ways.items():
        once(t)  # warm-up
        rates, forward, sample = [], [], []
        for _ in range(runs):
            rate, f, s, ids = once(t)
            rates.append(rate)
            forward += f
            sample += s
        out[name] = {"tok_s": statistics.median(rates), "forward_ms": statistics.median(forward) / 1e6,
                     "sample_ms": statistics.median(sample) / 1e6, "ids": ids}
    return out


def run_child(tree: Path, args: argparse.Namespace) -> dict[str, Any]:
    return run_in_tree(__file__, tree, ["--model", args.model, "--runs", str(args.runs),
                                         "--decode-tokens", str(args.decode_tokens), "--temperature",
                                         str(args.temperature), "--threads", str(args.threads)])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("trees", nargs="*", type=Path)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--model", default="", help="a GGUF file (default: the bundled model)")
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--decode-tokens", type=int, default=32)
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.model, args.runs, args.decode_tokens, args.temperature, args.threads)))
        return
    a, b = args.trees
    results: dict[Path, list[dict[str, Any]]] = {a: [], b: []}
    for _ in range(args.pairs):
        for tree in (a, b):
            results[tree].append(run_child(tree, args))
    first = results[a][0]
    print(f"model: {first['source']} ({first['format']}); {args.decode_tokens} tokens, {args.runs} runs a child, "
          f"{args.pairs} child pairs, {args.threads} threads")
    for way in [k for k in first if k not in ("source", "format")]:
        print(f"{way}:")
        for tree in (a, b):
            rows = results[tree]
            each = " ".join(f"{r[way]['tok_s']:.2f}" for r in rows)
            print(f"  {tree.name}: {statistics.median(r[way]['tok_s'] for r in rows):.2f} tok/s ({each}); per step "
                  f"forward {statistics.median(r[way]['forward_ms'] for r in rows):.2f} ms, sampler "
                  f"{statistics.median(r[way]['sample_ms'] for r in rows):.3f} ms")
        paired = [rb[way]["tok_s"] / ra[way]["tok_s"] for ra, rb in zip(results[a], results[b])]
        same = all(ra[way]["ids"] == rb[way]["ids"] for ra, rb in zip(results[a], results[b]))
        print(f"  {b.name} / {a.name}: {statistics.median(paired):.3f} (pairs {' '.join(f'{r:.3f}' for r in paired)});"
              f" same tokens: {same}")


if __name__ == "__main__":
    main()
