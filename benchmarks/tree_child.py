"""One benchmark child in another llmtrace tree: the same script run with `--child`, importing llmtrace from the
tree's `<tree>-pkgs` link (as /work/tools/py does), its last stdout line read as JSON. The A/B benchmarks
(bench_sampler_ab, bench_tree_ab) alternate such children between two trees."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any


def run_in_tree(script: str, tree: Path, child_args: list[str]) -> dict[str, Any]:
    env = dict(os.environ, PYTHONPATH=f"{tree}-pkgs")
    argv = [sys.executable, str(Path(script).resolve()), "--child", *child_args]
    done = subprocess.run(argv, env=env, cwd=tree, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"{tree}: child failed\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])
