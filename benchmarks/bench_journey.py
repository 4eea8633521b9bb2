"""What the journey's optional views cost when on (BENCHMARKS.md, "Journey views"), on the bundled default model,
greedy, prompt "The capital of France is", rounds interleaved, medians:

- decode forward ms per token of a plain run (fused path), of --staged, of --lens, --attention and both (they run
  stage by stage: their hooks watch the stage modules), and the views' own time per step (instrument_ns, after
  each step's clocks: in no step or stage time);
- the sampling lesson (on by default: --temperatures 0.1,1,2) on the prefill's logits;
- --no-kv-cache: the replay's time against the cached run's forwards;
- the HTML report of a --lens --attention --no-kv-cache trace (matplotlib, inline SVG).

    flock /tmp/llmtrace-bench.lock .venv/bin/python -m benchmarks.bench_journey --rounds 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import replace
from typing import Any

import torch

from llmtrace.tracer.load.loader import load_model
from llmtrace.tracer.run.generate import generate
from llmtrace.tracer.run.sampling_lesson import sampling_lesson
from llmtrace.tracer.trace.records import RunSettings

PROMPT = "The capital of France is"
NEW_TOKENS = 16
MODES = {
    "plain (fused)": {},
    "--staged": {"staged": True},
    "--lens": {"lens": True},
    "--attention": {"attention": True},
    "--lens --attention": {"lens": True, "attention": True},
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=NEW_TOKENS)
    args = parser.parse_args()
    loaded = load_model(None)
    base = RunSettings(model="", prompt=PROMPT, max_new_tokens=args.new_tokens, temperatures=())
    forward: dict[str, list[float]] = {m: [] for m in MODES}
    lens_ms: list[float] = []
    attention_ms: list[float] = []
    for round_ in range(args.rounds):
        for mode, changes in MODES.items():
            print(f"round {round_ + 1}: {mode}", file=sys.stderr, flush=True)
            trace = generate(loaded, replace(base, **changes))
            forward[mode] += [s.forward_ns / 1e6 for s in trace.decode_steps]
            if mode == "--lens":
                lens_ms += [s.instrument_ns / 1e6 for s in trace.lens]
            if mode == "--attention":
                attention_ms += [s.instrument_ns / 1e6 for s in trace.attention]
    plain = statistics.median(forward["plain (fused)"])
    results: dict[str, Any] = {
        "cpu": _cpu(), "torch": torch.__version__, "threads": torch.get_num_threads(), "rounds": args.rounds,
        "dtype": str(next(loaded.model.parameters()).dtype).removeprefix("torch."),
        "new_tokens": args.new_tokens,
        "decode_forward_ms": {m: round(statistics.median(v), 2) for m, v in forward.items()},
        "decode_forward_vs_plain": {m: round(statistics.median(v) / plain, 2) for m, v in forward.items()},
        "lens_ms_per_step": round(statistics.median(lens_ms), 2),
        "attention_ms_per_step": round(statistics.median(attention_ms), 2),
    }
    results["lesson_ms"] = round(_lesson_ms(loaded, base), 2)
    full = generate(loaded, replace(base, lens=True, attention=True, no_kv_cache=True))
    run = full.no_kv_cache
    results["no_kv_cache"] = {"cached_forward_s": round(run.cached_forward_ns / 1e9, 3),
                              "replay_s": round(run.forward_ns / 1e9, 3), "time_ratio": round(run.time_ratio, 2),
                              "flops_ratio": round(run.flops_ratio, 2)}
    from llmtrace.cli.render_html import html_report

    times = []
    for _ in range(args.rounds):
        start = time.perf_counter()
        page = html_report(full)
        times.append(time.perf_counter() - start)
    results["html_report_s"] = round(statistics.median(times), 3)
    results["html_report_bytes"] = len(page.encode("utf-8"))
    print(json.dumps(results, indent=2, ensure_ascii=False))


def _lesson_ms(loaded: Any, settings: RunSettings) -> float:
    """The default lesson (T = 0.1, 1, 2 with the illustrative filters) on the prompt's real logits."""
    ids = loaded.tokenizer.encode(PROMPT)
    model = loaded.model
    model.setup_cache(1, len(ids))
    logits = model.prefill(torch.tensor([ids]))[0]
    lesson_settings = replace(settings, temperatures=(0.1, 1.0, 2.0))
    times = []
    for _ in range(21):
        start = time.perf_counter()
        sampling_lesson(logits, ids, lesson_settings, loaded.tokenizer.piece)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def _cpu() -> str:
    with open("/proc/cpuinfo", encoding="utf-8") as f:
        return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "?")


if __name__ == "__main__":
    main()
