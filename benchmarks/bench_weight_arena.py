"""The weight arena (tracer/load/weight_arena.py) against plain pages, in one process: the bundled model loaded twice
under the same `--weights`, once with its block-kernel matrices where they were read (one private buffer each, as
gguf_source's pread leaves them: no huge-page advice; before issue 27 these were views of the memory-mapped GGUF,
the file's 4 KiB pages; the arena switched off) and once in the huge-page-advised arena; then decode steps of the
two alternated (`decode_one`, the native C step, 2 threads), so a slow spell of a shared machine hits both. Each
step streams the whole model (~100 MB) from DRAM, so neither copy is helped by the other's cache. Reports each
load's time, and the decode steps' median, 10th and 90th percentiles; and whether the arena got huge pages
(AnonHugePages of this process).

    /work/tools/quiet .venv/bin/python -m benchmarks.bench_weight_arena --weights native --steps 300
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from llmtrace.tracer.load import gguf_loader  # noqa: E402
from llmtrace.tracer.load.loader import load_model  # noqa: E402
from llmtrace.tracer.run.backends import backend_for  # noqa: E402


def anon_huge_kib() -> int:
    for line in Path("/proc/self/smaps_rollup").read_text().splitlines():
        if line.startswith("AnonHugePages:"):
            return int(line.split()[1])
    return 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--weights", default="native")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print("load average before:", os.getloadavg())
    arena_slots = gguf_loader._arena_slots
    loaded, load_s = {}, {}
    for name in ("plain pages", "arena"):
        gguf_loader._arena_slots = arena_slots if name == "arena" else (lambda *a, **k: (None, {}))
        start = time.perf_counter()
        loaded[name] = load_model(None, weights=args.weights)
        load_s[name] = time.perf_counter() - start
    gguf_loader._arena_slots = arena_slots
    tokenizer = loaded["arena"].tokenizer
    ids = torch.tensor([list(tokenizer.encode("The capital of France is"))])  # (1, T)
    token = ids[:, -1:]
    runs = {}
    for name, one in loaded.items():
        one.model.setup_cache(1, ids.shape[1] + args.steps + 8)
        runs[name] = backend_for(one.model)
        runs[name].prefill(ids)
        for _ in range(4):  # warm-up
            runs[name].decode(token)
    ns: dict[str, list[int]] = {name: [] for name in loaded}
    order = list(loaded.items())
    for step in range(args.steps):
        for name, one in order if step % 2 else order[::-1]:
            start = time.perf_counter_ns()
            runs[name].decode(token)
            ns[name].append(time.perf_counter_ns() - start)
    print(f"--weights {args.weights}, {args.threads} threads, {args.steps} decode steps each, alternated; "
          f"AnonHugePages {anon_huge_kib() / 1024:.0f} MiB")
    for name, values in ns.items():
        p10, p50, p90 = (float(np.percentile(values, p)) / 1e6 for p in (10, 50, 90))
        print(f"  {name:10} load {load_s[name]:.2f} s   decode_one median {p50:.2f} ms  p10 {p10:.2f}  p90 {p90:.2f}")
    ratio = np.median(ns["plain pages"]) / np.median(ns["arena"])
    print(f"  plain pages / arena (medians): {ratio:.3f}x")
    print("load average after:", os.getloadavg())


if __name__ == "__main__":
    main()
