"""One shared-memory collective's cost in Python, the tree's own code (tracer/run/shm_link.py): an all_reduce of a
hidden-size payload on a one-rank link, so no other rank's arrival is timed, only what a rank does per collective
(post its part, check the flags, sum the parts). Under --tp a step makes two a layer.

    /work/tools/quiet .venv/bin/python -m benchmarks.bench_shm_collective --floats 576

Two trees side by side: run it with each tree's package first on the import path (PYTHONPATH=<tree>-pkgs).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import timeit

import torch

from llmtrace.tracer.run.shm_link import SharedMemoryLink


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--floats", type=int, default=576, help="payload (SmolLM2-135M's hidden size: 576)")
    parser.add_argument("--calls", type=int, default=20_000, help="collectives per timed round")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as folder:
        link = SharedMemoryLink(os.path.join(folder, "link"), 0, 1, 5.0)
        x = torch.randn(args.floats)
        rounds = [timeit.timeit(lambda: link.all_reduce(x), number=args.calls) / args.calls * 1e6
                  for _ in range(args.rounds)]
    print(f"all_reduce of {args.floats} floats, one rank: median {statistics.median(rounds):.2f} µs "
          f"(rounds {', '.join(f'{r:.2f}' for r in rounds)})")


if __name__ == "__main__":
    main()
