"""The bundled model's native decode step built from different C sources or trees, alternated: for trying a kernel
change before it is one (a prefetch distance, another row loop) where the figure that counts is a whole decode step
streamed from DRAM, not a product in cache.

    /work/tools/quiet .venv/bin/python -m benchmarks.bench_step_sources 3 cur@native "cur@Q4_1:i8dot,Q8_0:native" \\
        "/tmp/variant@Q4_1:i8dot,Q8_0:native" "/work/wt-other|cur@native"

Each variant is `[TREE|]SOURCES@WEIGHTS`: TREE a worktree whose .venv and code run it (default this one), SOURCES
`cur` (the tree's own tracer/model/native) or a folder holding a tree's native sources, every .c and .h (built into
SOURCES/build), WEIGHTS
a `--weights` value. Every round runs each variant once, in its own child process:
benchmarks.bench_native_rows.model_steps (128 `decode_one` steps after a 5-token prompt, 2 threads);
printed per round and as medians over the rounds of each child's median and 10th-percentile step.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent.parent


def child(sources: str, weights: str) -> None:
    sys.path.insert(0, str(Path.cwd()))
    if sources != "cur":
        from benchmarks.run_with_native_source import use_sources

        use_sources(Path(sources), Path(sources) / "build")
    from benchmarks.bench_native_rows import model_steps

    print(json.dumps(model_steps(weights, 128)))


def main() -> None:
    if sys.argv[1] == "--child":
        child(sys.argv[2], sys.argv[3])
        return
    rounds, variants = int(sys.argv[1]), sys.argv[2:]
    results: dict[str, list[tuple[float, float]]] = {v: [] for v in variants}
    print("load average before:", os.getloadavg(), flush=True)
    for _ in range(rounds):
        for variant in variants:
            tree, _, rest = variant.rpartition("|")
            sources, weights = rest.split("@")
            tree_path = Path(tree) if tree else HERE
            done = subprocess.run([str(tree_path / ".venv/bin/python"), "-m", "benchmarks.bench_step_sources",
                                   "--child", sources, weights], cwd=tree_path, capture_output=True, text=True)
            if done.returncode:
                sys.exit(f"{variant}: {done.stderr[-2000:]}")
            steps = json.loads(done.stdout.strip().splitlines()[-1])
            results[variant].append((steps["forward p50"], steps["forward p10"]))
            print(f"  {variant:55} median {steps['forward p50']:.2f} ms  p10 {steps['forward p10']:.2f}", flush=True)
    for variant, figures in results.items():
        print(f"{variant:57} median {statistics.median(m for m, _ in figures):.2f} ms  "
              f"p10 {statistics.median(p for _, p in figures):.2f}")
    print("load average after:", os.getloadavg())


if __name__ == "__main__":
    main()
