"""What `run` says before its first panel (issue 31, item 5): the loading line (said before torch is imported),
the weights' bar in bytes, then the prefill line until the first panel. Order and content only: no timings here
(benchmarks/bench_scale.py times a 7B run)."""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from llmtrace.cli.render_run_progress import LoadingBar, bar, prefill_line

REPO = Path(__file__).resolve().parent.parent


def test_bar_fills_in_half_cells() -> None:
    assert bar(0, 100, 10) == "─" * 10
    assert bar(55, 100, 10) == "━" * 5 + "╺" + "─" * 4
    assert bar(100, 100, 10) == "━" * 10
    assert all(len(bar(d, 997, 20)) == 20 for d in range(0, 998, 7))


class _Status:
    def __init__(self) -> None:
        self.lines: list[str] = []

    def update(self, text: str) -> None:
        self.lines.append(text)


def test_loading_bar_is_paced_and_always_shows_the_end() -> None:
    """Hundreds of tensors a model: a line at most every interval, and the last one whatever the clock."""
    now = [0.0]
    status = _Status()
    loading = LoadingBar(status, "llama-7b.gguf", interval=0.1, clock=lambda: now[0])
    for done in range(0, 3_870_000_000, 10_000_000):  # 387 tensors within 0.05 s
        now[0] += 0.05 / 388
        loading(done, 3_870_000_000)
    loading(3_870_000_000, 3_870_000_000)
    assert len(status.lines) == 2  # the first, then the end
    assert status.lines[-1] == f"loading llama-7b.gguf {'━' * 20} 3.87 / 3.87 GB"
    assert prefill_line(128, 32, True) == "prefill: 128 prompt tokens through 32 layers, an untimed warm-up pass first …"


@pytest.mark.skipif(shutil.which("script") is None, reason="needs util-linux `script` for a terminal")
def test_a_run_on_a_terminal_says_loading_then_the_bar_then_prefill_before_its_first_panel(tmp_path: Path) -> None:
    """On a terminal (script's pseudo-terminal): the loading line comes first, then the bar with the checkpoint's
    bytes, then the prefill line, all before the first panel ("1 · Tokenization") follows the header."""
    command = [sys.executable, "-m", "llmtrace", "run", "The capital of France is", "--max-new-tokens", "2",
               "--weights", "native", "--dtype", "fp32", "--no-roofline"]
    out = subprocess.run(["script", "-q", "-e", "-c", shlex.join(command), "/dev/null"], capture_output=True,
                         cwd=tmp_path, timeout=600, env=_env(tmp_path)).stdout.decode("utf-8", "replace")
    text = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", out)
    loading = text.find("loading SmolLM2-135M-Instruct …")
    bytes_bar = text.find("0.10 / 0.10 GB")
    prefill = text.find("prefill: ")
    embedding = text.find("Embedding")
    assert -1 < loading < bytes_bar < prefill < embedding, (loading, bytes_bar, prefill, embedding)


def _env(tmp_path: Path) -> dict[str, str]:
    import os

    return {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache"), "XDG_CONFIG_HOME": str(tmp_path / "config"),
            "COLUMNS": "100", "PYTHONPATH": os.environ.get("PYTHONPATH", "")}
