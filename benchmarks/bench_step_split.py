"""Where a default decode step's time goes, per llmtrace tree: the C forward and the sampler called from C, read from
C's own clock (AheadRun.clock: each step's start, its logits' end, its choice's end), beside the run's decode tok/s.
One child process per tree and round, the trees' order rotated each round (the order alone moves the figures on a
busy host); each child runs `run`'s default (untraced, run ahead) on the bundled model, a 128-token prompt and 64 new
tokens, warms up once and times three generations.

    /work/tools/quiet .venv/bin/python benchmarks/bench_step_split.py /work/wt/base /work/wt/new --rounds 3

A tree is a worktree with a `<tree>-pkgs/llmtrace` link beside it (benchmarks/tree_child.py).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this repo's benchmarks beside the tree's llmtrace
from benchmarks.tree_child import run_in_tree  # noqa: E402


def child(threads: int) -> dict[str, Any]:
    import torch

    torch.set_num_threads(threads)
    from benchmarks.bench_vs_peers import PROMPT_TOKENS, prompt_of, timed_generation
    from llmtrace.tracer.core.dtypes import AUTO
    from llmtrace.tracer.load.loader import load_model
    from llmtrace.tracer.model import native_step
    from llmtrace.tracer.trace.records import RunSettings

    runs: list[Any] = []
    run_ahead = native_step.NativeStep.run_ahead

    def recorded(self: Any, *args: Any, **kwargs: Any) -> Any:
        run = run_ahead(self, *args, **kwargs)
        runs.append(run)
        return run

    native_step.NativeStep.run_ahead = recorded
    loaded = load_model(None, dtype=AUTO)
    text, _ = prompt_of(loaded.tokenizer, PROMPT_TOKENS)
    settings = RunSettings(model="", prompt=text, max_new_tokens=64, dtype="auto", trace=False, staged=False)
    timed_generation(loaded, settings)
    forward, choice, rates = [], [], []
    for _ in range(3):
        runs.clear()
        rates.append(timed_generation(loaded, settings)[0])
        forward += [end - start for run in runs for start, end, _ in run.clock]
        choice += [chosen - end for run in runs for _, end, chosen in run.clock]
    forward.sort()
    choice.sort()
    return {"tok_s": max(rates), "forward_p10_us": forward[len(forward) // 10] / 1e3,
            "forward_p50_us": forward[len(forward) // 2] / 1e3, "sampler_p10_us": choice[len(choice) // 10] / 1e3,
            "sampler_p50_us": choice[len(choice) // 2] / 1e3}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("trees", nargs="*", type=Path)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.threads)))
        return
    trees = list(args.trees)
    for index in range(args.rounds):
        order = trees[index % len(trees):] + trees[:index % len(trees)]
        for position, tree in enumerate(order, 1):
            got = run_in_tree(__file__, tree, ["--threads", str(args.threads)])
            print(f"round {index + 1} #{position} {tree.name:16s} " + "  ".join(f"{k} {v:.1f}" for k, v in got.items()))


if __name__ == "__main__":
    main()
