"""Two builds of the native library, one process: i8dot's Q4_0 product over rows interleaved in groups (the
decode step's and the prefill's kernel, native/int8_dot.c i8_q4_group) at LLaMA-7B's shapes, calls alternated
between the two libraries so that a shared machine's slow spells hit both (a whole-process A/B of a 7B decode moved
by 2x between repeats on this host).

The matrices: four random Q4_0 matrices of 22,016 x 4,096 (7B's gate|up: 50.7 MB each, 203 MB together, over the
32 MB L3, so each call streams from memory as a decode step does), each interleaved once by each library's
llmt_interleave (the same bytes). Per round, for each library in turn (the order alternated): one product per matrix
of 1 activation row (decode) and of `--prefill-rows` rows (prefill), 2 threads. The figures: median and p10 of the
per-call GB/s over the rounds, and the median of the rounds' ratios; the outputs of the two libraries compared bit for
bit.

    /work/tools/quiet /work/tools/py -m benchmarks.bench_i8_group_ab --a LIB_A.so --b LIB_B.so --rounds 40

The libraries: `native_kernel.prepare()` in each tree prints its path.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
ROWS, K = 22016, 4096
Q4_0, INT8_X = 2, 1


def huge_pages(nbytes: int) -> np.ndarray:
    """nbytes of anonymous memory advised for huge pages, as the loader's weight arena holds the groups
    (tracer/load/weight_arena.py): the TLB and the hardware prefetchers see what a decode step's products see."""
    from llmtrace.tracer.load.weight_arena import WeightArena

    return WeightArena(nbytes).take(nbytes)


class Library:
    def __init__(self, path: str) -> None:
        self.lib = ctypes.CDLL(path)
        self.lib.llmt_describe.restype = ctypes.c_int
        self.lib.llmt_matmul.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p,
                                         ctypes.c_int]
        self.lib.llmt_interleave.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
                                             ctypes.c_int64, ctypes.c_void_p]
        self.lib.llmt_set_groups.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p]
        self.lib.llmt_matrix_size.restype = ctypes.c_int64
        self.kept: list[object] = []

    def matrix(self, rows: np.ndarray) -> ctypes.Array:
        """A described one-part Q4_0 matrix with its interleaved copy (made by this library)."""
        groups = huge_pages(rows.size)
        assert self.lib.llmt_interleave(Q4_0, rows.ctypes.data, rows.shape[1], rows.shape[0], K,
                                        groups.ctypes.data) == 0
        described = ctypes.create_string_buffer(self.lib.llmt_matrix_size())
        status = self.lib.llmt_describe(1, (ctypes.c_int * 1)(Q4_0), (ctypes.c_void_p * 1)(rows.ctypes.data),
                                        (ctypes.c_int64 * 1)(rows.shape[1]), (ctypes.c_int64 * 1)(rows.shape[0]),
                                        ctypes.c_int64(K), (ctypes.c_int * 1)(INT8_X), described)
        assert status == 0 and self.lib.llmt_set_groups(described, 0, groups.ctypes.data) == 0
        self.kept += [groups, described]
        return described

    def product(self, described: ctypes.Array, x: np.ndarray, out: np.ndarray) -> float:
        began = time.perf_counter()
        status = self.lib.llmt_matmul(ctypes.addressof(described), x.ctypes.data, x.shape[0], out.ctypes.data, 2)
        seconds = time.perf_counter() - began
        assert status == 0
        return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--a", required=True, help="a built library (the change)")
    parser.add_argument("--b", required=True, help="another (the baseline)")
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--prefill-rows", type=int, default=128)
    args = parser.parse_args()
    sys.path[:0] = [str(REPO), str(REPO / "tests")]
    import gguf
    from tiny_gguf import random_blocks

    import torch  # the OpenMP runtime the libraries share (torch's libgomp), as in a run

    torch.set_num_threads(2)
    rng = np.random.default_rng(0)
    mats = [np.ascontiguousarray(random_blocks(gguf.GGMLQuantizationType.Q4_0, ROWS, K, rng)) for _ in range(4)]
    libs = {"a": Library(args.a), "b": Library(args.b)}
    described = {name: [lib.matrix(m) for m in mats] for name, lib in libs.items()}
    xs = {1: rng.standard_normal((1, K)).astype(np.float32),
          args.prefill_rows: rng.standard_normal((args.prefill_rows, K)).astype(np.float32)}
    outs = {(name, m): np.empty((m, ROWS), dtype=np.float32) for name in libs for m in xs}
    rates: dict[tuple[str, int], list[float]] = {(name, m): [] for name in libs for m in xs}
    ratios: dict[int, list[float]] = {m: [] for m in xs}
    for r in range(args.rounds + 1):  # round 0 warms up, untimed
        order = ["a", "b"] if r % 2 else ["b", "a"]
        for m, x in xs.items():
            seconds = {}
            for name in order:
                seconds[name] = sum(libs[name].product(d, x, outs[(name, m)]) for d in described[name])
            if r:
                for name in libs:
                    rates[(name, m)].append(4 * mats[0].nbytes / seconds[name] / 1e9)
                ratios[m].append(seconds["b"] / seconds["a"])
    print(f"{os.cpu_count()} CPUs, 2 threads, {args.rounds} rounds; load average {os.getloadavg()}")
    for m in xs:
        same = np.array_equal(outs[("a", m)], outs[("b", m)])
        for name in libs:
            v = sorted(rates[(name, m)])
            print(f"{m:>4} activation row(s), library {name}: median {statistics.median(v):.1f} GB/s, "
                  f"p90 {v[int(0.9 * (len(v) - 1))]:.1f} GB/s")
        print(f"{m:>4} row(s): a / b speed, median of the rounds' ratios {statistics.median(ratios[m]):.3f}; "
              f"outputs equal bit for bit: {same}")


if __name__ == "__main__":
    main()
