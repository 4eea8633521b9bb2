"""Decode speed of a mixture of experts: llmtrace's stage modules, its native C step, and llama.cpp, on one file.

The file: benchmarks/scale_models.py's mixtral-small (a Mixtral-shaped 'llama' GGUF: dim 1024, 4 layers, 8 experts of
FFN 2816, 2 a token, F32 routers, random weights; Q4_0 208 MB), written into `--dir` once. Each measurement is its
own process (one engine loaded at a time), the engines alternated round by round, and the figure is the median over
`--rounds`: decode tokens/s = (steps - 1) / the time from the first decoded token to the last, after a 6-token prompt,
greedy; and each llmtrace process's peak resident size over its size before the load (VmHWM - VmRSS: the weights
held, the KV cache, the run's buffers). llmtrace runs `Generation` as `run` does, with its default kernels (the experts as stored: i8dot for Q4_0),
asked for the modules backend or the default one (prefill on the modules, one-token steps on the C step), traced or
not (--no-trace); llama.cpp (llama-cpp-python) `eval`s token by token with the same threads.

    /work/tools/quiet .venv/bin/python -m benchmarks.bench_moe --dir /tmp/moe --rounds 3

llama-cpp-python is a benchmark-only dependency; without it that column says so.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
PROMPT = "The capital of France is"
WAYS = ("modules traced", "modules untraced", "native traced", "native untraced", "llama.cpp")


def _status_bytes(key: str) -> int:
    """A /proc/self/status figure (VmRSS, VmHWM) in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    return 0


def child_llmtrace(path: str, threads: int, steps: int, backend: str, trace: bool) -> dict[str, Any]:
    import torch

    torch.set_num_threads(threads)
    before = _status_bytes("VmRSS")
    from llmtrace.tracer.load.loader import load_model
    from llmtrace.tracer.run.generate import Finished, Generation, PrefillDone, TokenStep
    from llmtrace.tracer.trace.records import RunSettings

    loaded = load_model(path)
    settings = RunSettings(model=path, prompt=PROMPT, max_new_tokens=steps, temperatures=(), trace=trace)
    generation = Generation(loaded, settings, backend=None if backend == "native" else backend)
    first = last = count = 0
    ids, route = [], None
    try:
        for event in generation.events():
            if isinstance(event, PrefillDone):
                first = time.perf_counter_ns()
                ids.append(event.step.token_id)
            elif isinstance(event, TokenStep):
                last, count = time.perf_counter_ns(), count + 1
                ids.append(event.step.token_id)
            elif isinstance(event, Finished):
                route = event.trace.route
    finally:
        generation.close()
    return {"decode_tok_s": count / ((last - first) / 1e9), "ids": ids, "route": f"{route.prefill}/{route.decode}",
            "weights": loaded.weights.kernel or loaded.weights.mode,
            "peak_rss_over_start_mb": (_status_bytes("VmHWM") - before) / 1e6}


def child_llama_cpp(path: str, threads: int, steps: int) -> dict[str, Any]:
    import llama_cpp
    import numpy as np

    llm = llama_cpp.Llama(model_path=path, n_ctx=256, n_threads=threads, n_threads_batch=threads, verbose=False)

    def argmax() -> int:
        return int(np.argmax(np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(llm.n_vocab(),))))

    llm.eval(llm.tokenize(PROMPT.encode()))
    ids = [argmax()]
    first = time.perf_counter_ns()
    for _ in range(steps - 1):
        llm.eval([ids[-1]])
        ids.append(argmax())
    last = time.perf_counter_ns()
    return {"decode_tok_s": (steps - 1) / ((last - first) / 1e9), "ids": ids, "version": llama_cpp.__version__}


def _child(args: list[str]) -> dict[str, Any]:
    done = subprocess.run([sys.executable, "-m", "benchmarks.bench_moe", "--child", *args], capture_output=True,
                          text=True, cwd=REPO, check=False)
    if done.returncode != 0:
        return {"error": done.stderr.strip().splitlines()[-1] if done.stderr.strip() else f"exit {done.returncode}"}
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", type=Path, default=Path("/tmp/moe"))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--child", nargs="+")
    args = parser.parse_args()
    if args.child:
        kind, path, threads, steps, *rest = args.child
        out = (child_llama_cpp(path, int(threads), int(steps)) if kind == "llama_cpp" else
               child_llmtrace(path, int(threads), int(steps), rest[0], rest[1] == "traced"))
        print(json.dumps(out))
        return
    sys.path.insert(0, str(REPO))
    from benchmarks.scale_models import ensure

    path = str(ensure(args.dir, "mixtral-small", "Q4_0"))
    common = [path, str(args.threads), str(args.steps)]
    runs: dict[str, list[dict[str, Any]]] = {way: [] for way in WAYS}
    for round_ in range(args.rounds):
        for way in WAYS:
            if way == "llama.cpp":
                runs[way].append(_child(["llama_cpp", *common]))
            else:
                backend, traced = way.split()
                runs[way].append(_child(["llmtrace", *common, backend, traced]))
            print(f"round {round_ + 1} {way}: {runs[way][-1].get('decode_tok_s', runs[way][-1].get('error'))}",
                  file=sys.stderr)
    summary = {}
    for way, results in runs.items():
        speeds = [r["decode_tok_s"] for r in results if "decode_tok_s" in r]
        summary[way] = {"median_tok_s": statistics.median(speeds) if speeds else None,
                        "each": [round(s, 1) for s in speeds],
                        **{k: v for k, v in results[-1].items()
                           if k in ("route", "weights", "version", "error", "peak_rss_over_start_mb")}}
    ids = {way: results[-1].get("ids") for way, results in runs.items()}
    summary["same ids (llmtrace ways)"] = len({json.dumps(v) for w, v in ids.items() if w != "llama.cpp"}) == 1
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
