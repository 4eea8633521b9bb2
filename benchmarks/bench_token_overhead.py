"""What a decode token costs outside the model step (issue 12: once the step is one C call, the rest shows).

The model is the one `llmtrace run` loads by default (the bundled SmolLM2-135M Q4_1 GGUF, the loader's measured
weights choice), or `--weights SPEC`. Views (medians per decode token, microseconds):

1. loop: whole generations through `Generation.events()` of "The capital of France is", 64 new tokens (greedy
   stops at EOS after ~30), consumed as `run` consumes them. Per token, the wall between consecutive TokenStep
   events minus the model step (`Transformer.decode_one`, timed by a wrapper) is "outside"; wrappers time its parts:
   sampling (`Sampler.sample`), detokenizing (`TextStream.add`), the candidate table's records
   (`Generation._candidate`, ten a step), the tracer's step bracket (`Tracer.begin_step`/`end_step`); "rest" is
   the remainder (the step record, the KV sizes, the token tensor, the generator's own work). With the native
   decode step, "outside the C call" is the wall minus its one ctypes call (the Python of decode_one included).
   Three runs, each decode step its own call (`Generation(run_ahead=False)`: greedy steps otherwise run ahead in C,
   several to a call, with no Python between them to take apart): greedy untraced (`run --no-trace`), greedy traced
   (the default `run`), and sampled untraced (temperature 0.7, top-p 0.9, seed 1); then the greedy two as `run`
   runs them, ahead in C, their wall per token (first to last TokenStep, mean) beside the others'.
2. sampler: `Sampler.sample` alone on the logits a greedy run produced (recorded once, replayed), per
   configuration; with `--reference`, the computation it replaced (tests/sampling_reference.py) interleaved in
   the same process, and a check that both chose the same tokens at the same ranks (every figure agrees bit for
   bit: tests/test_sampling_equality.py checks those).
3. cli: `llmtrace run PROMPT --max-new-tokens 64 --no-roofline --summary-json --json-file FILE` as a subprocess,
   `--no-trace` and traced, the console on a pipe: from the trace file, per decode step, sampling + detokenizing
   (inside the step's clock) and the gap to the next step's start (records, the event, the CLI's handling of it).

`--baseline TREE` runs views 1 and 3 on another worktree's code too (TREE/.venv/bin/python with this script),
rounds interleaved, so before and after are measured side by side:

    /work/tools/quiet .venv/bin/python -m benchmarks.bench_token_overhead --rounds 3 --baseline /work/main
    /work/tools/quiet .venv/bin/python -m benchmarks.bench_token_overhead --only sampler --reference

`--prompt-tokens N` runs the loop view on bench_vs_peers' prompt of N tokens instead (attention over a longer
cache: bench_vs_peers measures decode after a 128-token prompt).
"""

from __future__ import annotations


import argparse
import dataclasses
import inspect
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any, Callable

PROMPT = "The capital of France is"
NEW_TOKENS = 64
HERE = Path(__file__).resolve()
TREE = HERE.parents[1]
LOOP_RUNS = {
    "greedy --no-trace": dict(trace=False),
    "greedy traced": dict(trace=True),
    "t=0.7 top-p 0.9 --no-trace": dict(trace=False, temperature=0.7, top_p=0.9, seed=1),
}
# Greedy runs' decode steps run ahead in C, several to a call (Generation's run-ahead), so their TokenStep events
# come in bursts and no Python runs between two steps of a call: the views above run a step a call
# (run_ahead=False) to take the Python between steps apart, and these rows give the run-ahead's wall per token
# (the mean over the run: first to last TokenStep) beside them.
RUN_AHEAD_RUNS = {
    "greedy --no-trace, run ahead": dict(trace=False),
    "greedy traced, run ahead": dict(trace=True),
}
SAMPLER_CASES = {
    "greedy": dict(),
    "t=1": dict(temperature=1.0),
    "t=0.7 top-p 0.9": dict(temperature=0.7, top_p=0.9),
    "t=0.7 top-k 50": dict(temperature=0.7, top_k=50),
    "t=0.8 min-p 0.05 rep 1.2": dict(temperature=0.8, min_p=0.05, repetition_penalty=1.2),
}


def _us(values: list[int]) -> float:
    return round(statistics.median(values) / 1e3, 1) if values else 0.0


class _Timers:
    """Wraps methods with clocks: per key, (end, duration) in nanoseconds of every call since the last `reset()`."""

    def __init__(self) -> None:
        self.calls: dict[str, list[tuple[int, int]]] = defaultdict(list)
        self._undo: list[Callable[[], None]] = []

    def wrap(self, owner: Any, name: str, key: str) -> None:
        original = getattr(owner, name)
        calls = self.calls[key]

        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter_ns()
            try:
                return original(*args, **kwargs)
            finally:
                end = time.perf_counter_ns()
                calls.append((end, end - start))

        setattr(owner, name, timed)
        self._undo.append(lambda: setattr(owner, name, original))

    def within(self, key: str, intervals: list[tuple[int, int]]) -> list[int]:
        """Per interval (start, end), the time `key`'s calls that ended in it took together."""
        calls = self.calls.get(key, [])
        return [sum(d for e, d in calls if start < e <= end) for start, end in intervals]

    def reset(self) -> None:
        for calls in self.calls.values():
            calls.clear()

    def remove(self) -> None:
        for undo in reversed(self._undo):
            undo()


# ---- 1. the generation loop (inside one process: this tree's code or the baseline's) ------------------------------


def measure_loop(rounds: int, weights: str | None, prompt_tokens: int | None) -> dict[str, Any]:
    import torch

    from llmtrace.tracer.load.loader import load_model
    from llmtrace.tracer.run import generate
    from llmtrace.tracer.run.detokenize import TextStream
    from llmtrace.tracer.run.generate import Generation, PrefillDone, TokenStep
    from llmtrace.tracer.trace.hooks import Tracer
    from llmtrace.tracer.trace.records import RunSettings

    loaded = load_model(None, weights=weights)
    prompt = PROMPT
    if prompt_tokens is not None:  # bench_vs_peers' prompt: attention over a longer KV cache
        from benchmarks.bench_vs_peers import prompt_of

        prompt, _ = prompt_of(loaded.tokenizer, prompt_tokens)
    timers = _Timers()
    timers.wrap(loaded.model, "decode_one", "model step")
    timers.wrap(TextStream, "add", "detokenize")
    timers.wrap(generate.Generation, "_candidate", "candidate records")
    timers.wrap(Tracer, "begin_step", "tracer step bracket")
    timers.wrap(Tracer, "end_step", "tracer step bracket")
    parts = ("model step", "sampling", "detokenize", "candidate records", "tracer step bracket")
    result: dict[str, Any] = {"weights": loaded.weight_format, "threads": torch.get_num_threads()}
    # a step a call where greedy steps could run ahead (a baseline tree from before has no such option)
    step_a_call = {"run_ahead": False} if "run_ahead" in inspect.signature(Generation).parameters else {}
    try:
        for name, options in LOOP_RUNS.items():
            per_round: list[dict[str, float]] = []
            for _ in range(rounds + 1):  # the first is a warm-up
                settings = RunSettings(model="", prompt=prompt, max_new_tokens=NEW_TOKENS, **options)
                generation = Generation(loaded, settings, **step_a_call)
                timers.wrap(generation.sampler, "sample", "sampling")
                timers.reset()
                events: list[int] = []  # when each TokenStep reached the consumer
                try:
                    for event in generation.events():
                        if isinstance(event, TokenStep):
                            events.append(time.perf_counter_ns())
                        elif isinstance(event, PrefillDone):
                            _time_native_call(generation._untraced, timers)
                finally:
                    generation.close()
                intervals = list(zip(events, events[1:]))  # one decode token each
                row: dict[str, float] = {"tokens": len(intervals), "wall": _us([b - a for a, b in intervals])}
                spent = {part: timers.within(part, intervals) for part in parts}
                outside = [b - a - m for (a, b), m in zip(intervals, spent["model step"])]
                row["outside"] = _us(outside)
                native = timers.within("C call", intervals)
                if any(native):  # the native decode step: everything but the one C call it makes
                    row["C call"] = _us(native)
                    row["outside the C call"] = _us([b - a - c for (a, b), c in zip(intervals, native)])
                row.update({part: _us(spent[part]) for part in parts})
                row["rest"] = _us([o - sum(spent[p][i] for p in parts[1:]) for i, o in enumerate(outside)])
                per_round.append(row)
            result[name] = {key: statistics.median(r[key] for r in per_round[1:]) for key in per_round[1]}
    finally:
        timers.remove()
    if step_a_call:  # a tree whose greedy steps can run ahead
        for name, options in RUN_AHEAD_RUNS.items():
            walls = []
            for _ in range(rounds + 1):
                settings = RunSettings(model="", prompt=prompt, max_new_tokens=NEW_TOKENS, **options)
                generation = Generation(loaded, settings)
                events = []
                try:
                    events = [time.perf_counter_ns() for e in generation.events() if isinstance(e, TokenStep)]
                finally:
                    generation.close()
                walls.append((events[-1] - events[0]) / (len(events) - 1) / 1e3)
            result[name] = {"tokens": len(events) - 1, "wall": statistics.median(walls[1:])}
    return result


def _time_native_call(backend: Any, timers: _Timers) -> None:
    """Time the ctypes call of this generation's native decode step (its backend made a new one), if it has one."""
    plan = getattr(backend, "plan", None)
    native = getattr(plan, "native", None)
    if native is not None and "C call" not in getattr(native, "_timed", ()):
        timers.wrap(native, "_step", "C call")
        native._timed = ("C call",)


# ---- 2. the sampler alone -------------------------------------------------------------------------------------


def measure_sampler(rounds: int, weights: str | None, reference: bool) -> dict[str, Any]:
    import torch

    from llmtrace.tracer.load.loader import load_model
    from llmtrace.tracer.run.generate import Generation
    from llmtrace.tracer.run.sampling import Sampler, SamplingParams
    from llmtrace.tracer.trace.records import RunSettings

    loaded = load_model(None, weights=weights)
    model, recorded = loaded.model, []
    decode_one = model.decode_one

    def record(tokens: Any) -> Any:
        logits = decode_one(tokens)
        recorded.append(logits[0].clone())
        return logits

    model.decode_one = record
    generation = Generation(loaded, RunSettings(model="", prompt=PROMPT, max_new_tokens=NEW_TOKENS, trace=False))
    try:
        trace = generation.run()
    finally:
        generation.close()
        del model.decode_one
    ids = list(trace.tokenization.ids) + list(trace.generated_ids)
    calls = [(logits, ids[: len(trace.tokenization.ids) + i]) for i, logits in enumerate(recorded)]
    makers: dict[str, Any] = {"this": Sampler}
    if reference:
        sys.path.insert(0, str(TREE / "tests"))
        from sampling_reference import ReferenceSampler

        makers["reference"] = ReferenceSampler
    result: dict[str, Any] = {"logits": len(calls), "vocab": int(recorded[0].numel())}
    for name, case in SAMPLER_CASES.items():
        times: dict[str, list[int]] = {maker: [] for maker in makers}
        same = True
        for _ in range(rounds):
            params = SamplingParams(seed=1, **case)  # the reference takes them as a plain dict
            samplers = {maker: make(params if maker == "this" else dataclasses.asdict(params))
                        for maker, make in makers.items()}
            for logits, previous in calls:
                results = {}
                for maker, sampler in samplers.items():
                    start = time.perf_counter_ns()
                    results[maker] = sampler.sample(logits, previous)
                    times[maker].append(time.perf_counter_ns() - start)
                picks = {(r["token_id"], r["rank"]) if isinstance(r, dict) else (r.token_id, r.rank)
                         for r in results.values()}  # the reference's results are dicts
                same = same and len(picks) == 1
        result[name] = {maker: _us(t) for maker, t in times.items()}
        if reference:
            result[name]["same tokens"] = same
    return result


# ---- 3. the CLI as a subprocess ---------------------------------------------------------------------------------


def measure_cli(python: str, traced: bool, weights: str | None) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as folder:
        trace_file = Path(folder) / "trace.json"
        command = [python, "-m", "llmtrace", "run", PROMPT, "--max-new-tokens", str(NEW_TOKENS), "--no-roofline",
                   "--summary-json", "--json-file", str(trace_file)] + ([] if traced else ["--no-trace"])
        command += ["--weights", weights] if weights else []
        done = subprocess.run(command, capture_output=True, text=True, check=True,
                              env=dict(os.environ, COLUMNS="100", LINES="40"))
        trace = json.loads(trace_file.read_text())
    steps = [s for s in trace["steps"] if s["phase"] == "decode"]
    gaps = [b["start_ns"] - (a["start_ns"] + a["duration_ns"]) for a, b in zip(steps, steps[1:])]
    return {
        "decode_tokens_per_second": json.loads(done.stdout.strip().splitlines()[-1])["decode_tokens_per_second"],
        "tokens": len(steps),
        "forward": _us([s["forward_ns"] for s in steps]),
        "sample": _us([s["sample_ns"] for s in steps]),
        "detokenize": _us([s["detokenize_ns"] for s in steps]),
        "gap to next step": _us(gaps),
    }


# ---- driver ----------------------------------------------------------------------------------------------------


def _child(tree: Path, rounds: int, weights: str | None, prompt_tokens: int | None) -> dict[str, Any]:
    command = [str(tree / ".venv" / "bin" / "python"), "-m", "benchmarks.bench_token_overhead", "--child",
               "--rounds", str(rounds)]
    command += ["--weights", weights] if weights else []
    command += ["--prompt-tokens", str(prompt_tokens)] if prompt_tokens else []
    done = subprocess.run(command, capture_output=True, text=True, check=True, cwd=str(tree))
    return json.loads(done.stdout.strip().splitlines()[-1])


def _medians(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in rounds[0].items():
        if isinstance(value, dict):
            out[key] = _medians([r[key] for r in rounds])
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            out[key] = statistics.median(r[key] for r in rounds)
        else:
            out[key] = value
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--baseline", type=Path, help="another worktree (with its own .venv) measured alongside")
    parser.add_argument("--only", choices=("loop", "sampler", "cli"), help="one view only (default: all)")
    parser.add_argument("--reference", action="store_true", help="sampler view: time the replaced computation too")
    parser.add_argument("--weights", help="as `run --weights` (default: the loader's measured choice)")
    parser.add_argument("--prompt-tokens", type=int,
                        help="loop view: a prompt of this many tokens, bench_vs_peers' (default: the short PROMPT)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure_loop(args.rounds, args.weights, args.prompt_tokens)))
        return
    import torch

    torch.set_num_threads(min(2, torch.get_num_threads()))
    trees = {"this": TREE}
    if args.baseline is not None:
        trees["baseline"] = args.baseline.resolve()
    result: dict[str, Any] = {"load_average_before": os.getloadavg()}
    if args.only in (None, "loop"):
        loops: dict[str, list[dict[str, Any]]] = {name: [] for name in trees}
        for _ in range(args.rounds):
            for name, tree in trees.items():
                loops[name].append(_child(tree, 1, args.weights, args.prompt_tokens))
        result["loop"] = {name: _medians(r) for name, r in loops.items()}
    if args.only in (None, "sampler"):
        result["sampler"] = measure_sampler(args.rounds, args.weights, args.reference)
    if args.only in (None, "cli"):
        runs: dict[str, list[dict[str, float]]] = defaultdict(list)
        for _ in range(args.rounds):
            for name, tree in trees.items():
                for traced in (False, True):
                    runs[f"{name} {'traced' if traced else '--no-trace'}"].append(
                        measure_cli(str(tree / ".venv" / "bin" / "python"), traced, args.weights))
        result["cli"] = {name: _medians(r) for name, r in runs.items()}
    result["load_average_after"] = os.getloadavg()
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
