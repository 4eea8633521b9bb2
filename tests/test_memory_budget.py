"""Peak memory of a run against its formula (issue 31, items 2 and 6), on a 2-layer model with LLaMA-7B's widths
(dim 4096, FFN 11,008, vocabulary 32,000): its stored bytes (409-709 MB) dwarf the noise of a process's resident
size, so a second copy of the weights shows. A fresh process loads the file and generates as `run` does; the fixed
overhead (interpreter, torch, the libraries) is its resident size before the load, measured in the same process,
and the peak is the kernel's high-water mark (VmHWM) after the generation. 7B and 8B: benchmarks/bench_scale.py."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from llmtrace.tracer.analytic.kvmem import kv_cache_bytes
from llmtrace.tracer.checkpoint.gguf_header import read_gguf_header
from llmtrace.tracer.checkpoint.resolve import resolve_model
from llmtrace.tracer.core.dtypes import FP32
from llmtrace.tracer.load import memory_fit
from llmtrace.tracer.load.stored_weights import STORED, WeightsChoice
from llmtrace.tracer.model import native_kernel

REPO = Path(__file__).resolve().parent.parent
# Held beyond the weights as the run holds them and the KV cache at these widths: a prefill's activations and
# logits, the C step's scratch, torch's first products' buffers, the reader's buffer. A second copy of the weights
# would be +230-330 MB.
SLACK = 64e6
CHILD = """
import sys
import torch
from llmtrace.tracer.core.dtypes import FP32
from llmtrace.tracer.load.loader import load_model
from llmtrace.tracer.run.generate import generate
from llmtrace.tracer.trace.records import RunSettings

def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024

path, weights = sys.argv[1:3]
before = status("VmRSS")
loaded = load_model(path, FP32, weights=weights)
generate(loaded, RunSettings(model=path, prompt="The capital of France is", max_new_tokens=4, temperatures=()))
print(before, status("VmHWM"))
"""


@pytest.mark.parametrize("mix, weights, within_stored", [("Q4_K_M", "i8dot", True), ("Q8_0", "native", True),
                                                         ("Q4_0", "i8dot", False)])
def test_peak_rss_is_the_weights_as_held_plus_the_kv_cache_plus_a_fixed_overhead(
        mix: str, weights: str, within_stored: bool, tmp_path: Path) -> None:
    """The peak is what memory_fit says the run holds + the KV cache + SLACK; where every matrix is held once (K-quants
    and Q8_0 on the C library's kernels) that is within the file's stored bytes, the issue's budget. i8dot's Q4_0/Q4_1
    matrices are held twice (the interleaved copy every product reads, and the rows the reader read, kept for lookups,
    dequantization and rows outside whole groups): the peak says so too, and the test asserts it (issue 31's budget is
    not met there: the rows would have to go)."""
    if not native_kernel.available():
        pytest.skip(native_kernel.unavailable_reason())
    sys.path.insert(0, str(REPO))
    from benchmarks.scale_models import Shape, write

    shape = Shape("two-layer-7b", 4096, 2, 32, 32, 11008, 32000, 10000.0, False, 4096)
    path = write(tmp_path / f"two-layer-7b.{mix}.gguf", shape, mix, say=lambda _: None)
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache"), "XDG_CONFIG_HOME": str(tmp_path / "config")}
    done = subprocess.run([sys.executable, "-c", CHILD, str(path), weights], capture_output=True, text=True, env=env,
                          timeout=900)
    assert done.returncode == 0, done.stderr
    before, peak = (int(v) for v in done.stdout.split())
    stored = sum(t.n_bytes for t in read_gguf_header(path).tensors)
    resolved = resolve_model(str(path))
    held, _ = memory_fit.weights_held(resolved, WeightsChoice(STORED, "", weights), FP32)
    kv = kv_cache_bytes(resolved.config, 64, FP32)  # more positions than the run's 10
    assert held <= peak - before <= held + kv + SLACK, (peak - before, held, stored)
    assert (held <= stored) == within_stored, (held, stored)
