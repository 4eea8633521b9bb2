"""Every view of `llmtrace run` on one large file (issue 31, item 2: "every view at 7B"), each as a user types it:
peak RSS (the child's ru_maxrss, file-backed mapped pages included) and wall time, beside the memory budget (the
file's bytes + the KV cache `run` allocates for the run's positions in fp32 + 1.5 GB; `--batch 4` counts four
sequences' caches; `--tp 2`'s ranks are processes of their own: Linux's wait4 reports the largest of the child and
the descendants it waited for, so `--tp 2`'s figure is its largest single process, one rank's).

Views: the default run, `--staged`, `--lens`, `--attention`, `--html FILE`, `--batch 4`, `--no-kv-cache`, `--tp 2`
and `--dry-run`, each `--max-new-tokens 8 --threads 2 --no-roofline` on the prompt "The capital of France is",
one after another (a 7B view is a sixth of a 24 GB machine), in one config and cache folder already set up (the
C library built: the first run's compile is bench_scale's subject, not this one's).

    /work/tools/quiet /work/tools/py -m benchmarks.bench_scale_views --model /tmp/scale/llama-7b.Q4_0.random.gguf
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PROMPT = "The capital of France is"
NEW_TOKENS = 8
BUDGET_SLACK = 1.5e9


def views(folder: Path) -> dict[str, list[str]]:
    return {"default": [], "--staged": ["--staged"], "--lens": ["--lens"], "--attention": ["--attention"],
            "--html": ["--html", str(folder / "report.html")], "--batch 4": ["--batch", "4"],
            "--no-kv-cache": ["--no-kv-cache"], "--tp 2": ["--tp", "2"], "--dry-run": ["--dry-run"]}


def run(argv: list[str], env: dict[str, str]) -> tuple[float, int, int, str]:
    """(wall s, peak RSS bytes of the process or of its largest waited-for descendant, exit status, last stderr
    line)."""
    began = time.perf_counter()
    with tempfile.TemporaryFile() as err:
        proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=err, env=env, cwd=REPO)
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - began
        err.seek(0)
        lines = [line for line in err.read().decode(errors="replace").splitlines() if line.strip()]
    return wall, usage.ru_maxrss * 1024, os.waitstatus_to_exitcode(status), lines[-1] if lines else ""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--only", help="comma-separated view names (default: all)")
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args()
    sys.path.insert(0, str(REPO))
    from llmtrace.tracer.analytic.kvmem import kv_cache_bytes
    from llmtrace.tracer.checkpoint.resolve import resolve_model
    from llmtrace.tracer.core.dtypes import FP32

    config = resolve_model(str(args.model)).config
    file_bytes = args.model.stat().st_size
    results = {}
    print(f"load average before: {os.getloadavg()}", flush=True)
    with tempfile.TemporaryDirectory(prefix="bench_scale_views_") as home:
        env = {**os.environ, "XDG_CONFIG_HOME": f"{home}/config", "COLUMNS": "100"}
        python = sys.executable
        subprocess.run([python, "-c", "from llmtrace.tracer.model.native_kernel import prepare; print(prepare())"],
                       env=env, check=True, capture_output=True)
        for name, extra in views(Path(home)).items():
            if args.only and name not in args.only.split(","):
                continue
            argv = [python, "-m", "llmtrace", "run", "--model", str(args.model), PROMPT, "--max-new-tokens",
                    str(NEW_TOKENS), "--threads", "2", "--no-roofline", *extra]
            wall, rss, status, last = run(argv, env)
            batch = 4 if name == "--batch 4" else 1
            budget = file_bytes + batch * kv_cache_bytes(config, 8 + NEW_TOKENS, FP32) + BUDGET_SLACK
            results[name] = {"wall_s": wall, "peak_rss": rss, "budget": budget, "exit": status,
                             "stderr_last": last if status else ""}
            print(f"{name:<14} exit {status}  wall {wall:6.1f} s  peak {rss / 1e9:5.2f} GB  budget "
                  f"{budget / 1e9:5.2f} GB  {'within' if rss <= budget else 'OVER'}"
                  + (f"  ({last[:90]})" if status else ""), flush=True)
    print(f"load average after: {os.getloadavg()}")
    if args.json:
        args.json.write_text(json.dumps({"model": str(args.model), "results": results}, indent=1))


if __name__ == "__main__":
    main()
