"""A tensor-parallel rank's peak memory against its shard (issue 31, item 2: "--tp 2, each rank maps only its
shard"), on a 2-layer model with LLaMA-7B's widths (dim 4096, FFN 11,008, vocabulary 32,000: 220 MB of Q4_0, a
rank's shard 110 MB, the model dequantized to fp32 1.7 GB), so a rank that held the whole file, or any fp32 copy,
shows. The ranks are spawned as `run --tp 2` spawns them; each records its own peak (VmHWM) in the trace. A rank's
fixed overhead (interpreter, torch, gloo, llmtrace) is a fresh process's resident size once it has imported what a
rank imports and joined a one-process gloo group. 7B: benchmarks/bench_tp_scale.py."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from llmtrace.tracer.analytic.kvmem import kv_cache_bytes
from llmtrace.tracer.core.dtypes import AUTO, FP32
from llmtrace.tracer.load.loader import plan_load
from llmtrace.tracer.load.stored_weights import STORED
from llmtrace.tracer.load.tensor_parallel import shard_bytes, shard_of
from llmtrace.tracer.model import native_kernel
from llmtrace.tracer.run.tp_launch import run_tensor_parallel
from llmtrace.tracer.trace.records import RunSettings

REPO = Path(__file__).resolve().parent.parent
SLACK = 100e6  # as tests/test_memory_budget.py's: a prefill's activations, the products' buffers, the reader's
BASE = """
import os, tempfile
import torch
import torch.distributed as dist
from llmtrace.tracer.run import tp_worker
from llmtrace.tracer.load import tensor_parallel
from llmtrace.tracer.run.generate import Generation
store = dist.FileStore(os.path.join(tempfile.mkdtemp(), "store"), 1)
dist.init_process_group("gloo", store=store, rank=0, world_size=1)
for line in open("/proc/self/status"):
    if line.startswith("VmRSS:"):
        print(int(line.split()[1]) * 1024)
"""


def test_each_rank_peaks_within_its_shard_plus_its_kv_cache_plus_a_fixed_overhead(tmp_path: Path) -> None:
    if not native_kernel.available():
        pytest.skip(native_kernel.unavailable_reason())
    sys.path.insert(0, str(REPO))
    from benchmarks.scale_models import Shape, write

    shape = Shape("two-layer-7b", 4096, 2, 32, 32, 11008, 32000, 10000.0, False, 4096)
    path = write(tmp_path / "two-layer-7b.Q4_0.gguf", shape, "Q4_0", say=lambda _: None)
    plan = plan_load(str(path), AUTO)
    assert plan.weights.mode == STORED  # the default table's kernels, as the ranks'
    held = [shard_bytes(plan, rank, 2) for rank in (0, 1)]
    shard, _ = shard_of(plan.resolved, 0, 2)
    stored = sum(t.n_bytes for t in shard.gguf_header.tensors)  # type: ignore[union-attr]
    assert held[0] == held[1] == stored  # every matrix held as its shard's file bytes, once
    kv = kv_cache_bytes(shard.config, 64, FP32)  # more positions than the run's
    base = int(subprocess.run([sys.executable, "-c", BASE], capture_output=True, text=True, check=True,
                              timeout=300).stdout)
    settings = RunSettings(model=str(path), prompt="The capital of France is", max_new_tokens=4, temperatures=())
    result = run_tensor_parallel(settings, AUTO, 2, threads=1, timeout_s=300.0)
    assert result.status == "ok"
    trace = result.trace
    peaks = [trace.peak_rss_bytes, trace.rank_stages[0].peak_rss_bytes]
    for peak in peaks:
        assert stored <= peak - base <= stored + kv + SLACK, (peaks, base, stored, kv)
