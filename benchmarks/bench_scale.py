"""llmtrace and llama.cpp at the sizes users run (LLaMA 1B, 7B and 8B shapes), on the same file, same threads, in
one run: load time, time to first token, prefill tokens/s at 128 and 512 prompt tokens, decode tokens/s, peak RSS,
and the first run of `llmtrace run` on a fresh cache against a later one and against llama.cpp's load + generate.

The files: random-weight GGUFs with the real shapes and llama.cpp's tensor types (benchmarks/scale_models.py),
written into `--dir` once and reused by later runs (a 7B Q4_0 is 3.8 GB, Q8_0 7.2 GB: check the disk first).

Every measurement runs in its own subprocess, one at a time (a 7B model is a third of a 24 GB machine), and its
peak RSS is the kernel's ru_maxrss of that child (os.wait4): resident pages at their highest, file-backed mapped
pages included, which is what the issue's budget counts.
- `engine` children: llmtrace loads the file as `run` does (`load_model(file, --dtype auto, --weights W)`, W the
  option given here, else run's default) and runs `Generation` with run's default settings (traced, warm-up pass
  included); llama.cpp (llama-cpp-python) loads with mmap as its CLI does and `eval`s the same token ids. Each
  child: load (wall time of the load call), TTFT (a 6-token prompt, "The capital of France is", from the call to the
  first token), a 128-token prompt and `--decode-tokens` greedy steps (prefill tokens / prefill time; decode steps /
  the time from the first token to the last), then a 512-token prompt (prefill only).
- `first run`: `llmtrace run --model FILE "The capital of France is" --max-new-tokens 16` as a user types it:
  once in a fresh cache and config folder (nothing compiled, converted or saved yet: the C library is compiled
  during it); then `--first-run-rounds` rounds, each in fresh folders, of set-up's build of the C library (`make
  run` builds it: native_kernel.prepare(), "set-up build"), the first run after it, a later run in the same
  folders, and llama.cpp's counterpart: a process that imports llama_cpp, loads the file and generates the same 16
  tokens. Wall time (median over the rounds) and peak RSS of each process. `--no-engines` measures only these.
- The memory budget (issue 31, item 2): the file's bytes + the KV cache `run` allocates (fp32, the run's positions)
  + 1.5 GB, beside each llmtrace peak.
- The bandwidth bound: the file's tensor bytes (what a decode step reads, as llama.cpp does) over this machine's best
  measured bandwidth (bench_vs_peers.best_bandwidth, measured before and after the engines), as decode tokens/s.

    /work/tools/quiet .venv/bin/python -m benchmarks.bench_scale --dir /tmp/scale_models \
        --models llama-7b:Q4_0,llama-7b:Q4_K_M,llama-8b:Q4_K_M --json /tmp/bench_scale.json

llama-cpp-python is a benchmark-only dependency (`pip install -e .[bench]`); without it the llama.cpp columns say
so and the rest still runs.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
SHORT_PROMPT = "The capital of France is"
FIRST_RUN_TOKENS = 16
BUDGET_SLACK = 1.5e9  # issue 31's fixed overhead beyond the file and the KV cache


# ---- children: one engine, one file -----------------------------------------------------------------------------


def _prompts(tokenizer: Any) -> dict[int, tuple[str, list[int]]]:
    sys.path.insert(0, str(REPO))
    from benchmarks.bench_vs_peers import prompt_of

    return {n: prompt_of(tokenizer, n) for n in (128, 512)}


def child_llmtrace(path: str, threads: int, decode_tokens: int, weights: str | None, dtype: str) -> dict[str, Any]:
    import torch

    torch.set_num_threads(threads)
    from llmtrace.tracer.core.dtypes import get_compute_dtype
    from llmtrace.tracer.load.loader import load_model
    from llmtrace.tracer.run.generate import Generation, PrefillDone, TokenStep
    from llmtrace.tracer.trace.records import RunSettings

    start = time.perf_counter()
    loaded = load_model(path, dtype=get_compute_dtype(dtype), weights=weights)
    load_s = time.perf_counter() - start
    prompts = _prompts(loaded.tokenizer)

    def generate(text: str, new_tokens: int) -> dict[str, float]:
        settings = RunSettings(model=path, prompt=text, max_new_tokens=new_tokens, dtype=dtype)
        began = time.perf_counter_ns()
        generation = Generation(loaded, settings)
        first = last = prefill_ns = tokens_in = 0
        steps = 0
        stages: dict[str, float] = {}
        try:
            for event in generation.events():
                if isinstance(event, PrefillDone):
                    first = time.perf_counter_ns()
                    prefill_ns, tokens_in = event.step.forward_ns, event.step.input_tokens
                    for stage in event.stages:  # where the prefill's time went, by stage summed over the layers
                        role = stage.stage.split(".", 2)[-1] if stage.layer is not None else stage.stage
                        stages[role] = stages.get(role, 0.0) + stage.duration_ns / 1e9
                elif isinstance(event, TokenStep):
                    last, steps = time.perf_counter_ns(), steps + 1
        finally:
            generation.close()
        return {"ttft_s": (first - began) / 1e9, "prefill_tok_s": tokens_in / (prefill_ns / 1e9),
                "prompt_tokens": tokens_in, "prefill_s": prefill_ns / 1e9,
                "prefill_stages_s": dict(sorted(stages.items(), key=lambda kv: -kv[1])),
                "decode_tok_s": steps / ((last - first) / 1e9) if steps else float("nan")}

    short = generate(SHORT_PROMPT, 1)
    p128 = generate(prompts[128][0], decode_tokens)
    p512 = generate(prompts[512][0], 1)
    return {"load_s": load_s, "ttft_s": short["ttft_s"], "ttft_tokens": short["prompt_tokens"],
            "prefill128_tok_s": p128["prefill_tok_s"], "prompt128_tokens": p128["prompt_tokens"],
            "prefill128_stages_s": p128["prefill_stages_s"], "prefill512_stages_s": p512["prefill_stages_s"],
            "decode_tok_s": p128["decode_tok_s"], "prefill512_tok_s": p512["prefill_tok_s"],
            "prompt512_tokens": p512["prompt_tokens"], "weights": loaded.weights.kernel or loaded.weights.mode,
            "format": loaded.weight_format, "kv_dtype": str(loaded.model.norm.weight.dtype).removeprefix("torch.")}


def child_llama_cpp(path: str, threads: int, decode_tokens: int, ids_file: str) -> dict[str, Any]:
    import llama_cpp
    import numpy as np

    ids = json.loads(Path(ids_file).read_text())
    start = time.perf_counter()
    llm = llama_cpp.Llama(model_path=path, n_ctx=1024, n_batch=512, n_ubatch=512, n_threads=threads,
                          n_threads_batch=threads, logits_all=False, verbose=False)
    load_s = time.perf_counter() - start

    def last_logits() -> Any:
        return np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(llm.n_vocab(),))

    def generate(prompt: list[int], new_tokens: int) -> dict[str, float]:
        llm.reset()
        began = time.perf_counter()
        llm.eval(prompt)
        token = int(np.argmax(last_logits()))
        first = time.perf_counter()
        for _ in range(new_tokens - 1):
            llm.eval([token])
            token = int(np.argmax(last_logits()))
        done = time.perf_counter()
        return {"ttft_s": first - began, "prefill_tok_s": len(prompt) / (first - began),
                "decode_tok_s": (new_tokens - 1) / (done - first) if new_tokens > 1 else float("nan")}

    short = generate(llm.tokenize(SHORT_PROMPT.encode()), 1)
    p128 = generate(ids["128"], decode_tokens + 1)  # the prefill's token, then decode_tokens steps as llmtrace
    p512 = generate(ids["512"], 1)
    return {"load_s": load_s, "ttft_s": short["ttft_s"], "prefill128_tok_s": p128["prefill_tok_s"],
            "decode_tok_s": p128["decode_tok_s"], "prefill512_tok_s": p512["prefill_tok_s"],
            "version": llama_cpp.__version__}


def child_llama_cpp_first(path: str, threads: int) -> dict[str, Any]:
    """llama.cpp's counterpart of a first `llmtrace run`: import, load, generate FIRST_RUN_TOKENS greedily."""
    import llama_cpp

    llm = llama_cpp.Llama(model_path=path, n_ctx=256, n_threads=threads, n_threads_batch=threads, verbose=False)
    llm.create_completion(SHORT_PROMPT, max_tokens=FIRST_RUN_TOKENS, temperature=0.0)
    return {}


# ---- the parent: subprocesses, RSS, the table ---------------------------------------------------------------------


def _python() -> str:
    return str(REPO / ".venv" / "bin" / "python") if (REPO / ".venv" / "bin" / "python").exists() else sys.executable


def _run(argv: list[str], env: dict[str, str] | None = None, timeout: float = 1800) -> tuple[float, int, str, str]:
    """(wall seconds, peak RSS bytes, stdout, stderr) of one child process."""
    start = time.perf_counter()
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        proc = subprocess.Popen(argv, stdout=out, stderr=err, env=env, cwd=REPO)
        deadline = start + timeout
        while True:
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                break
            if time.perf_counter() > deadline:
                proc.kill()
                pid, status, usage = os.wait4(proc.pid, 0)
                break
            time.sleep(0.05)
        wall = time.perf_counter() - start
        proc.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read().decode(errors="replace"), err.read().decode(errors="replace")
    if proc.returncode != 0:
        stderr = f"exit {proc.returncode}: {stderr.strip().splitlines()[-1] if stderr.strip() else ''}"
    return wall, usage.ru_maxrss * 1024, stdout, stderr


def _child(kind: str, *args: str) -> tuple[dict[str, Any] | None, int, str]:
    wall, rss, out, err = _run([_python(), "-m", "benchmarks.bench_scale", "--child", kind, *args])
    lines = [line for line in out.splitlines() if line.startswith("{")]
    if not lines:
        return None, rss, err.strip()[-300:]
    return json.loads(lines[-1]), rss, ""


def first_runs(path: Path, threads: int, weights: str | None, dtype: str, rounds: int,
               llama_cpp: bool) -> dict[str, Any]:
    """`llmtrace run` as a user types it, `rounds` times, each round in fresh cache and config folders: set-up's
    build of the C library (`make run` calls native_kernel.prepare(): "set-up build"), the first run after it
    ("first after set-up"), the same again in those folders ("later"), then llama.cpp's import, load and generate
    ("llama.cpp"); and once, in other fresh folders, a first run with nothing built ("first": the library is
    compiled during it). Each label: the median wall of its runs, every wall, the largest peak RSS."""
    argv = [_python(), "-m", "llmtrace", "run", "--model", str(path), SHORT_PROMPT, "--max-new-tokens",
            str(FIRST_RUN_TOKENS), "--threads", str(threads), "--no-roofline"]
    if weights:
        argv += ["--weights", weights]
    if dtype != "auto":
        argv += ["--dtype", dtype]
    prepare = [_python(), "-c", "from llmtrace.tracer.model.native_kernel import prepare; print(prepare())"]
    theirs = [_python(), "-m", "benchmarks.bench_scale", "--child", "llama_cpp_first", str(path), str(threads)]
    plan = [(("first", argv),)]
    for _ in range(rounds):
        plan.append((("set-up build", prepare), ("first after set-up", argv), ("later", argv)))
        if llama_cpp:
            plan.append((("llama.cpp", theirs),))
    runs: dict[str, list[tuple[float, int, str]]] = {}
    for steps in plan:
        with tempfile.TemporaryDirectory(prefix="bench_scale_home_") as home:
            env = {**os.environ, "XDG_CACHE_HOME": f"{home}/cache", "XDG_CONFIG_HOME": f"{home}/config",
                   "COLUMNS": "100"}
            for name in ("LLMTRACE_CACHE_DIR", "LLMTRACE_NATIVE_DIR"):
                env.pop(name, None)
            for label, command in steps:
                wall, rss, _, err = _run(command, env)
                runs.setdefault(label, []).append((wall, rss, err if err.startswith("exit") else ""))
    return {label: {"wall_s": statistics.median(w for w, _, _ in done), "walls": [w for w, _, _ in done],
                    "peak_rss": max(r for _, r, _ in done), "error": "; ".join(e for _, _, e in done if e)}
            for label, done in runs.items()}


def _gib(n: float) -> str:
    return f"{n / 1e9:.2f}"


def measure(path: Path, args: argparse.Namespace) -> dict[str, Any]:
    from llmtrace.tracer.analytic.kvmem import kv_cache_bytes
    from llmtrace.tracer.checkpoint.gguf_header import read_gguf_header
    from llmtrace.tracer.checkpoint.resolve import resolve_model
    from llmtrace.tracer.core.dtypes import FP32

    header = read_gguf_header(path)
    config = resolve_model(str(path)).config
    file_bytes = path.stat().st_size
    tensor_bytes = sum(t.n_bytes for t in header.tensors)
    common = [str(path), str(args.threads), str(args.decode_tokens)]
    result: dict[str, Any] = {"file": path.name, "file_bytes": file_bytes, "tensor_bytes": tensor_bytes}
    if args.engines:
        ours, rss, err = _child("llmtrace", *common, args.weights or "", args.dtype)
        print(f"  llmtrace: {_line(ours, rss, err)}", flush=True)
        result["llmtrace"] = {**(ours or {"error": err}), "peak_rss": rss}
    if args.llama_cpp and args.engines:
        ids_file = Path(tempfile.mkstemp(suffix=".json")[1])
        ids_file.write_text(json.dumps(_ids_of(path, args)))
        theirs, rss, err = _child("llama_cpp", *common, str(ids_file))
        result["llama.cpp"] = {**(theirs or {"error": err}), "peak_rss": rss}
        print(f"  llama.cpp: {_line(theirs, rss, err)}", flush=True)
        ids_file.unlink()
    positions = 512 + 1  # the engine child's largest cache
    result["budget"] = {"measure": file_bytes + kv_cache_bytes(config, positions, FP32) + BUDGET_SLACK,
                        "first_run": file_bytes + kv_cache_bytes(config, 8 + FIRST_RUN_TOKENS, FP32) + BUDGET_SLACK}
    if args.first_run:
        result["first_run"] = first_runs(path, args.threads, args.weights, args.dtype, args.first_run_rounds,
                                         args.llama_cpp)
        print(f"  first runs: {result['first_run']}", flush=True)
    return result


def _line(result: dict[str, Any] | None, rss: int, err: str) -> str:
    if result is None:
        return f"failed ({err}), peak {rss / 1e9:.2f} GB"
    keys = ("load_s", "ttft_s", "prefill128_tok_s", "prefill512_tok_s", "decode_tok_s")
    return ", ".join(f"{k} {result[k]:.2f}" for k in keys if k in result) + f", peak {rss / 1e9:.2f} GB"


def _ids_of(path: Path, args: argparse.Namespace) -> dict[str, list[int]]:
    """The 128- and 512-token prompts' ids as llmtrace tokenizes them (llama.cpp is fed these ids)."""
    from llmtrace.tracer.checkpoint.gguf_header import read_gguf_header
    from llmtrace.tracer.checkpoint.gguf_tokenizer import tokenizer_from_gguf

    prompts = _prompts(tokenizer_from_gguf(read_gguf_header(path, decode_arrays=True)))
    return {str(n): ids for n, (_, ids) in prompts.items()}


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def report(results: list[dict[str, Any]], bandwidth: float, args: argparse.Namespace) -> str:
    lines = [f"bench_scale · {_cpu_name()} · {os.cpu_count()} CPUs · {args.threads} threads · best bandwidth "
             f"{bandwidth / 1e9:.1f} GB/s · weights {args.weights or 'run default'} · dtype {args.dtype}"]
    head = (f"{'file':<26} {'engine':<9} {'load s':>7} {'TTFT s':>7} {'pp128':>7} {'pp512':>7} {'tg':>6} "
            f"{'peak GB':>8} {'budget':>7}")
    lines += [head, "-" * len(head)]
    for r in results:
        for engine in ("llmtrace", "llama.cpp"):
            e = r.get(engine)
            if e is None:
                continue
            if "error" in e:
                lines.append(f"{r['file']:<26} {engine:<9} {e['error'][:70]}")
                continue
            budget = _gib(r["budget"]["measure"]) if engine == "llmtrace" else ""
            lines.append(f"{r['file']:<26} {engine:<9} {e['load_s']:>7.2f} {e['ttft_s']:>7.2f} "
                         f"{e['prefill128_tok_s']:>7.2f} {e['prefill512_tok_s']:>7.2f} {e['decode_tok_s']:>6.2f} "
                         f"{_gib(e['peak_rss']):>8} {budget:>7}")
        ours, theirs = r.get("llmtrace", {}), r.get("llama.cpp", {})
        bound = bandwidth / r["tensor_bytes"]
        if "decode_tok_s" in ours:
            ratio = [f"decode {ours['decode_tok_s'] / bound:.0%} of the bandwidth bound ({bound:.2f} tok/s)"]
            if "decode_tok_s" in theirs:
                ratio += [f"vs llama.cpp: decode {ours['decode_tok_s'] / theirs['decode_tok_s']:.2f}x, prefill128 "
                          f"{ours['prefill128_tok_s'] / theirs['prefill128_tok_s']:.2f}x, prefill512 "
                          f"{ours['prefill512_tok_s'] / theirs['prefill512_tok_s']:.2f}x, load "
                          f"{ours['load_s'] / theirs['load_s']:.2f}x"]
            lines.append("  " + "; ".join(ratio) + f" ({ours.get('weights')}, kv {ours.get('kv_dtype')})")
            top = list(ours.get("prefill128_stages_s", {}).items())[:6]
            lines.append("  prefill 128 by stage (s, summed over layers): "
                         + ", ".join(f"{name} {seconds:.2f}" for name, seconds in top))
        first = r.get("first_run")
        if first:
            parts = [f"{k} {v['wall_s']:.1f} s ({', '.join(f'{w:.1f}' for w in v['walls'])}) / "
                     f"{_gib(v['peak_rss'])} GB" + (f" ({v['error']})" if v["error"] else "") for k, v in first.items()]
            lines.append(f"  run as typed: {'; '.join(parts)} (budget {_gib(r['budget']['first_run'])} GB)")
            if "llama.cpp" in first and not first["llama.cpp"]["error"]:
                lines.append("  / llama.cpp load + generate: " + ", ".join(
                    f"{label} {first[label]['wall_s'] / first['llama.cpp']['wall_s']:.2f}x"
                    for label in ("first", "later", "first after set-up") if label in first))
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("rest", nargs="*", help=argparse.SUPPRESS)
    parser.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()) / "llmtrace_scale_models",
                        help="where the random GGUFs are written and reused")
    parser.add_argument("--models", default="llama-7b:Q4_0,llama-7b:Q4_K_M,llama-8b:Q4_K_M",
                        help="shape:mix pairs (shapes llama-1b, llama-7b, llama-8b, llama-13b; mixes Q4_0, Q4_K_M, "
                             "Q8_0)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--decode-tokens", type=int, default=32)
    parser.add_argument("--weights", default=None, help="llmtrace's --weights (default: run's default)")
    parser.add_argument("--dtype", default="auto", help="llmtrace's --dtype (default: run's default, auto)")
    parser.add_argument("--no-llama-cpp", dest="llama_cpp", action="store_false")
    parser.add_argument("--no-first-run", dest="first_run", action="store_false")
    parser.add_argument("--first-run-rounds", type=int, default=1,
                        help="rounds of set-up, first run after it, later run and llama.cpp's (medians)")
    parser.add_argument("--no-engines", dest="engines", action="store_false",
                        help="only the first runs (no load/prefill/decode children)")
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args()
    if args.child == "llmtrace":
        path, threads, decode, weights, dtype = args.rest
        print(json.dumps(child_llmtrace(path, int(threads), int(decode), weights or None, dtype)))
        return
    if args.child == "llama_cpp":
        path, threads, decode, ids_file = args.rest
        print(json.dumps(child_llama_cpp(path, int(threads), int(decode), ids_file)))
        return
    if args.child == "llama_cpp_first":
        path, threads = args.rest
        print(json.dumps(child_llama_cpp_first(path, int(threads))))
        return

    from benchmarks.bench_vs_peers import best_bandwidth
    from benchmarks.scale_models import MIXES, SHAPES, ensure

    if args.llama_cpp:
        try:
            import llama_cpp  # noqa: F401
        except ImportError:
            print("llama-cpp-python is not installed (pip install -e .[bench]): llmtrace only")
            args.llama_cpp = False
    pairs = [tuple(item.split(":")) for item in args.models.split(",")]
    for shape, mix in pairs:
        if shape not in SHAPES or mix not in MIXES:
            parser.error(f"unknown model {shape}:{mix}; shapes {', '.join(SHAPES)}, mixes {', '.join(MIXES)}")
    bandwidths = [max(best_bandwidth().values())]
    results = []
    for shape, mix in pairs:
        path = ensure(args.dir, shape, mix)
        print(f"measuring {path.name} ...", flush=True)
        results.append(measure(path, args))
        if args.json:  # what is measured so far, should a later model fail or the run be stopped
            args.json.write_text(json.dumps({"cpu": _cpu_name(), "threads": args.threads, "weights": args.weights,
                                             "partial": True, "results": results}, indent=1))
    bandwidths.append(max(best_bandwidth().values()))
    text = report(results, max(bandwidths), args)
    print(text)
    if args.json:
        args.json.write_text(json.dumps({"cpu": _cpu_name(), "threads": args.threads, "weights": args.weights,
                                         "bandwidth_bytes_per_s": max(bandwidths), "results": results,
                                         "report": text}, indent=1))


if __name__ == "__main__":
    main()
