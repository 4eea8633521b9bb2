"""A prefill's Q8_0 products (128 activation rows) through the native library's three kernels side by side: "native"
(exact: tiles of W dequantized to fp32, then multiplied), "i8dot" and "i16dot" (activations rounded to int8 / int16;
i8dot with AVX-512 VNNI: sixteen rows of W packed at a time, every activation row over them; elsewhere, and i16dot,
tiles of 2 rows of W times 4 activation rows), at the bundled model's layer shapes or LLaMA-7B's (`--shapes 7b`),
with random Q8_0 blocks.

    /work/tools/quiet .venv/bin/python -m benchmarks.bench_q8_prefill [--rows 128] [--runs 15]
    /work/tools/quiet .venv/bin/python -m benchmarks.bench_q8_prefill --shapes 7b --threads 2 --kernels native,i8dot --runs 5

Calls of the three kernels are interleaved round by round (a slow spell of a shared machine hits all three); printed:
the median ms per product at 1 and 2 threads, and each kernel's ratio to native.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType as Q

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from llmtrace.tracer.model.weight_formats import I8DOT, I16DOT, NATIVE, pack_gguf  # noqa: E402
from tests.tiny_gguf import random_blocks  # noqa: E402

SHAPES = {
    "bundled": [(960, 576), (576, 576), (3072, 576), (576, 1536)],  # SmolLM2-135M: wq|wk|wv, wo, w1|w3, w2
    "7b": [(12288, 4096), (4096, 4096), (22016, 4096), (4096, 11008)],  # LLaMA-7B: the same four
}
KERNELS = (NATIVE, I8DOT, I16DOT)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=128, help="activation rows (prompt tokens)")
    parser.add_argument("--runs", type=int, default=15)
    parser.add_argument("--shapes", choices=sorted(SHAPES), default="bundled")
    parser.add_argument("--threads", default="1,2", help="thread counts, comma-separated")
    parser.add_argument("--kernels", default=",".join(KERNELS), help="kernels, comma-separated (the first: the base)")
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    print("load average before:", os.getloadavg())
    before = torch.get_num_threads()
    kernels = args.kernels.split(",")
    for threads in (int(t) for t in args.threads.split(",")):
        torch.set_num_threads(threads)
        print(f"{threads} thread(s); median ms per product of {args.rows} rows: " + " | ".join(kernels))
        for n, k in SHAPES[args.shapes]:
            raw = random_blocks(Q.Q8_0, n, k, rng)
            weights = [pack_gguf(raw, int(Q.Q8_0), k, kernel) for kernel in kernels]
            x = torch.randn(args.rows, k, generator=torch.Generator().manual_seed(n))
            times: list[list[float]] = [[] for _ in kernels]
            for w in weights:  # warm-up
                w(x)
            for _ in range(args.runs):
                for i, w in enumerate(weights):
                    start = time.perf_counter()
                    w(x)
                    times[i].append(time.perf_counter() - start)
            ms = [float(np.median(t)) * 1e3 for t in times]
            cells = " | ".join(f"{m:6.2f} ({ms[0] / m:.2f}x)" for m in ms)
            rate = " | ".join(f"{2 * n * k * args.rows / (m * 1e-3) / 1e9:.0f}" for m in ms)
            print(f"  {n:5}x{k:<5} {cells}   GFLOP/s {rate}", flush=True)
    torch.set_num_threads(before)
    print("load average after:", os.getloadavg())


if __name__ == "__main__":
    main()
