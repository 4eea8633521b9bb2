"""How big a long run's trace files are, and how long they take to write: whole, gzip, and --trace-steps.

One greedy generation of --new-tokens tokens (EOS ignored) on the bundled default model (traced, fused path), then, rounds
interleaved, the medians of: Trace.to_json(indent=1) (what `run --json` writes) and the Chrome trace, each written
plain, as .gz, and after `--trace-steps first,last,every:64` pruning; bytes on disk and write time (serialise,
compress, write, rename: cli.output_files.write_output, as `run` calls it).

    flock /tmp/llmtrace-bench.lock .venv/bin/python -m benchmarks.bench_trace_files --new-tokens 256 --rounds 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable

from llmtrace.cli.output_files import write_output
from llmtrace.tracer.load.loader import load_model
from llmtrace.tracer.run.generate import generate
from llmtrace.tracer.trace.chrome import chrome_trace
from llmtrace.tracer.trace.records import RunSettings
from llmtrace.tracer.trace.run_trace import Trace
from llmtrace.tracer.trace.step_selection import StepSelection, prune_steps

PROMPT = "Write a long story about a lighthouse keeper who finds a map in a bottle."
PRUNE = "first,last,every:64"


class _WithoutEos:
    """The model's tokenizer with no end-of-sequence id, so generation runs to max_new_tokens."""

    eos_id = None

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer

    def __getattr__(self, name: str) -> Any:
        return getattr(self._tokenizer, name)


def _variants(trace: Trace) -> dict[str, Callable[[], str]]:
    pruned = prune_steps(trace, StepSelection.parse(PRUNE))
    return {
        "trace JSON": lambda: trace.to_json(indent=1),
        f"trace JSON, --trace-steps {PRUNE}": lambda: pruned.to_json(indent=1),
        "Chrome trace": lambda: json.dumps(chrome_trace(trace), ensure_ascii=False),
        f"Chrome trace, --trace-steps {PRUNE}": lambda: json.dumps(chrome_trace(pruned), ensure_ascii=False),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    loaded = load_model(None)
    # EOS ignored, as llama-bench does for its fixed n_gen: the run always has --new-tokens tokens.
    loaded = replace(loaded, tokenizer=_WithoutEos(loaded.tokenizer))
    start = time.perf_counter()
    trace = generate(loaded, RunSettings(model="", prompt=PROMPT, max_new_tokens=args.new_tokens))
    print(f"generated {len(trace.generated_ids)} tokens ({len(trace.stages)} stage records) in "
          f"{time.perf_counter() - start:.1f} s; stop: {trace.stop_reason}")
    times: dict[tuple[str, str], list[float]] = {}
    sizes: dict[tuple[str, str], int] = {}
    with tempfile.TemporaryDirectory() as folder:
        for _ in range(args.rounds):
            for name, serialise in _variants(trace).items():
                for suffix in (".json", ".json.gz"):
                    path = Path(folder) / f"out{suffix}"
                    t0 = time.perf_counter()
                    write_output(path, serialise())
                    times.setdefault((name, suffix), []).append(time.perf_counter() - t0)
                    sizes[(name, suffix)] = path.stat().st_size
    print(f"{'file':<48} {'suffix':<9} {'bytes':>12} {'write s':>8}")
    for (name, suffix), seconds in times.items():
        print(f"{name:<48} {suffix:<9} {sizes[(name, suffix)]:>12,} {statistics.median(seconds):>8.2f}")


if __name__ == "__main__":
    main()
