"""What issue 27's reads cost at load time: two llmtrace trees side by side (before and after), the same GGUFs.

Before issue 27 a GGUF's tensors were read through a copy-on-write memory map and the cache key hashed the file by
path; after it, every tensor is pread through one descriptor into private memory, the conversion pass hashes the
whole file as it reads (the key from what was read), and the cache entry's checksum is read with read() over the
whole entry. Cases, each in a fresh process (imports excluded; `load_model` alone is timed), page cache warm:
- dense fp32, cold: the conversion and the store (the weights cache cleared before);
- dense fp32, cached: a hit (the checksum pass over the entry);
- stored as the file holds it (`--weights native`, and `i8dot`): read into the weight arena, never cached;
Rounds alternate the two trees case by case.

The bigger model is a random GGUF written once (Q8_0, dim 2048, ffn 5632, 8 layers: ~440 MB, 1.7 GB in fp32).

    /work/tools/quiet /work/main/.venv/bin/python -m benchmarks.bench_disk_trust \\
        --before /tmp/dt-old-pkgs --after /work/wt/disktrust-pkgs --rounds 3

`--before`/`--after` are folders holding an `llmtrace` package (a checkout's `-pkgs` link folder).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

_CHILD = """
import json, sys, time
import torch
from llmtrace.tracer.core.dtypes import FP32
from llmtrace.tracer.load.loader import load_model
path, weights = sys.argv[1], sys.argv[2]
t0 = time.perf_counter()
loaded = load_model(path, dtype=FP32, weights=weights)
t1 = time.perf_counter()
print(json.dumps({"load": t1 - t0, "from_cache": loaded.from_cache}))
"""


def _big_gguf(folder: Path) -> Path:
    """A random Q8_0 LLaMA GGUF with the tests' SentencePiece vocabulary (written with the tests' writer)."""
    sys.path.insert(0, str(REPO / "tests"))
    import gguf
    import torch
    from tiny_gguf import sentencepiece_vocab, write_tiny_gguf
    from tiny_llama import train_sentencepiece

    from llmtrace.tracer.core.config import ModelConfig
    from llmtrace.tracer.core.contract import expected_shapes

    sp = train_sentencepiece()
    vocab = sentencepiece_vocab(sp)
    config = ModelConfig(name="bench-big", vocab_size=len(vocab["tokens"]), dim=2048, n_layers=8, n_heads=16,
                         n_kv_heads=16, ffn_dim=5632, max_seq_len=2048, tie_embeddings=False)
    generator = torch.Generator().manual_seed(0)
    state = {name: torch.randn(shape, generator=generator) * 0.02 for name, shape in expected_shapes(config).items()}
    return write_tiny_gguf(folder / "big.gguf", config, state, vocab=vocab,
                           matrix_type=gguf.GGMLQuantizationType.Q8_0)


def _run(pkgs: str, cache: Path, path: Path, weights: str) -> dict:
    env = dict(os.environ, PYTHONPATH=pkgs, LLMTRACE_CACHE_DIR=str(cache), XDG_CONFIG_HOME=str(cache / "config"))
    done = subprocess.run([sys.executable, "-c", _CHILD, str(path), weights], env=env, capture_output=True,
                          text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"benchmark child failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", required=True)
    parser.add_argument("--after", required=True)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    sys.path.insert(0, args.after)
    from llmtrace.tracer.checkpoint.bundled import bundled_model_path

    print("load average before:", os.getloadavg())
    with tempfile.TemporaryDirectory(prefix="llmtrace-bench-disk-") as tmp:
        work = Path(tmp)
        models = {"bundled (Q4_1+Q8_0, 98 MB)": bundled_model_path(), "random Q8_0 (dim 2048, 8 layers)":
                  _big_gguf(work)}
        print(f"big GGUF: {models['random Q8_0 (dim 2048, 8 layers)'].stat().st_size / 1e6:.0f} MB",
              file=sys.stderr)
        trees = {"before": args.before, "after": args.after}
        caches = {name: work / f"cache-{name}" for name in trees}
        rows: dict[tuple[str, str, str], list[dict]] = {}
        for round_index in range(args.rounds):
            for model, path in models.items():
                for case, weights in (("dense fp32, cold", "dense"), ("dense fp32, cached", "dense"),
                                      ("stored native", "native"), ("stored i8dot", "i8dot")):
                    for tree, pkgs in trees.items():
                        if case.endswith("cold"):
                            shutil.rmtree(caches[tree] / "weights", ignore_errors=True)
                        result = _run(pkgs, caches[tree], path, weights)
                        assert result["from_cache"] == case.endswith("cached"), (tree, model, case, result)
                        rows.setdefault((model, case, tree), []).append(result)
            print(f"round {round_index + 1}/{args.rounds} done", file=sys.stderr)
    print("load average after:", os.getloadavg())
    print(f"{args.rounds} rounds, medians; load_model alone, page cache warm")
    print()
    print("| model | case | before (s) | after (s) | after / before |")
    print("|---|---|---:|---:|---:|")
    for model in models:
        for case in ("dense fp32, cold", "dense fp32, cached", "stored native", "stored i8dot"):
            before, after = rows[model, case, "before"], rows[model, case, "after"]
            b, a = (statistics.median(r["load"] for r in x) for x in (before, after))
            print(f"| {model} | {case} | {b:.3f} | {a:.3f} | {a / b:.2f}x |")
    print()
    print("raw:", json.dumps({" / ".join(k): [round(r["load"], 3) for r in v] for k, v in rows.items()}))


if __name__ == "__main__":
    started = time.time()
    main()
    print(f"took {time.time() - started:.0f} s", file=sys.stderr)
