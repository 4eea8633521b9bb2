"""What the weights cache's safety checks cost (tracer/load/weights_cache.py), on the bundled model in fp32.

- the entry check that runs on every cached load: XXH3-128 of the whole entry (~540 MB; its header too since issue
  27, read with read() rather than a map), beside hashlib's sha256 and blake2b and zlib's crc32 over the entry's
  tensor bytes, memory-mapped;
- the source digest, XXH3-128 of the whole GGUF (~98 MB), paid once per file identity (then remembered);
- a whole cached `load_model(None)` (the check included), and the check's share of it.

Each figure is the median of `--rounds` runs, all in this process, interleaved round by round; the entry and the
GGUF stay in the page cache (warm), as they are on a second load.

    flock /tmp/llmtrace-bench.lock .venv/bin/python -m benchmarks.bench_cache_checks --rounds 5
"""

from __future__ import annotations

import argparse
import hashlib
import mmap
import os
import statistics
import tempfile
import time
import zlib
from pathlib import Path
from typing import Callable

import xxhash


def _timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _over(path: Path, start: int, update: Callable[[memoryview], None]) -> None:
    with open(path, "rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        view = memoryview(mm)
        try:
            for begin in range(start, len(mm), 2**30):
                update(view[begin:begin + 2**30])
        finally:
            view.release()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as cache:
        os.environ["LLMTRACE_CACHE_DIR"] = cache
        import torch

        from llmtrace.tracer.checkpoint.bundled import bundled_model_path
        from llmtrace.tracer.checkpoint.safetensors_header import read_safetensors_header
        from llmtrace.tracer.core.dtypes import FP32
        from llmtrace.tracer.load import weights_cache
        from llmtrace.tracer.load.loader import load_model

        source = bundled_model_path()
        # dense: converts and stores the entry (stored native weights are the file itself and never cached)
        load_model(None, dtype=FP32, weights="dense")
        entry = weights_cache.cache_path(source, torch.float32)
        start = read_safetensors_header(entry).data_start
        size = entry.stat().st_size - start

        def crc32() -> None:
            state = [0]
            _over(entry, start, lambda b: state.__setitem__(0, zlib.crc32(b, state[0])))

        def hashed(make: Callable[[], object]) -> Callable[[], None]:
            def run() -> None:
                h = make()
                _over(entry, start, h.update)  # type: ignore[attr-defined]
            return run

        cases: dict[str, Callable[[], object]] = {
            "entry check: XXH3-128 of the whole entry, read() (used)": lambda: weights_cache.entry_checksum(entry),
            "entry bytes: sha256": hashed(hashlib.sha256),
            "entry bytes: blake2b": hashed(hashlib.blake2b),
            "entry bytes: crc32": crc32,
            "source digest: XXH3-128 of the GGUF (once per file)": lambda: weights_cache.hash_file(source),
            "cached load_model(None), check included": lambda: load_model(None, dtype=FP32, weights="dense"),
        }
        times: dict[str, list[float]] = {name: [] for name in cases}
        for _ in range(args.rounds):
            for name, fn in cases.items():
                times[name].append(_timed(fn))
        print(f"entry tensor bytes {size / 1e6:.0f} MB; GGUF {source.stat().st_size / 1e6:.0f} MB; "
              f"{args.rounds} rounds, medians")
        load = statistics.median(times["cached load_model(None), check included"])
        for name, values in times.items():
            median = statistics.median(values)
            rate = f"{size / median / 1e9:6.2f} GB/s" if name.startswith("entry") else " " * 11
            share = f"{median / load:6.1%} of a cached load" if name != "cached load_model(None), check included" else ""
            print(f"{name:<55} {median * 1e3:8.1f} ms  {rate}  {share}")


if __name__ == "__main__":
    main()
