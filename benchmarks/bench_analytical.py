"""Wall time of the analytical commands against `python -c "import typer, rich"` (the floor any Typer+rich CLI pays).

Run:  .venv/bin/python benchmarks/bench_analytical.py [--runs 21]   (on a machine doing nothing else)

Every command runs as a fresh subprocess, interleaved round-robin so that machine noise hits all of them alike;
medians are compared. Bytecode is compiled first (as an installed package has it) and PYTHONDONTWRITEBYTECODE is
cleared for the children. Output goes to a pipe at COLUMNS=80 (the narrow layouts). The analytical commands (flops,
kvmem, models, roofline, hardware, `show` of the saved trace in tests/data, `--help`) must each take at most 0.25 s
(median wall time) and at most 2.5x the baseline's median, measured side by side in this run; the exit status is 1
when one does not. The load average is printed before and after: figures taken on a busy machine say little.
"""

from __future__ import annotations

import argparse
import compileall
import os
import resource
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RATIO_LIMIT = 2.5  # x the median of `python -c "import typer, rich"`, measured in the same run
WALL_LIMIT_S = 0.25  # median wall time of one command
BASELINE = 'python -c "import typer, rich"'
SAVED_TRACE = "tests/data/readme_run.trace.json.gz"  # a real run of the bundled model (README's example of `show`)


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
    """The bundled SmolLM2 GGUF where this environment has it set up, else None (that case is then left out)."""
    from llmtrace.tracer.checkpoint.bundled import bundled_model_path
    from llmtrace.tracer.core.errors import LlmtraceError

    try:
        return str(bundled_model_path())
    except LlmtraceError:
        return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=21)
    args = parser.parse_args()

    compileall.compile_dir(ROOT / "tracer", quiet=1)
    compileall.compile_dir(ROOT / "cli", quiet=1)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    env["COLUMNS"] = "80"
    llmtrace = llmtrace_command()
    commands: dict[str, list[str]] = {
        BASELINE: [sys.executable, "-c", "import typer, rich"],
        # Not gated, for reading the figures: printing anything with rich needs rich.console, a table rich.table.
        'python -c "import typer, rich.console, rich.table"': [sys.executable, "-c",
                                                               "import typer, rich.console, rich.table"],
        "llmtrace kvmem --seq 2000": [*llmtrace, "kvmem", "--seq", "2000"],
        "llmtrace flops": [*llmtrace, "flops"],
        "llmtrace models": [*llmtrace, "models"],
        "llmtrace roofline": [*llmtrace, "roofline"],
        "llmtrace hardware": [*llmtrace, "hardware"],
        f"llmtrace show {SAVED_TRACE}": [*llmtrace, "show", SAVED_TRACE],
        "llmtrace --help": [*llmtrace, "--help"],
    }
    gated = {name for name in commands if name.startswith("llmtrace ")}
    gguf = bundled_gguf()
    if gguf:
        commands["llmtrace flops --model <bundled .gguf>"] = [*llmtrace, "flops", "--model", gguf]
    load_before = os.getloadavg()
    times: dict[str, list[float]] = {name: [] for name in commands}
    cpu: dict[str, list[float]] = {name: [] for name in commands}  # user + system seconds of the child
    for name, cmd in commands.items():  # one untimed run each: warm the page cache, fail early on an error
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, cwd=ROOT, env=env)
    for _ in range(args.runs):
        for name, cmd in commands.items():
            used = resource.getrusage(resource.RUSAGE_CHILDREN)
            start = time.perf_counter()
            subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, cwd=ROOT, env=env)
            times[name].append(time.perf_counter() - start)
            now = resource.getrusage(resource.RUSAGE_CHILDREN)
            cpu[name].append(now.ru_utime + now.ru_stime - used.ru_utime - used.ru_stime)

    load_after = os.getloadavg()
    base = statistics.median(times[BASELINE])
    print(f"llmtrace invoked as: {' '.join(llmtrace[:2]) + (' ...' if len(llmtrace) > 2 else '')}")
    print(f"{args.runs} runs each, interleaved; python {sys.version.split()[0]}; CPU {cpu_model()}")
    print(f"load average (1, 5, 15 min) before {_loads(load_before)}, after {_loads(load_after)}")
    print(f"{'command':52} {'median ms':>10} {'ratio':>7} {'cpu ms':>7}")
    failed = []
    for name, values in times.items():
        med = statistics.median(values)
        ratio = med / base
        if name in gated and (ratio > RATIO_LIMIT or med > WALL_LIMIT_S):
            failed.append(name)
        limits = f"  (limits {WALL_LIMIT_S * 1000:.0f} ms, {RATIO_LIMIT}x)" if name in gated else ""
        print(f"{name:52} {med * 1000:10.1f} {ratio:7.2f} {statistics.median(cpu[name]) * 1000:7.1f}{limits}")
    if failed:
        print(f"over a limit: {', '.join(failed)}")
    sys.exit(1 if failed else 0)


def _loads(loads: tuple[float, float, float]) -> str:
    return ", ".join(f"{x:.2f}" for x in loads)


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return f"{line.split(':', 1)[1].strip()} ({os.cpu_count()} cores)"
    except OSError:
        pass
    return f"unknown ({os.cpu_count()} cores)"


if __name__ == "__main__":
    main()
