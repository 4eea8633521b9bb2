"""Does `--weights auto` take the same candidate every time it measures afresh? Several first runs of
`llmtrace run capital --max-new-tokens 1 --no-trace`, each a fresh CLI process with its own empty config folder
(XDG_CONFIG_HOME, as benchmarks/bench_vs_peers.py isolates it), so each one measures the kernel choice; per run:
what auto picked, by how much (the rule's reference-generation ratio), the decode and prefill figures of the
leading candidates, the measurement's seconds and the command's wall time.

    /work/tools/quiet .venv/bin/python -m benchmarks.bench_auto_choice --runs 5

`--python` runs another checkout's llmtrace (its venv's python, from that checkout's root): the figures before a
change, alternated run by run with this checkout's.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
LEADERS = ("native", "Q4_1:i8dot,Q8_0:native")


def fresh_choice(python: Path) -> dict:
    """One first run in an empty config folder: the saved choice (kernels.json) and the command's wall time."""
    with tempfile.TemporaryDirectory(prefix="bench-auto-choice-") as folder:
        env = {**os.environ, "XDG_CONFIG_HOME": folder}
        start = time.perf_counter()
        subprocess.run([str(python), "-m", "llmtrace", "run", "capital", "--max-new-tokens", "1", "--no-trace"],
                       cwd=python.parent.parent.parent, env=env, check=True, capture_output=True)
        wall = time.perf_counter() - start
        data = json.loads((Path(folder) / "llmtrace" / "kernels.json").read_text())
    (entry,) = [e for models in data["machines"].values() for e in models.values()]
    return {"wall_s": wall, "version": data["version"], **entry}


def line(label: str, run: dict) -> str:
    timings = {c["name"]: c for c in run["candidates"]}
    reference = {n: c["prefill_s"] + 128 * c["decode_s"] for n, c in timings.items() if c["safe"]}
    ranked = sorted(reference, key=reference.get)
    ratio = reference[ranked[1]] / reference[ranked[0]] if len(ranked) > 1 else float("nan")
    cells = ", ".join(f"{n} decode {timings[n]['decode_s'] * 1e3:.2f} ms prefill {timings[n]['prefill_s'] * 1e3:.0f} ms"
                      for n in LEADERS if n in timings)
    return (f"{label}: picked {run['picked']} ({ratio:.2f}x ahead of {ranked[1]}); {cells}; measured in "
            f"{run['measured_seconds']:.1f} s, command {run['wall_s']:.1f} s (kernels.json v{run['version']})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--python", type=Path, default=None,
                        help="another checkout's .venv/bin/python, alternated with this one's (before/after)")
    args = parser.parse_args()
    pythons = {"this": REPO / ".venv" / "bin" / "python"}
    if args.python is not None:
        pythons["other"] = args.python.absolute()
    print("load average before:", os.getloadavg(), flush=True)
    runs: dict[str, list[dict]] = {label: [] for label in pythons}
    for index in range(args.runs):
        for label, python in pythons.items():
            run = fresh_choice(python)
            runs[label].append(run)
            print(line(f"run {index + 1} {label}", run), flush=True)
    for label, done in runs.items():
        picks = {r["picked"] for r in done}
        print(f"{label}: picked {', '.join(sorted(picks))} in {len(done)} fresh choices; measured in median "
              f"{statistics.median(r['measured_seconds'] for r in done):.1f} s, command median "
              f"{statistics.median(r['wall_s'] for r in done):.1f} s")
    print("load average after:", os.getloadavg())


if __name__ == "__main__":
    main()
