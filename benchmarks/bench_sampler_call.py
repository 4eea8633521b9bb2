"""`Sampler.sample` alone, per call, with the caches evicted before each (as right after a decode step that streamed
the weights), on random logits of a vocabulary's size; greedy and drawn at T=0.7. The native library is loaded
first, as a native run has it (a tree whose sampler used C passes when it was loaded then uses them).

    cd /work/wt/TREE && /work/tools/quiet /work/tools/py -m benchmarks.bench_sampler_call 128256
"""

from __future__ import annotations

import statistics
import sys
import time

import numpy as np
import torch


def main() -> None:
    from llmtrace.tracer.model import native_kernel
    from llmtrace.tracer.run.sampling import Sampler, SamplingParams

    native_kernel.library()
    vocab = int(sys.argv[1]) if len(sys.argv) > 1 else 128256
    generator = torch.Generator().manual_seed(0)
    rows = [(torch.randn(vocab, generator=generator) * 3).numpy() for _ in range(8)]
    evict = np.ones(16_000_000, dtype=np.float32)  # 64 MB written between calls
    for name, case in (("greedy", {}), ("T=0.7", {"temperature": 0.7})):
        sampler = Sampler(SamplingParams(seed=1, **case))
        times = []
        for i in range(300):
            evict += 1.0
            start = time.perf_counter_ns()
            sampler.sample(rows[i % len(rows)])
            times.append(time.perf_counter_ns() - start)
        print(f"vocabulary {vocab}, {name}: median {statistics.median(times) / 1e3:.0f} us, "
              f"p25 {np.percentile(times, 25) / 1e3:.0f} us")


if __name__ == "__main__":
    main()
