"""GGUF dequantization throughput per type: llmtrace's decoder (tracer/load/gguf_dequant.py) against
`gguf.quants.dequantize` called the same way (rows as rows), and for F16/BF16 against the hand-written numpy llmtrace
used before (kept here only as the comparison that removed it). Q4_0, Q4_1 and Q8_0 are llmtrace's own fast paths.

One 4096 x 4096 matrix per type (16.8 M values), blocks from tests/tiny_gguf.random_blocks (random quant bits,
small finite scales) or gguf's quantizer for the float types. Rounds interleave the decoders; medians reported.

    flock /tmp/llmtrace-bench.lock .venv/bin/python -m benchmarks.bench_dequant --rounds 5 [--types Q8_0,Q4_1]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import numpy as np

REPO = Path(__file__).resolve().parent.parent
ROWS = COLS = 4096


def _hand_f16(raw: np.ndarray) -> np.ndarray:
    return raw.view("<f2").astype(np.float32)


def _hand_bf16(raw: np.ndarray) -> np.ndarray:
    return (raw.view("<u2").astype(np.uint32) << 16).view(np.float32)


_HAND_WRITTEN_BEFORE = {"F16": _hand_f16, "BF16": _hand_bf16}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--types", default="", help="comma-separated type names (default: all)")
    args = parser.parse_args()
    sys.path[:0] = [str(REPO), str(REPO / "tests")]
    import gguf
    from gguf.quants import dequantize as gguf_dequantize
    from tiny_gguf import BLOCK_LAYOUTS, random_blocks

    from llmtrace.tracer.load.gguf_dequant import dequantize

    q = gguf.GGMLQuantizationType
    rng = np.random.default_rng(0)
    matrices: dict[str, tuple[q, np.ndarray]] = {}
    for qtype in (q.F16, q.BF16):
        values = rng.standard_normal((ROWS, COLS), dtype=np.float32)
        matrices[qtype.name] = (qtype, np.ascontiguousarray(gguf.quants.quantize(values, qtype)).view(np.uint8))
    for qtype in sorted(BLOCK_LAYOUTS, key=int):  # every type gets a matrix, so the data never depends on --types
        matrices[qtype.name] = (qtype, random_blocks(qtype, ROWS, COLS, rng))

    def timed(fn: Callable[[], object]) -> float:
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start

    if args.types:
        wanted = args.types.upper().split(",")
        matrices = {name: matrices[name] for name in wanted}
    times: dict[str, dict[str, list[float]]] = {name: {} for name in matrices}
    for _ in range(args.rounds):
        for name, (qtype, rows) in matrices.items():
            flat = rows.reshape(-1)
            cases = {"llmtrace": lambda: dequantize(flat, int(qtype), COLS),
                     "gguf": lambda: gguf_dequantize(rows, qtype)}
            if name in _HAND_WRITTEN_BEFORE:
                cases["hand-written (removed)"] = lambda: _HAND_WRITTEN_BEFORE[name](flat)
            for case, fn in cases.items():
                times[name].setdefault(case, []).append(timed(fn))
    n = ROWS * COLS
    print(f"{ROWS} x {COLS} values per type, {args.rounds} rounds, medians; M values/s (higher is faster)")
    print()
    print("| type | llmtrace | gguf.quants.dequantize | hand-written numpy (removed) | llmtrace / gguf |")
    print("|---|---:|---:|---:|---:|")
    for name, cases in times.items():
        rate = {case: n / statistics.median(t) / 1e6 for case, t in cases.items()}
        hand = f"{rate['hand-written (removed)']:.0f}" if "hand-written (removed)" in rate else "-"
        print(f"| {name} | {rate['llmtrace']:.0f} | {rate['gguf']:.0f} | {hand} | {rate['llmtrace'] / rate['gguf']:.2f} |")


if __name__ == "__main__":
    main()
