"""Decode tokens/s at the sizes users run, llmtrace trees side by side with llama.cpp on the same file (issue 31,
item 3: decode >= 1.5x llama.cpp at 7B and >= 85% of the measured bandwidth bound), rounds alternated so that a
shared machine's slow spells hit every engine.

Each round runs one child process per engine, one after another: a llmtrace child per `--tree` (a checkout of
llmtrace, imported as `llmtrace` through a folder that links to it, so that two trees' C kernels can be set beside
each other: A/B of a kernel change in one run) and a llama.cpp one (llama-cpp-python). Each child loads the file
(llmtrace: `load_model` with run's default kernels; llama.cpp: mmap, as its CLI), then `--repeats` times: the
6-token prompt "The capital of France is" and `--decode-tokens` greedy steps; its decode tokens/s are the steps
over the time from the first token to the last (llmtrace: `Generation` untraced, as `run --no-trace`, whose decode
runs ahead in C; llama.cpp: `eval` of one token a call). A child's figure is the best of its repeats; the table
gives each engine's median and range over the rounds. Before and after the rounds, benchmarks/step_stream.c streams
a LLaMA-7B Q4_0 step's bytes (bench_step_stream's llama-7b-q4_0 shape) in the step's pattern: the bandwidth bound
is its best GB/s over the bytes a step reads (the file's tensors but an untied token embedding's, of which a step
reads one row).

    /work/tools/quiet /work/tools/py -m benchmarks.bench_scale_decode --model /tmp/scale/llama-7b.Q4_0.random.gguf \\
        --tree /work/wt/scale2 --tree /tmp/h3base --rounds 3
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
PROMPT = "The capital of France is"


def child_llmtrace(path: str, threads: int, tokens: int, repeats: int) -> dict[str, float]:
    import torch

    torch.set_num_threads(threads)
    from llmtrace.tracer.core.dtypes import get_compute_dtype
    from llmtrace.tracer.load.loader import load_model
    from llmtrace.tracer.run.generate import Generation, PrefillDone, TokenStep
    from llmtrace.tracer.trace.records import RunSettings

    began = time.perf_counter()
    loaded = load_model(path, dtype=get_compute_dtype("auto"))
    load_s = time.perf_counter() - began
    rates = []
    for _ in range(repeats):
        settings = RunSettings(model=path, prompt=PROMPT, max_new_tokens=tokens + 1, dtype="auto", trace=False)
        generation = Generation(loaded, settings)
        first = last = steps = 0
        try:
            for event in generation.events():
                if isinstance(event, PrefillDone):
                    first = time.perf_counter_ns()
                elif isinstance(event, TokenStep):
                    last, steps = time.perf_counter_ns(), steps + 1
        finally:
            generation.close()
        rates.append(steps / ((last - first) / 1e9))
    return {"load_s": load_s, "decode_tok_s": max(rates), "repeats": rates, "format": loaded.weight_format}


def child_llama_cpp(path: str, threads: int, tokens: int, repeats: int) -> dict[str, float]:
    import llama_cpp
    import numpy as np

    began = time.perf_counter()
    llm = llama_cpp.Llama(model_path=path, n_ctx=256, n_threads=threads, n_threads_batch=threads, verbose=False)
    load_s = time.perf_counter() - began
    rates = []
    for _ in range(repeats):
        llm.reset()
        llm.eval(llm.tokenize(PROMPT.encode()))
        token = int(np.argmax(np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(llm.n_vocab(),))))
        first = time.perf_counter_ns()
        for _ in range(tokens):
            llm.eval([token])
            token = int(np.argmax(np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(llm.n_vocab(),))))
        rates.append(tokens / ((time.perf_counter_ns() - first) / 1e9))
    return {"load_s": load_s, "decode_tok_s": max(rates), "repeats": rates, "version": llama_cpp.__version__}


def _python() -> str:
    venv = Path("/work/main/.venv/bin/python")
    return str(REPO / ".venv" / "bin" / "python") if (REPO / ".venv" / "bin" / "python").exists() else \
        str(venv) if venv.exists() else sys.executable


def _child(kind: str, args: argparse.Namespace, tree: Path | None, links: Path) -> dict[str, float]:
    env = dict(os.environ)
    if tree is not None:
        env["PYTHONPATH"] = str(links)
    command = [_python(), str(Path(__file__).resolve()), "--child", kind, "--model", str(args.model),
               "--threads", str(args.threads), "--decode-tokens", str(args.decode_tokens), "--repeats",
               str(args.repeats)]
    done = subprocess.run(command, env=env, capture_output=True, text=True, check=False, cwd=tree or REPO)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode or not lines:
        return {"error": (done.stderr.strip().splitlines() or ["no output"])[-1]}
    return json.loads(lines[-1])


def stream_bound() -> float:
    """Best GB/s of step_stream.c over a LLaMA-7B Q4_0 step's bytes (bench_step_stream's shape), any way."""
    from benchmarks.bench_step_stream import SOURCE, STEPS

    with tempfile.TemporaryDirectory() as tmp:
        binary = Path(tmp) / "step_stream"
        subprocess.run([os.environ.get("CC", "cc"), "-O3", "-march=native", "-fopenmp", "-o", str(binary),
                        str(SOURCE)], check=True)
        done = subprocess.run([str(binary), "3", *map(str, STEPS["llama-7b-q4_0"])], capture_output=True, text=True,
                              check=True)
    print(done.stdout.strip(), flush=True)
    best = 0.0
    for line in done.stdout.splitlines():
        for part in line.split("(")[1:]:
            if "GB/s" in part:
                best = max(best, float(part.split()[0]))
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, required=True, help="a GGUF (benchmarks/scale_models.py writes them)")
    parser.add_argument("--tree", type=Path, action="append", help="a llmtrace checkout (repeat; default: this one)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=2, help="generations per child (its best counts)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--decode-tokens", type=int, default=32)
    parser.add_argument("--no-llama-cpp", dest="llama_cpp", action="store_false")
    parser.add_argument("--no-stream", dest="stream", action="store_false", help="skip the bandwidth bound")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child = child_llmtrace if args.child == "llmtrace" else child_llama_cpp
        print(json.dumps(child(str(args.model), args.threads, args.decode_tokens, args.repeats)))
        return
    sys.path.insert(0, str(REPO))
    print(f"load average before: {os.getloadavg()}", flush=True)
    bounds = [stream_bound()] if args.stream else []
    trees = args.tree or [REPO]
    results: dict[str, list[dict[str, float]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        links = []
        for i, tree in enumerate(trees):
            folder = Path(tmp) / f"tree{i}"
            folder.mkdir()
            (folder / "llmtrace").symlink_to(tree.resolve())
            links.append(folder)
        for r in range(args.rounds):
            # the trees' order reversed every other round: a round's first child meets the pages the child or the
            # stream before it left (fresh ones after llama.cpp's mapped run), so a fixed order put one tree in that
            # place every round (BENCHMARKS, issue 31, helper H4: a 2-round A/B whose first tree loaded 2x slower)
            pairs = list(zip(trees, links))
            for tree, folder in pairs if r % 2 == 0 else pairs[::-1]:
                result = _child("llmtrace", args, tree, folder)
                results.setdefault(str(tree), []).append(result)
                print(f"  {tree}: {result}", flush=True)
            if args.llama_cpp:
                result = _child("llama_cpp", args, None, Path(tmp))
                results.setdefault("llama.cpp", []).append(result)
                print(f"  llama.cpp: {result}", flush=True)
    if args.stream:
        bounds.append(stream_bound())
    step_bytes = _step_bytes(args.model)
    print(f"load average after: {os.getloadavg()}")
    bound = max(bounds) * 1e9 / step_bytes if bounds else float("nan")
    print(f"{args.model.name}: a step reads {step_bytes / 1e9:.3f} GB; bandwidth bound "
          f"{max(bounds) if bounds else float('nan'):.1f} GB/s = {bound:.2f} tok/s")
    medians = {}
    for name, rows in results.items():
        rates = [row["decode_tok_s"] for row in rows if "decode_tok_s" in row]
        if not rates:
            print(f"{name}: {rows[-1].get('error')}")
            continue
        medians[name] = statistics.median(rates)
        print(f"{name}: decode median {medians[name]:.2f} tok/s (range {min(rates):.2f}-{max(rates):.2f}, "
              f"{len(rates)} rounds), {medians[name] / bound:.0%} of the bound")
    if "llama.cpp" in medians:
        for name, value in medians.items():
            if name != "llama.cpp":
                print(f"{name} / llama.cpp: {value / medians['llama.cpp']:.2f}x")


def _step_bytes(path: Path) -> int:
    from llmtrace.tracer.checkpoint.gguf_header import read_gguf_header

    header = read_gguf_header(path)
    untied = any(t.name == "output.weight" for t in header.tensors)  # else the embedding is the LM head, read whole
    return sum(t.n_bytes for t in header.tensors if not (untied and t.name == "token_embd.weight"))


if __name__ == "__main__":
    main()
