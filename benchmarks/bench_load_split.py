"""Where a GGUF's load goes (issue 31, item 3: load <= llama.cpp's): `load_model` with run's default kernels
(`--dtype auto`, `--weights` unset) under cProfile, its time split by what the functions do, with the peak RSS.

Parts, each the cumulative time of the functions named (they do not nest in one another):
- read (pread): gguf_source's reads of the file's bytes (os.preadv);
- interleave (C): native_kernel.interleave, i8dot's Q4_0/Q4_1 groups of sixteen rows written into the weight arena (the
  first touch of its fresh pages included), and native_kernel.hold_groups, the same in one pass from the file's map
  with the scales checked (the map's page faults included);
- Q/K reorder copies: gguf_loader.unpermute_rope_rows (llama.cpp's Q/K row order put back by a copy; since the
  single copy only for heads whose halves are not whole groups of sixteen, none of LLaMA's);
- scale checks: weight_formats.rows_scales_finite / grouped_scales_finite / native_kernel.scales_finite (every fp16
  scale and min finite; over the file's map, its page faults included);
- header + tokenizer: gguf_header.read_gguf_header and gguf_tokenizer.tokenizer_from_gguf;
- rest: the load's wall time minus those (arena allocation, row copies, plan, Python).
cProfile's own overhead is in the figures: little for the C calls and the reads, ~3x for Python-heavy parts (the
tokenizer's protobuf, ~900k calls at a 128k vocabulary: 0.40 s unprofiled, 1.2 s profiled); `--no-profile` times
the load alone. The file should be in the page cache (run it twice, take the second) for the read to be the copy
rather than the disk.

    /work/tools/quiet /work/tools/py -m benchmarks.bench_load_split /tmp/scale/llama-7b.Q4_0.random.gguf
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import resource
import time

PARTS = {
    "read (pread)": [("", "<built-in method posix.preadv>")],
    "interleave (C)": [("native_kernel.py", "interleave"), ("native_kernel.py", "hold_groups")],
    "Q/K reorder copies": [("gguf_loader.py", "unpermute_rope_rows")],
    "scale checks": [("weight_formats.py", "rows_scales_finite"), ("weight_formats.py", "grouped_scales_finite"),
                     ("native_kernel.py", "scales_finite")],
    "header + tokenizer": [("gguf_header.py", "read_gguf_header"), ("gguf_tokenizer.py", "tokenizer_from_gguf")],
}


def split(stats: pstats.Stats, wall: float) -> dict[str, float]:
    """Seconds per part (cumulative time of its functions), and the rest of `wall`."""
    cumulative = stats.stats  # {(file, line, name): (calls, primitive calls, own, cumulative, callers)}
    out = {}
    for part, functions in PARTS.items():
        out[part] = sum(entry[3] for (file, _, name), entry in cumulative.items()
                        for suffix, wanted in functions
                        if name == wanted and (file.endswith(suffix) if suffix else file == "~"))
    out["rest"] = wall - sum(out.values())
    out["load"] = wall
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", help="a GGUF file")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--no-profile", dest="profile", action="store_false", help="the load's wall time alone")
    args = parser.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    from llmtrace.tracer.core.dtypes import get_compute_dtype
    from llmtrace.tracer.load.loader import load_model
    from llmtrace.tracer.model import native_kernel

    native_kernel.available()  # the library found (or built) before the clock starts
    profile = cProfile.Profile()
    began = time.perf_counter()
    if args.profile:
        profile.enable()
    loaded = load_model(args.model, dtype=get_compute_dtype("auto"))
    profile.disable()
    wall = time.perf_counter() - began
    parts = split(pstats.Stats(profile), wall) if args.profile else {"load": wall}
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(f"{loaded.weight_format}")
    print(" | ".join(f"{name} {seconds:.2f} s" for name, seconds in parts.items()) + f" | peak RSS {peak / 1e9:.2f} GB")
    print(json.dumps({**parts, "peak_rss": peak}))


if __name__ == "__main__":
    main()
