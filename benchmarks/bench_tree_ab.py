"""Two llmtrace trees side by side on the bundled model: `run`'s default prefill and decode tok/s four ways (untraced,
untraced a step a call, traced, --staged traced), one child process per tree, A B B A A B ...: which tree runs first
in a set alternates, since the order alone moves the figures (in six rounds of three trees' children on a busy host,
BENCHMARKS.md's issue 30 section, the last child of every round decoded slowest, 2-13% below the first, and A B A B
... charged that to B). Each child warms up once and times `--rounds` rounds; medians over the
children, the ratio B/A, and whether every way gave the same token ids.

    /work/tools/quiet .venv/bin/python -m benchmarks.bench_tree_ab /work/wt/base /work/wt/new --sets 11

A tree is a worktree with a `<tree>-pkgs/llmtrace` link beside it (the package import path its child gets); the
timing code is this repository's (bench_vs_peers.time_llmtrace) for both.
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

WAYS = {"untraced": (False, False, True), "untraced a step a call": (False, False, False),
        "traced": (True, False, True), "staged traced": (True, True, True)}  # (trace, staged, run ahead)


def child(rounds: int, threads: int, dtype: str) -> dict[str, Any]:
    import torch

    torch.set_num_threads(threads)
    from benchmarks.bench_vs_peers import PROMPT_TOKENS, prompt_of, time_llmtrace
    from llmtrace.tracer.core.dtypes import get_compute_dtype
    from llmtrace.tracer.load.loader import load_model

    loaded = load_model(None, dtype=get_compute_dtype(dtype))
    text, _ = prompt_of(loaded.tokenizer, PROMPT_TOKENS)
    got: dict[str, list[tuple[float, float]]] = {way: [] for way in WAYS}
    ids: dict[str, list[int]] = {}
    for index in range(rounds + 1):  # round 0 warms up
        for way, (trace, staged, ahead) in WAYS.items():
            (prefill, decode, ids[way]), _ = time_llmtrace(loaded, text, trace, staged, 32, ahead)
            if index:
                got[way].append((prefill, decode))
    return {"prefill": {w: statistics.median(p for p, _ in v) for w, v in got.items()},
            "decode": {w: statistics.median(d for _, d in v) for w, v in got.items()},
            "ids": {w: v for w, v in ids.items()}}


def run_child(tree: Path, args: argparse.Namespace) -> dict[str, Any]:
    return run_in_tree(__file__, tree, ["--rounds", str(args.rounds), "--threads", str(args.threads),
                                        "--dtype", args.dtype])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("trees", nargs="*", type=Path)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--sets", type=int, default=5, help="children per tree, alternated")
    parser.add_argument("--rounds", type=int, default=2, help="timed rounds in each child")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dtype", default="auto", help="the bundled model's dtype: auto (its Q4 blocks on the C "
                        "step), or fp32/bf16/fp16 (dequantized: decode on the packed torch path)")
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.rounds, args.threads, args.dtype)))
        return
    a, b = args.trees
    results: dict[Path, list[dict[str, Any]]] = {a: [], b: []}
    for index in range(args.sets):
        for tree in (a, b) if index % 2 == 0 else (b, a):
            results[tree].append(run_child(tree, args))
    for phase in ("prefill", "decode"):
        for way in WAYS:
            values = {t: sorted(r[phase][way] for r in results[t]) for t in (a, b)}
            mid = {t: statistics.median(v) for t, v in values.items()}
            print(f"{phase:7s} {way:23s} {a.name} {mid[a]:7.1f} ({values[a][0]:.0f}-{values[a][-1]:.0f})  "
                  f"{b.name} {mid[b]:7.1f} ({values[b][0]:.0f}-{values[b][-1]:.0f})  ratio {mid[b] / mid[a]:.3f}")
    for tree in (a, b):
        decode = [r["decode"] for r in results[tree]]
        overhead = statistics.median(d["untraced"] for d in decode) / statistics.median(d["traced"] for d in decode)
        print(f"{tree.name}: tracing overhead (untraced / traced decode tok/s) {overhead:.3f}")
    ids = {json.dumps(way_ids) for t in (a, b) for r in results[t] for way_ids in r["ids"].values()}
    print(f"same token ids every way, both trees: {len(ids) == 1}")


if __name__ == "__main__":
    main()
