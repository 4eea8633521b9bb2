"""A 128-token prefill on a 2-layer model at LLaMA-7B widths (benchmarks/scale_models.py's llama-7b shape cut to two
layers), the products' time without 30 more layers' load: how a prefill kernel change moves at the real widths in
seconds rather than minutes (BENCHMARKS.md, "At the sizes users run").

Per mix of `--mixes`: the file is written into `--dir` once (reused), loaded with run's default kernels, and a
128-token prompt (random ids, seed 0) prefilled `--rounds` times into a fresh cache; the best and the median wall
of `Transformer.prefill`. Run it in each tree of a before/after pair (each tree's own checkout on PYTHONPATH),
alternating, under /work/tools/quiet:

    /work/tools/quiet /work/tools/py -m benchmarks.bench_prefill_2layer --dir /tmp/scale --mixes Q4_0,Q4_K_M
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

SHAPE = ("two-layer-7b", 4096, 2, 32, 32, 11008, 32000, 10000.0, False, 4096)  # tests/test_memory_budget.py's


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", type=Path, required=True, help="where the 2-layer files are written and reused")
    parser.add_argument("--mixes", default="Q4_0,Q4_K_M")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    from benchmarks.scale_models import Shape, write
    from llmtrace.tracer.core.dtypes import get_compute_dtype
    from llmtrace.tracer.load.loader import load_model

    for mix in args.mixes.split(","):
        path = args.dir / f"{SHAPE[0]}.{mix}.random.gguf"
        if not path.exists():
            args.dir.mkdir(parents=True, exist_ok=True)
            write(path, Shape(*SHAPE), mix, say=lambda _: None)
        loaded = load_model(str(path), dtype=get_compute_dtype("auto"))
        model = loaded.model
        model.setup_cache(1, args.tokens + 8)
        prompt = torch.randint(3, SHAPE[6], (1, args.tokens), generator=torch.Generator().manual_seed(0))
        seconds = []
        with torch.no_grad():
            for _ in range(args.rounds + 1):  # the first one warms up, untimed
                model.reset_cache()
                began = time.perf_counter()
                model.prefill(prompt)
                seconds.append(time.perf_counter() - began)
        seconds = seconds[1:]
        print(f"{path.name} ({loaded.weight_format}): {args.tokens}-token prefill best {min(seconds):.2f} s, "
              f"median {statistics.median(seconds):.2f} s over {args.rounds}")


if __name__ == "__main__":
    main()
