"""Load time of the bundled default model: llmtrace cold (converted-weights cache cleared), cached, and without the
cache, against HF transformers loading the same GGUF (AutoTokenizer + AutoModelForCausalLM with gguf_file=, fp32).

Every measurement runs in a fresh Python process, so imports and first-touch costs are paid as a user pays them.
"load" is the library call (model + tokenizer ready); "first logits" adds one prefill of a 6-token prompt, which is
where memory-mapped weights are actually read; "imports" is `import torch` + the loader's modules. The OS page cache
keeps the GGUF file warm in every case (dropping it needs root and would disturb the other users of this machine).
Rounds interleave the four cases; medians are reported.

    flock /tmp/llmtrace-bench.lock .venv/bin/python -m benchmarks.bench_load --rounds 5
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

_OURS = """
import json, sys, time
t0 = time.perf_counter()
import torch
from llmtrace.tracer.core.dtypes import FP32
from llmtrace.tracer.load.loader import load_model
t1 = time.perf_counter()
loaded = load_model(None, dtype=FP32, use_cache={use_cache}, weights="dense")
t2 = time.perf_counter()
ids = loaded.tokenizer.encode("The capital of France is")
loaded.model.setup_cache(1, 16)
loaded.model.prefill(torch.tensor([ids]))
t3 = time.perf_counter()
print(json.dumps({{"imports": t1 - t0, "load": t2 - t1, "first_logits": t3 - t1, "from_cache": loaded.from_cache,
                  "reported": loaded.load_seconds, "threads": torch.get_num_threads()}}))
"""

_HF = """
import json, sys, time
t0 = time.perf_counter()
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.utils import logging
logging.disable_progress_bar()
t1 = time.perf_counter()
path = {path!r}
folder, name = path.rsplit("/", 1)
tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()
t2 = time.perf_counter()
ids = tokenizer("The capital of France is", return_tensors="pt").input_ids
with torch.no_grad():
    model(ids)
t3 = time.perf_counter()
print(json.dumps({{"imports": t1 - t0, "load": t2 - t1, "first_logits": t3 - t1, "from_cache": False,
                  "reported": t2 - t1, "threads": torch.get_num_threads()}}))
"""


def _run(code: str, env: dict[str, str]) -> dict:
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"benchmark child failed:\n{done.stderr[-3000:]}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    result["process"] = time.perf_counter() - start
    return result


def components(path: str, rounds: int) -> None:
    """The two parts llmtrace replaces, in this process: header parsing and dequantizing every tensor."""
    import gguf
    import numpy as np
    from gguf.quants import dequantize as gguf_dequantize

    from llmtrace.tracer.checkpoint.gguf_header import read_gguf_header
    from llmtrace.tracer.load.gguf_dequant import dequantize

    header = read_gguf_header(path)
    data = np.memmap(path, dtype=np.uint8, mode="r")

    def all_tensors(decode) -> float:  # noqa: ANN001 - a decoder taking (raw bytes, ggml type, row length)
        start = time.perf_counter()
        for info in header.tensors:
            begin = header.data_offset + info.offset
            decode(data[begin:begin + info.n_bytes], info.ggml_type, info.shape[0])
        return time.perf_counter() - start

    def gguf_rows(raw, kind: int, row_len: int):  # noqa: ANN001, ANN202 - gguf's call, rows as rows
        qtype = gguf.GGMLQuantizationType(kind)
        block, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
        return gguf_dequantize(raw.reshape(-1, row_len // block * block_bytes), qtype)

    def timed(fn) -> float:  # noqa: ANN001
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start

    rows = {"header + vocabulary: tracer read_gguf_header(decode_arrays=True)": [],
            "header + vocabulary: gguf.GGUFReader": [],
            "dequantize all 272 tensors: llmtrace.tracer.load.gguf_dequant": [],
            "dequantize all 272 tensors: gguf.quants.dequantize": []}
    for _ in range(rounds):
        rows["header + vocabulary: tracer read_gguf_header(decode_arrays=True)"].append(
            timed(lambda: read_gguf_header(path, decode_arrays=True)))
        rows["header + vocabulary: gguf.GGUFReader"].append(timed(lambda: gguf.GGUFReader(path)))
        rows["dequantize all 272 tensors: llmtrace.tracer.load.gguf_dequant"].append(all_tensors(dequantize))
        rows["dequantize all 272 tensors: gguf.quants.dequantize"].append(all_tensors(gguf_rows))
    print("| step | median (s) |")
    print("|---|---:|")
    for name, times in rows.items():
        print(f"| {name} | {statistics.median(times):.3f} |")
    print()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--no-hf", action="store_true", help="skip HF transformers (about 20 s a round)")
    args = parser.parse_args()

    sys.path.insert(0, str(REPO))
    from llmtrace.tracer.checkpoint.bundled import bundled_model_path

    components(str(bundled_model_path()), args.rounds)

    path = str(bundled_model_path())
    base_env = dict(os.environ, PYTHONPATH=str(REPO), HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    cases: dict[str, list[dict]] = {"llmtrace cold (cache cleared)": [], "llmtrace cached": [],
                                    "llmtrace, cache off": []}
    if not args.no_hf:
        cases["HF transformers (gguf_file=)"] = []
    for round_index in range(args.rounds):
        with tempfile.TemporaryDirectory(prefix="llmtrace-bench-cache-") as cache:
            env = dict(base_env, LLMTRACE_CACHE_DIR=cache)
            cold = _run(_OURS.format(use_cache=True), env)
            cached = _run(_OURS.format(use_cache=True), env)
            assert not cold["from_cache"] and cached["from_cache"]
            cases["llmtrace cold (cache cleared)"].append(cold)
            cases["llmtrace cached"].append(cached)
            cases["llmtrace, cache off"].append(_run(_OURS.format(use_cache=False), env))
        if not args.no_hf:
            cases["HF transformers (gguf_file=)"].append(_run(_HF.format(path=path), base_env))
        print(f"round {round_index + 1}/{args.rounds} done", file=sys.stderr)

    def median(rows: list[dict], key: str) -> float:
        return statistics.median(row[key] for row in rows)

    hf_rows = cases.get("HF transformers (gguf_file=)")
    hf_load = median(hf_rows, "load") if hf_rows else None
    print(f"Bundled model: {Path(path).name}; {args.rounds} rounds, medians; torch threads "
          f"{cases['llmtrace cached'][0]['threads']}")
    print()
    print("| case | load (s) | load to first logits (s) | imports (s) | whole process (s) | HF load / this load |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, rows in cases.items():
        load = median(rows, "load")
        ratio = f"{hf_load / load:.1f}x" if hf_load else "-"
        print(f"| {name} | {load:.2f} | {median(rows, 'first_logits'):.2f} | {median(rows, 'imports'):.2f} | "
              f"{median(rows, 'process'):.2f} | {ratio} |")
    print()
    print("raw:", json.dumps({name: [round(r["load"], 3) for r in rows] for name, rows in cases.items()}))


if __name__ == "__main__":
    main()
