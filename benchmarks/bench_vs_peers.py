"""llmtrace against its peers on one machine, in one run: the default `llmtrace run` (untraced, traced, and traced
stage by stage; `--weights auto` and `--dtype auto`, measured afresh), each stored kernel and `--weights dense`
explicitly (untraced), HF transformers holding the same weights (fp32, fp16 and bf16; its fastest is the
reference), and llama.cpp (llama-cpp-python) running the bundled GGUF as stored. Issue 12's targets are computed
from the result.

Every engine gets the same torch/ggml threads (`--threads`, 2 by default), the same 128 prompt token ids (the prompt
text is tokenized by llmtrace, and those ids are fed to HF and llama.cpp) and the same number of greedy decode steps.
Rounds interleave the engines (a shared machine's slow spells then hit all of them); medians are reported.

- llmtrace: `load_model(None, AUTO)` and `Generation` with `run`'s default settings (its warm-up pass included, as
  `run` does), only the prompt and `max_new_tokens` set. Prefill: prompt tokens / the prefill's forward time (the
  trace's, what `run` prints). Decode: decode steps / the wall time from the PrefillDone event to the last TokenStep
  event, so everything between the steps counts (records, the generator), as the peers' loops count theirs. The
  untraced default also runs with `run_ahead=False` (every decode step its own C call, as before greedy steps ran
  ahead in C), for the run-ahead's effect side by side.
  The explicit rows load `weights=<kernel>` / `weights="dense"` with `--dtype auto` for each of EXTRA_WEIGHTS the
  default does not already run (the exact "blocks" reference kernel, ~30x slower, is not among them).
- Greedy ids: every row's are compared with HF fp32's (the dense fp32 reference). A kernel that rounds to bf16
  (int4pack) may part from them after some tokens: the report says at which token each row parts, never fails.
- HF transformers: LlamaForCausalLM with llmtrace's dequantized weights cast to each dtype; a forward loop with a
  DynamicCache, `logits_to_keep=1` in the prefill, greedy argmax (benchmarks/bench_model_speed.py's loop).
- llama.cpp: `Llama.eval` on the ids (one batch for the prefill), argmax of the last logits per decode step.
- The bandwidth bound: the bytes the traced llmtrace decode step read (weights as they are read: stored bytes when
  stored, activations, KV; the trace's records) over this machine's best measured bandwidth (a 256 MiB STREAM copy and a 256 MiB read-only sum, the
  faster of the two), and the same for llama.cpp with the GGUF's tensor bytes. The bandwidth is measured after every
  round (best of 3 each): on a shared VM it swings by up to 1.8x within minutes (35 and 62 GB/s in two runs ten
  minutes apart) while the decode rate does not, so the ratio is given twice, against the run's best bandwidth (the
  strict figure) and round by round against the bandwidth measured beside it (median).

llama-cpp-python is a benchmark-only dependency (`pip install -e .[bench]`; it builds llama.cpp from source, about
4 minutes on 2 cores); without it the llama.cpp rows say so and the rest still runs.

    /work/tools/quiet .venv/bin/python -m benchmarks.bench_vs_peers --rounds 3
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path
from typing import Any, Callable

import torch

from llmtrace.tracer.core.dtypes import AUTO, FP32, DType

PROMPT_TOKENS = 128
DECODE_TOKENS = 64
EXTRA_WEIGHTS = ("native", "i8dot", "int4pack", "dense")  # --weights rows beside the default (README "Default kernels")
SOURCE_TEXT = ("story", "sky", "code", "capital")  # sample prompts, concatenated until the prompt is long enough

Timing = tuple[float, float, list[int]]  # (prefill tokens/s, decode tokens/s, greedy ids)


def prompt_of(tokenizer: Any, tokens: int) -> tuple[str, list[int]]:
    """A prompt text (from the sample prompts) that llmtrace tokenizes into exactly `tokens` ids where one exists,
    and its ids: the first `tokens` ids of a longer text, decoded, when they encode back to themselves; else the
    longest run of whole words within `tokens`."""
    from importlib import resources

    words: list[str] = []
    while len(words) < 4 * tokens:
        for name in SOURCE_TEXT:
            words += (resources.files("llmtrace.sample_prompts") / f"{name}.txt").read_text("utf-8").split()
    fallback = ""
    for count in range(1, len(words) + 1):
        text = " ".join(words[:count])
        ids = list(tokenizer.encode(text))
        if len(ids) < tokens:
            fallback = text
            continue
        cut = tokenizer.decode(ids[:tokens])
        if list(tokenizer.encode(cut)) == ids[:tokens]:
            return cut, ids[:tokens]
        if len(ids) > tokens + 8:
            break
    return fallback, list(tokenizer.encode(fallback))


# ---- llmtrace -------------------------------------------------------------------------------------------------


def timed_generation(loaded: Any, settings: Any, run_ahead: bool = True) -> tuple[float, Any]:
    """One Generation of `settings` on `loaded`, run to the end: (decode tok/s from the first token after prefill to
    the last, by the wall clock) and its trace."""
    from llmtrace.tracer.run.generate import Finished, Generation, PrefillDone, TokenStep

    generation = Generation(loaded, settings, run_ahead=run_ahead)
    prefilled = last = steps = 0
    try:
        for event in generation.events():
            if isinstance(event, PrefillDone):
                prefilled = time.perf_counter_ns()
            elif isinstance(event, TokenStep):
                last, steps = time.perf_counter_ns(), steps + 1
            elif isinstance(event, Finished):
                result = event.trace
    finally:
        generation.close()
    return steps / ((last - prefilled) / 1e9), result


def time_llmtrace(loaded: Any, text: str, trace: bool, staged: bool, new_tokens: int,
                  run_ahead: bool = True, temperature: float = 0.0) -> tuple[Timing, Any]:
    """One `run` with default settings (warm-up included; `temperature` > 0: drawn with seed 1); (prefill tok/s,
    decode tok/s, ids) and its summary."""
    from llmtrace.tracer.trace.records import RunSettings
    from llmtrace.tracer.trace.summary import run_summary

    settings = RunSettings(model="", prompt=text, max_new_tokens=new_tokens, dtype="auto", trace=trace, staged=staged,
                           temperature=temperature, seed=1 if temperature > 0 else None)
    decode_rate, result = timed_generation(loaded, settings, run_ahead)
    summary = run_summary(result)
    pre = summary.prefill
    ids = [s.token_id for s in result.steps]
    return (pre.tokens_in / (pre.forward_ns / 1e9), decode_rate, ids), summary


# ---- HF transformers ------------------------------------------------------------------------------------------


def hf_models(dtypes: tuple[DType, ...]) -> dict[str, tuple[Any, Any]]:
    """LlamaForCausalLM per dtype, holding llmtrace's dequantized fp32 weights of the bundled GGUF cast to it."""
    from benchmarks.bench_model_speed import hf_model
    from llmtrace.tracer.hardware.dtype_policy import torch_dtype
    from llmtrace.tracer.load.loader import load_model

    reference = load_model(None, dtype=FP32, weights="dense").model  # HF holds dense tensors
    models = {}
    for dtype in dtypes:
        ours = reference.to(torch_dtype(dtype)) if dtype is not FP32 else reference
        models[dtype.name] = hf_model(ours)
        reference = reference.float()
    return models


def time_hf(hf: Any, hf_config: Any, ids: list[int], new_tokens: int) -> Timing:
    from benchmarks.bench_model_speed import hf_greedy

    prefill, decode, generated = hf_greedy(hf, hf_config, torch.tensor([ids]), new_tokens - 1)
    return len(ids) / prefill, (new_tokens - 1) / decode, generated


# ---- llama.cpp ------------------------------------------------------------------------------------------------


def llama_cpp_model(path: Path, threads: int, context: int) -> Any:
    import llama_cpp

    return llama_cpp.Llama(model_path=str(path), n_ctx=context, n_batch=512, n_ubatch=512, n_threads=threads,
                           n_threads_batch=threads, logits_all=False, verbose=False)


def time_llama_cpp(llm: Any, ids: list[int], new_tokens: int) -> Timing:
    import numpy as np

    def last_logits() -> Any:  # Llama.eval no longer copies them (its sampler reads them in C): read the context's
        return np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(llm.n_vocab(),))

    llm.reset()
    start = time.perf_counter()
    llm.eval(ids)
    token = int(np.argmax(last_logits()))
    prefill = time.perf_counter() - start
    generated = [token]
    start = time.perf_counter()
    for _ in range(new_tokens - 1):
        llm.eval([token])
        token = int(np.argmax(last_logits()))
        generated.append(token)
    decode = time.perf_counter() - start
    return len(ids) / prefill, (new_tokens - 1) / decode, generated


def gguf_tensor_bytes(path: Path) -> int:
    """Bytes of every tensor the GGUF stores: what llama.cpp reads per decode step (the LM head reads the tied
    embedding in full; the embedding lookup itself reads one row, which the sum over-counts by a negligible 0.2%
    when the head is untied)."""
    from llmtrace.tracer.checkpoint.gguf_header import read_gguf_header

    header = read_gguf_header(path)
    return sum(t.n_bytes for t in header.tensors)


# ---- bandwidth ------------------------------------------------------------------------------------------------


def best_bandwidth(repeats: int = 5, buffer_bytes: int = 256 * 2**20) -> dict[str, float]:
    """Bytes/s of a STREAM copy (read + written counted) and of a read-only sum, each the best of `repeats`."""
    from llmtrace.tracer.hardware.measure import measure_copy

    copy = measure_copy("cpu", buffer_bytes, repeats).bytes_per_s
    values = torch.ones(buffer_bytes // 4)
    values.sum()  # first touch
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        values.sum()
        seconds.append(time.perf_counter() - start)
    return {"copy_bytes_per_s": copy, "read_bytes_per_s": buffer_bytes / min(seconds)}


# ---- the run --------------------------------------------------------------------------------------------------


def median(values: list[float]) -> float:
    return statistics.median(values)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--decode-tokens", type=int, default=DECODE_TOKENS)
    parser.add_argument("--hf-dtypes", default="fp32,fp16,bf16", help="HF transformers' dtypes (fp32 is the ids' "
                                                                        "reference and always runs)")
    parser.add_argument("--json", action="store_true", help="print the results as JSON too")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from llmtrace.tracer.checkpoint.bundled import bundled_model_path
    from llmtrace.tracer.core.dtypes import COMPUTE_DTYPES, get_dtype
    from llmtrace.tracer.load.loader import load_model

    loaded = load_model(None, dtype=AUTO)  # what `llmtrace run` loads by default
    text, ids = prompt_of(loaded.tokenizer, PROMPT_TOKENS)
    new = args.decode_tokens
    gguf = bundled_model_path()
    cases: dict[str, Callable[[], Timing]] = {}
    summaries: dict[str, Any] = {}

    def ours(model: Any, name: str, trace: bool, staged: bool, run_ahead: bool = True) -> Callable[[], Timing]:
        def run() -> Timing:
            timing, summaries[name] = time_llmtrace(model, text, trace, staged, new, run_ahead)
            return timing
        return run

    default = f"llmtrace default [{describe(loaded)}]"
    cases[f"{default} --no-trace"] = ours(loaded, "untraced", False, False)
    cases[f"{default} --no-trace, a step a call"] = ours(loaded, "untraced, a step a call", False, False, False)
    cases[f"{default} traced"] = ours(loaded, "traced", True, False)
    cases[f"{default} --staged traced"] = ours(loaded, "staged", True, True)
    for flag in EXTRA_WEIGHTS:
        if flag in (loaded.weights.kernel, loaded.weights.mode):
            continue  # the default rows run it
        other = load_model(None, dtype=AUTO, weights=flag)
        cases[f"llmtrace --weights {flag} [{describe(other)}] --no-trace"] = ours(other, flag, False, False)
    hf_dtypes = tuple(get_dtype(d, COMPUTE_DTYPES) for d in args.hf_dtypes.split(","))
    if FP32 not in hf_dtypes:
        hf_dtypes = (FP32, *hf_dtypes)
    for dtype, (hf, hf_config) in hf_models(hf_dtypes).items():
        cases[f"HF transformers {dtype}"] = (lambda hf=hf, hf_config=hf_config: time_hf(hf, hf_config, ids, new))
    llama_note = ""
    try:
        llm = llama_cpp_model(gguf, args.threads, len(ids) + new + 8)
        cases[LLAMA] = lambda: time_llama_cpp(llm, ids, new)
        import llama_cpp

        llama_note = f"llama-cpp-python {llama_cpp.__version__}"
    except ImportError:
        llama_note = "llama-cpp-python not installed (pip install -e .[bench]): no llama.cpp rows"

    for run in cases.values():  # warm-up round: page faults, allocator growth, oneDNN/ggml set-up
        run()
    results: dict[str, list[Timing]] = {name: [] for name in cases}
    per_round: list[dict[str, float]] = []  # the bandwidth after each round: this VM's swings by 1.8x within minutes
    for _ in range(args.rounds):
        for name, run in cases.items():
            results[name].append(run())
        per_round.append(best_bandwidth(repeats=3))
    bandwidth = {key: max(r[key] for r in per_round) for key in per_round[0]}
    report(args, loaded, default, ids, gguf, results, summaries, bandwidth, llama_note, per_round)


LLAMA = "llama.cpp (GGUF as stored)"


def describe(loaded: Any) -> str:
    """"stored int4pack, fp32" / "dense fp16": what a loaded model multiplies with."""
    dtype = str(loaded.model.norm.weight.dtype).removeprefix("torch.").replace("float", "fp")
    return f"{loaded.weights.mode}{' ' + loaded.weights.kernel if loaded.weights.kernel else ''}, {dtype}"


def parts_at(ids: list[int], reference: list[int]) -> str:
    """"same" or "parts at token N" (0-based: the first generated token that differs)."""
    for index, (a, b) in enumerate(zip(ids, reference)):
        if a != b:
            return f"parts at token {index}"
    return "same" if len(ids) == len(reference) else f"length {len(ids)} vs {len(reference)}"


def report(args: Any, loaded: Any, default: str, ids: list[int], gguf: Path, results: dict[str, list[Timing]],
           summaries: dict[str, Any], bandwidth: dict[str, float], llama_note: str,
           per_round: list[dict[str, float]]) -> None:
    rows = {name: {"prefill_tok_per_s": median([t[0] for t in timings]),
                   "decode_tok_per_s": median([t[1] for t in timings]),
                   "decode_rounds": [round(t[1], 1) for t in timings],
                   "ids": timings[-1][2]} for name, timings in results.items()}
    hf_names = [n for n in rows if n.startswith("HF")]
    hf_best = max(hf_names, key=lambda n: rows[n]["decode_tok_per_s"])
    llama = rows.get(LLAMA)
    untraced = rows[f"{default} --no-trace"]
    traced = summaries["traced"]
    bytes_per_step = traced.decode.bytes_read_per_step
    weight_bytes_per_step = traced.decode.totals.weight_bytes_read / max(traced.decode.steps, 1)
    best_bw = max(bandwidth.values())
    bound_tps = best_bw / bytes_per_step
    gguf_bytes = gguf_tensor_bytes(gguf)
    with open("/proc/loadavg", encoding="ascii") as fh:
        load = " ".join(fh.read().split()[:3])
    print(f"CPU: {_cpu_name()}; torch {torch.__version__}; threads {args.threads}; load average {load}")
    print(f"model: {loaded.source} ({loaded.weight_format}); prompt {len(ids)} tokens, {args.decode_tokens} greedy "
          f"tokens, {args.rounds} rounds, medians; {llama_note}")
    kernels = getattr(loaded, "kernels", None)
    if kernels is not None:
        print(f"default kernels: {kernels.picked} ({kernels.rule}); numerics: {kernels.numerics}")
    reference = rows["HF transformers fp32"]["ids"]
    width = max(len(n) for n in rows)
    print(f"| {'engine':{width}} | prefill tok/s | decode tok/s | decode rounds | greedy ids vs HF fp32 |")
    print(f"|{'-' * (width + 2)}|--------------:|-------------:|---------------|-----------------------|")
    for name, row in rows.items():
        print(f"| {name:{width}} | {row['prefill_tok_per_s']:>13.0f} | {row['decode_tok_per_s']:>12.1f} | "
              f"{' '.join(str(r) for r in row['decode_rounds']):13} | {parts_at(row['ids'], reference):21} |")
    print(f"bandwidth: copy {bandwidth['copy_bytes_per_s'] / 1e9:.1f} GB/s, read {bandwidth['read_bytes_per_s'] / 1e9:.1f}"
          f" GB/s; the default reads {bytes_per_step / 1e6:.1f} MB per decode step ({weight_bytes_per_step / 1e6:.1f} MB "
          f"weights, as held): bound {bound_tps:.1f} tok/s; the GGUF's tensors are {gguf_bytes / 1e6:.1f} MB: bound "
          f"{best_bw / gguf_bytes:.1f} tok/s")
    round_bw = [max(r.values()) for r in per_round]
    paired = [t[1] / (bw / bytes_per_step) for t, bw in zip(results[f"{default} --no-trace"], round_bw)]
    print(f"bandwidth after each round: {' '.join(f'{bw / 1e9:.1f}' for bw in round_bw)} GB/s (the bound above: the "
          f"run's best); the default's decode over the bound of its own round: "
          f"{' '.join(f'{r:.2f}' for r in paired)}, median {median(paired):.2f}")
    print("targets (issue 12, item 4), for the default run:")
    checks = []  # (label, value, limit, higher is better)
    if llama is not None:
        checks.append(("decode vs llama.cpp (>= 1.0x, stretch 1.3x)",
                       untraced["decode_tok_per_s"] / llama["decode_tok_per_s"], 1.0, True))
    checks.append((f"decode vs HF's fastest, {hf_best} (>= 1.5x)",
                   untraced["decode_tok_per_s"] / rows[hf_best]["decode_tok_per_s"], 1.5, True))
    checks.append(("decode / bandwidth bound for the bytes read, the run's best bandwidth (>= 0.70)",
                   untraced["decode_tok_per_s"] / bound_tps, 0.7, True))
    checks.append(("decode / bandwidth bound, each round's own bandwidth, median (>= 0.70)", median(paired), 0.7, True))
    if llama is not None:
        checks.append(("128-token prefill vs llama.cpp (>= 1.0x)",
                       untraced["prefill_tok_per_s"] / llama["prefill_tok_per_s"], 1.0, True))
    checks.append(("tracing overhead, untraced / traced decode (<= 1.10x)",
                   untraced["decode_tok_per_s"] / rows[f"{default} traced"]["decode_tok_per_s"], 1.10, False))
    checks.append(("--staged traced decode vs untraced default (<= 1.5x)",
                   untraced["decode_tok_per_s"] / rows[f"{default} --staged traced"]["decode_tok_per_s"], 1.5, False))
    print("| target | measured | met |")
    print("|---|---:|---|")
    for label, value, limit, higher in checks:
        met = value >= limit if higher else value <= limit
        print(f"| {label} | {value:.2f} | {'yes' if met else 'no'} |")
    if args.json:
        print(json.dumps({"rows": {n: {k: v for k, v in r.items() if k != "ids"} | {
                              "ids_vs_hf_fp32": parts_at(r["ids"], reference)} for n, r in rows.items()},
                          "bandwidth": bandwidth, "bandwidth_per_round": per_round, "bytes_per_decode_step": bytes_per_step,
                          "gguf_tensor_bytes": gguf_bytes, "load_average": load,
                          "targets": {label: value for label, value, _, _ in checks}}, indent=1))


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


if __name__ == "__main__":
    main()
