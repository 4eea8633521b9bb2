"""One-token products of a float checkpoint's decode step: torch.mv against mm ((1, K) @ (K, N), as F.linear runs
one row), per dtype, at LLaMA-7B's fused shapes, for the default table's "float checkpoints" column
(tracer/hardware/kernel_defaults.py: which of functional.MATVEC_KERNELS a dense decode step runs, per instruction set).

Each shape's matrix (random values; Q|K|V 12288 x 4096, O 4096 x 4096, gate|up 22016 x 4096, down 4096 x 11008) is
multiplied by one row through `functional.matvec` and `functional.matvec_mm`, the two alternated call by call for
`--seconds` each, on `--threads` threads; the table gives the weights streamed per second (bytes over the median
call), each dtype's sum over the four products (a step's share), and mm over mv.

    /work/tools/quiet /work/tools/py -m benchmarks.bench_matvec --threads 2
"""

from __future__ import annotations

import argparse
import statistics
import time

SHAPES = {"Q|K|V": (12288, 4096), "O": (4096, 4096), "gate|up": (22016, 4096), "down": (4096, 11008)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seconds", type=float, default=0.6, help="per shape, dtype and kernel")
    parser.add_argument("--dtypes", default="fp32,bf16,fp16")
    args = parser.parse_args()

    import torch

    from llmtrace.tracer.model.functional import matvec, matvec_mm

    torch.set_num_threads(args.threads)
    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
    print(f"torch {torch.__version__}, CPU capability {torch.backends.cpu.get_cpu_capability()}, "
          f"{args.threads} threads")
    print("| dtype | product | mv ms | mv GB/s | mm ms | mm GB/s | mm / mv |")
    print("|---|---|---:|---:|---:|---:|---:|")
    generator = torch.Generator().manual_seed(0)
    for name in args.dtypes.split(","):
        dtype = dtypes[name]
        step = {"mv": 0.0, "mm": 0.0}
        for product, (n, k) in SHAPES.items():
            weight = torch.randn(n, k, generator=generator).to(dtype)
            x = torch.randn(k, generator=generator).to(dtype)
            times: dict[str, list[float]] = {"mv": [], "mm": []}
            with torch.no_grad():
                for kernel in (matvec, matvec_mm):  # warm: oneDNN's first call of a shape builds its kernel
                    kernel(weight, x)
                end = time.perf_counter() + 2 * args.seconds
                while time.perf_counter() < end:
                    for label, kernel in (("mv", matvec), ("mm", matvec_mm)):
                        start = time.perf_counter()
                        kernel(weight, x)
                        times[label].append(time.perf_counter() - start)
            median = {label: statistics.median(t) for label, t in times.items()}
            gbs = {label: weight.nbytes / s / 1e9 for label, s in median.items()}
            for label in step:
                step[label] += median[label]
            print(f"| {name} | {product} | {1e3 * median['mv']:.2f} | {gbs['mv']:.1f} | {1e3 * median['mm']:.2f} | "
                  f"{gbs['mm']:.1f} | {median['mv'] / median['mm']:.2f}x |")
            del weight
        print(f"| {name} | a layer's four | {1e3 * step['mv']:.2f} | | {1e3 * step['mm']:.2f} | | "
              f"{step['mv'] / step['mm']:.2f}x |")


if __name__ == "__main__":
    main()
