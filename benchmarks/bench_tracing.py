"""What tracing costs, and how llmtrace's run compares with torch.profiler and HF transformers.

1. overhead: decode time per token on the bundled default model (greedy, 32 new tokens), traced vs untraced
   (`RunSettings(trace=False)`: no hooks), rounds interleaved, medians; the ratio is the tracing overhead.
2. profiler: one decode step (and one 12-token prefill) of the same model under our Tracer vs under
   torch.profiler(record_shapes=True, with_flops=True): wall time of the step, and what each counts (FLOPs, and
   which ops the profiler gives no FLOPs for).
3. hf: greedy decode tokens/s of HF transformers' LlamaForCausalLM loaded from the same GGUF (fp32, its own
   DynamicCache, one token per step, the same prompt and token count) vs ours, untraced and traced.

    flock /tmp/llmtrace-bench.lock .venv/bin/python -m benchmarks.bench_tracing --rounds 5 [--dtype bf16]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import torch

from llmtrace.tracer.load.loader import LoadedModel, load_model
from llmtrace.tracer.run.backends import backend_for
from llmtrace.tracer.run.generate import Finished, Generation, TokenStep
from llmtrace.tracer.run.select import Request
from llmtrace.tracer.trace.hooks import Tracer
from llmtrace.tracer.trace.records import DECODE, PREFILL, RunSettings

PROMPT = "The capital of France is"
NEW_TOKENS = 32


def decode_run(loaded: LoadedModel, trace: bool) -> tuple[list[int], float]:
    """One greedy generation: every decode step's duration (ns), and the ms spent after the last step building
    the Trace (for a traced run, that is where the stage records are made from the hooks' raw shapes)."""
    settings = RunSettings(model="", prompt=PROMPT, max_new_tokens=NEW_TOKENS, trace=trace)
    generation = Generation(loaded, settings)
    last_step = finished = 0
    result = None
    try:
        for event in generation.events():
            if isinstance(event, TokenStep):
                last_step = time.perf_counter_ns()
            elif isinstance(event, Finished):
                finished = time.perf_counter_ns()
                result = event.trace
    finally:
        generation.close()
    assert result is not None
    return [s.duration_ns for s in result.decode_steps], (finished - last_step) / 1e6


def decode_ms_per_token(loaded: LoadedModel, trace: bool) -> float:
    steps, _ = decode_run(loaded, trace)
    return statistics.median(steps) / 1e6


def bench_overhead(loaded: LoadedModel, rounds: int) -> dict[str, Any]:
    """Two views, rounds interleaved, medians over every decode step of every round.

    generation: whole greedy runs through Generation, traced (what `llmtrace run` does: the fused path, traced
    from inside) vs `trace=False` (forward + sample + detokenize per step; the traced figure adds the record
    building done after the run, spread over its decode steps).
    forward: one decode_one per step, under six set-ups: the model's default (fused when nothing watches), our
    Tracer on the fused path (its default), stage by stage (the modules backend), no-op nn.Module hooks on the 513
    stage modules, our Tracer on the stage modules with wrappers and with real hooks.
    """
    decode_run(loaded, True)  # warm-up: allocator, caches, first-call paths
    decode_run(loaded, False)
    steps: dict[bool, list[int]] = {True: [], False: []}
    build: dict[bool, list[float]] = {True: [], False: []}
    forward: dict[str, list[int]] = {mode: [] for mode in FORWARD_MODES}
    for _ in range(rounds):
        for traced in (False, True):
            durations, build_ms = decode_run(loaded, traced)
            steps[traced].extend(durations)
            build[traced].append(build_ms)
        for mode in FORWARD_MODES:
            forward[mode].extend(_forward_steps(loaded, mode))
    untraced = statistics.median(steps[False]) / 1e6
    traced_step = statistics.median(steps[True]) / 1e6
    build_per_token = (statistics.median(build[True]) - statistics.median(build[False])) / (NEW_TOKENS - 1)
    fwd = {mode: statistics.median(v) / 1e6 for mode, v in forward.items()}
    return {
        "decode_steps_per_mode": len(steps[False]),
        "generation": {
            "untraced_ms_per_token": untraced,
            "traced_ms_per_token": traced_step,
            "record_building_ms_per_token": build_per_token,
            "overhead_ratio": traced_step / untraced,
            "overhead_ratio_with_record_building": (traced_step + build_per_token) / untraced,
        },
        "forward_ms": fwd,
        "forward_vs_default": {mode: fwd[mode] / fwd["default"] for mode in FORWARD_MODES},
        "forward_vs_stage_by_stage": {mode: fwd[mode] / fwd["stage_by_stage"] for mode in FORWARD_MODES},
    }


FORWARD_MODES = ("default", "tracer_fused", "stage_by_stage", "noop_hooks", "tracer_wrap", "tracer_hooks")


def _forward_steps(loaded: LoadedModel, mode: str, n: int = 24) -> list[int]:
    """Durations (ns) of `n` decode_one calls after a 6-token prefill, under `mode`."""
    from llmtrace.tracer.trace.hooks import stage_modules

    model = loaded.model
    model.setup_cache(1, 6 + n)
    model.prefill(torch.tensor([[1, 2, 3, 4, 5, 6]]))
    token = torch.tensor([[7]])
    handles = []
    tracer = None
    if mode == "noop_hooks":
        for _, module in stage_modules(model):
            handles.append(module.register_forward_pre_hook(lambda m, a: None))
            handles.append(module.register_forward_hook(lambda m, a, o: None))
    if mode.startswith("tracer_"):
        tracer = Tracer(model, mechanism=mode.removeprefix("tracer_"))
        tracer.__enter__()
    # the run's backend once everything is attached: the stage modules for stage_by_stage, hooks and wrappers
    run = backend_for(model, Request(backend="modules" if mode == "stage_by_stage" else None))
    run = run if tracer is None else run.traced(tracer)
    out = []
    try:
        for i in range(n):
            if tracer is not None:
                tracer.begin_step(DECODE, i + 1)
            start = time.perf_counter_ns()
            run.decode(token)
            out.append(time.perf_counter_ns() - start)
            if tracer is not None:
                tracer.end_step()
    finally:
        if tracer is not None:
            tracer.remove()
        for handle in handles:
            handle.remove()
    return out


def _timed_step(loaded: LoadedModel, ids: list[int], phase: str, mode: str) -> tuple[float, dict[str, Any]]:
    """Seconds of one pass (the prefill, or the decode step after it) under `mode`, and what that mode counted."""
    from torch.profiler import ProfilerActivity, profile

    model = loaded.model
    model.setup_cache(1, len(ids) + 2)
    tokens = torch.tensor([ids]) if phase == PREFILL else torch.tensor([[ids[-1]]])
    backend = backend_for(model)
    if phase == DECODE:
        backend.prefill(torch.tensor([ids]))
    run = backend.prefill if phase == PREFILL else backend.decode
    if mode == "plain":
        start = time.perf_counter()
        run(tokens)
        return time.perf_counter() - start, {}
    if mode == "llmtrace":
        start = time.perf_counter()
        with Tracer(model) as tracer:
            traced = backend.traced(tracer)
            tracer.begin_step(phase, 0)
            (traced.prefill if phase == PREFILL else traced.decode)(tokens)
            tracer.end_step()
        records = tracer.records()
        elapsed = time.perf_counter() - start
        return elapsed, {"stages": len(records), "flops": sum(r.flops for r in records),
                         "matmul_flops": sum(r.matmul_flops for r in records),
                         "bytes": sum(r.bytes_read + r.bytes_written for r in records)}
    start = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True, with_flops=True) as prof:
        run(tokens)
    events = prof.key_averages(group_by_input_shape=True)
    elapsed = time.perf_counter() - start
    with_flops: dict[str, int] = {}
    without: set[str] = set()
    for e in events:
        if e.flops:
            with_flops[e.key] = with_flops.get(e.key, 0) + int(e.flops)
        elif e.key.startswith("aten::") and e.key not in ("aten::empty", "aten::view", "aten::as_strided"):
            without.add(e.key)
    return elapsed, {"flops": sum(with_flops.values()), "ops_with_flops": sorted(with_flops),
                     "aten_ops_without_flops": sorted(without)}


def bench_profiler(loaded: LoadedModel, rounds: int) -> dict[str, Any]:
    ids = loaded.tokenizer.encode(PROMPT + " Paris, and the capital of Italy is")
    out: dict[str, Any] = {"prompt_tokens": len(ids)}
    for phase in (PREFILL, DECODE):
        for mode in ("plain", "llmtrace", "profiler"):
            _timed_step(loaded, ids, phase, mode)  # warm-up
        times: dict[str, list[float]] = {"plain": [], "llmtrace": [], "profiler": []}
        counted: dict[str, Any] = {}
        for _ in range(rounds):
            for mode in times:
                seconds, info = _timed_step(loaded, ids, phase, mode)
                times[mode].append(seconds)
                counted[mode] = info
        out[phase] = {
            "ms": {mode: 1e3 * statistics.median(v) for mode, v in times.items()},
            "llmtrace": counted["llmtrace"],
            "profiler": counted["profiler"],
        }
    return out


def bench_hf(loaded: LoadedModel, rounds: int) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM, DynamicCache
    from transformers.utils import logging

    logging.disable_progress_bar()
    logging.set_verbosity_error()
    folder, name = loaded.source.rsplit("/", 1)
    hf = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=loaded.model.tok_embeddings.weight.dtype).eval()
    ids = loaded.tokenizer.encode(PROMPT)

    def hf_ms_per_token() -> tuple[float, list[int]]:
        cache = DynamicCache()
        tokens = torch.tensor([ids])
        steps = []
        out_ids = []
        with torch.no_grad():
            logits = hf(tokens, past_key_values=cache, use_cache=True).logits[0, -1]
            token = int(logits.argmax())
            out_ids.append(token)
            for _ in range(NEW_TOKENS - 1):
                start = time.perf_counter_ns()
                logits = hf(torch.tensor([[token]]), past_key_values=cache, use_cache=True).logits[0, -1]
                token = int(logits.argmax())
                steps.append(time.perf_counter_ns() - start)
                out_ids.append(token)
        return statistics.median(steps) / 1e6, out_ids

    hf_ms_per_token()
    decode_ms_per_token(loaded, False)
    hf_times, ours_plain, ours_traced = [], [], []
    for _ in range(rounds):
        ms, hf_ids = hf_ms_per_token()
        hf_times.append(ms)
        ours_plain.append(decode_ms_per_token(loaded, False))
        ours_traced.append(decode_ms_per_token(loaded, True))
    settings = RunSettings(model="", prompt=PROMPT, max_new_tokens=NEW_TOKENS, trace=False)
    ours_ids = list(Generation(loaded, settings).run().generated_ids)
    return {
        "hf_tok_per_s": 1e3 / statistics.median(hf_times),
        "ours_untraced_tok_per_s": 1e3 / statistics.median(ours_plain),
        "ours_traced_tok_per_s": 1e3 / statistics.median(ours_traced),
        "speedup_untraced": statistics.median(hf_times) / statistics.median(ours_plain),
        "speedup_traced": statistics.median(hf_times) / statistics.median(ours_traced),
        "same_greedy_tokens": hf_ids == ours_ids,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--only", choices=("overhead", "profiler", "hf"), action="append")
    parser.add_argument("--dtype", default="fp32", help="fp32, bf16 or auto (what `llmtrace run` uses by default)")
    args = parser.parse_args()
    from llmtrace.tracer.core.dtypes import get_compute_dtype

    loaded = load_model(None, dtype=get_compute_dtype(args.dtype))  # auto: the default table (kernel_defaults.py)
    dtype = str(next(loaded.model.parameters()).dtype).removeprefix("torch.")
    result: dict[str, Any] = {"torch": torch.__version__, "threads": torch.get_num_threads(),
                              "model": loaded.config.name, "rounds": args.rounds, "dtype": dtype}
    for name, fn in (("overhead", bench_overhead), ("profiler", bench_profiler), ("hf", bench_hf)):
        if args.only is None or name in args.only:
            result[name] = fn(loaded, args.rounds)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
