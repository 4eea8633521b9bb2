"""`llmtrace run --dry-run --tp N`: rank 0's shard of any model on the meta device, traced like any dry run, with
the collectives it would make recorded by size (tracer/trace/collectives.py's ShapeCollectives). No weights are
read and nothing is exchanged; every rank's shapes are rank 0's (the last vocabulary slice is padded to the same
size), so one rank stands for all N."""

from __future__ import annotations

from dataclasses import replace

from llmtrace.tracer.core.dtypes import AutoDtype, DType
from llmtrace.tracer.load.loader import LoadedModel
from llmtrace.tracer.load.tensor_parallel import load_shard
from llmtrace.tracer.trace.collectives import ShapeCollectives, collective_records
from llmtrace.tracer.trace.run_trace import Trace
from llmtrace.tracer.trace.tp_records import STATUS_OK, TensorParallelRun


class TensorParallelDryRun:
    """`loaded` is rank 0's shard on the meta device; run it through a Generation, then `finish` its trace."""

    def __init__(self, model: str | None, dtype: DType | AutoDtype, tp: int, weights: str | None = None) -> None:
        self.tp = tp
        self.comm = ShapeCollectives(0, tp)
        # a GGUF's matrices counted as the run holds them (its shard's stored bytes under the run's kernels)
        self.loaded: LoadedModel = load_shard(model, dtype, "cpu", 0, tp, self.comm, dry_run=True, weights=weights)

    def finish(self, trace: Trace, origin_ns: int) -> Trace:
        """The trace with the collectives each step would make and the (meta) set-up recorded."""
        setup = TensorParallelRun(tp=self.tp, backend="none", launcher="meta", threads_per_rank=1, timeout_s=0.0,
                                  link=None, status=STATUS_OK, exit_codes=(None,) * self.tp)
        records = collective_records(self.comm.events, 0, self.tp, origin_ns, trace.steps)
        return replace(trace, tensor_parallel=setup, collectives=records)
