"""How long the native library's build takes, the first run's cost that llama.cpp's first run does not pay (issue 31,
item 3: a first run within 1.5x of llama.cpp's load + generate).

Each round, alternated: the whole build as `native_kernel.available()` does it in a fresh kernel folder (flag probe,
the units' compile, link, hash, load, self-test), and the same units compiled and linked by one compiler command,
one unit after another (how the build ran before the units were compiled in parallel). Wall seconds, the median
and the range of `--rounds`.

    /work/tools/quiet /work/tools/py -m benchmarks.bench_native_build --rounds 5
"""

from __future__ import annotations

import argparse
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

_BUILD = """import time, torch
from llmtrace.tracer.model import native_kernel as n
began = time.perf_counter()
ok = n.available()
print(time.perf_counter() - began if ok else 'failed: ' + n.unavailable_reason())
"""


def build_whole(folder: Path) -> float:
    """native_kernel's own build, in a fresh process and folder: seconds of available()."""
    env = {**os.environ, "LLMTRACE_NATIVE_DIR": str(folder)}
    done = subprocess.run([sys.executable, "-c", _BUILD], env=env, capture_output=True, text=True, check=True)
    value = done.stdout.strip().splitlines()[-1]
    if value.startswith("failed"):
        raise SystemExit(value)
    return float(value)


def build_serial(folder: Path) -> float:
    """One compiler command for every unit, as the build ran before: seconds."""
    from llmtrace.tracer.model import native_kernel as n

    compiler = shlex.split(os.environ.get("CC", "") or "cc")
    units = [str(path) for path in n.SOURCES if path.suffix == ".c"]
    began = time.perf_counter()
    subprocess.run([*compiler, *n.FLAG_SETS[0], *n.COMMON_FLAGS, "-o", str(folder / "serial.so"), *units, *n.LIBS],
                   check=True)
    return time.perf_counter() - began


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    whole, serial = [], []
    for _ in range(args.rounds):
        with tempfile.TemporaryDirectory(prefix="bench_native_build_") as tmp:
            whole.append(build_whole(Path(tmp) / "native"))
            serial.append(build_serial(Path(tmp)))
    print(f"{os.cpu_count()} CPUs, {args.rounds} rounds alternated; load average {os.getloadavg()}")
    for label, values in (("available() in a fresh folder (units in parallel)", whole),
                          ("one compiler command, units one after another", serial)):
        print(f"{label}: median {statistics.median(values):.2f} s, range {min(values):.2f}-{max(values):.2f} s")


if __name__ == "__main__":
    main()
