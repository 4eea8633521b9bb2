"""The records a tensor-parallel run adds to its Trace (tracer/model/tensor_parallel.py describes the split).

Rank 0's stage and step records are the Trace's own `stages` and `steps` (so every view of a run shows a
tensor-parallel run as rank 0 saw it); `rank_stages` holds every other rank's, and `collectives` one record per
collective per rank. Times of every rank are on the Trace's clock: rank r's own clock shifted by the difference of
the two ranks' origins (one machine's monotonic clock: exact for ranks on one host). Plain values only, as records.py.
"""

from __future__ import annotations

from dataclasses import dataclass

from llmtrace.tracer.trace.records import StageRecord

ALL_REDUCE = "all_reduce"  # element-wise sum over the group, every rank gets it
ALL_GATHER = "all_gather"  # every rank's tensor, concatenated along the last dimension, on every rank

STATUS_OK = "ok"


@dataclass(frozen=True, slots=True)
class CollectiveRecord:
    """One collective one rank took part in, during one step's forward."""

    rank: int
    phase: str  # "prefill" or "decode"
    step: int
    kind: str  # ALL_REDUCE or ALL_GATHER
    layer: int | None  # None for the embedding's all-reduce and the LM head's all-gather
    after: str  # the stage whose output was exchanged: "layers.3.attention.wo", "tok_embeddings", "output"
    ranks: tuple[int, ...]  # the group's ranks
    payload_bytes: int  # this rank's tensor going in
    bytes_sent: int  # what a ring algorithm makes this rank send: all-reduce 2(N-1)/N x payload, all-gather (N-1) x
    start_ns: int
    duration_ns: int

    @property
    def end_ns(self) -> int:
        return self.start_ns + self.duration_ns


@dataclass(frozen=True, slots=True)
class RankStep:
    """When one rank ran one step's forward (its own clock shifted onto the trace's)."""

    phase: str
    step: int
    start_ns: int
    forward_ns: int


@dataclass(frozen=True, slots=True)
class RankStages:
    """Another rank's records of the run (rank 0's are the Trace's own stages and steps)."""

    rank: int
    steps: tuple[RankStep, ...]
    stages: tuple[StageRecord, ...]
    peak_rss_bytes: int = 0  # the rank's own process at its highest (the trace's peak_rss_bytes is the base rank's)


@dataclass(frozen=True, slots=True)
class LinkMeasurement:
    """All-reduce over this run's own process group, timed before the generation (medians of a few calls)."""

    small_payload_bytes: int  # one decode all-reduce's payload (B x dim x activation bytes)
    small_seconds: float  # one all-reduce of it: mostly latency
    large_payload_bytes: int
    large_seconds: float
    bus_bandwidth: float  # bytes/s: the ring bytes of the large all-reduce over its time (nccl-tests' "busbw")


@dataclass(frozen=True, slots=True)
class TensorParallelRun:
    """How a tensor-parallel run was set up and how it ended."""

    tp: int  # ranks
    backend: str  # "shm" (CPU ranks spawned on one host: tracer/run/shm_link.py), "gloo" (CPU), "nccl" (CUDA)
    launcher: str  # "spawn" (llmtrace started the ranks) or "torchrun"
    threads_per_rank: int  # torch CPU threads of each rank
    timeout_s: float  # the process group's timeout: the longest any collective waits for a missing rank
    link: LinkMeasurement | None  # None when the run failed before measuring (or a dry run)
    status: str  # STATUS_OK, or the one line that says which rank failed, how and when
    exit_codes: tuple[int | None, ...]  # each rank's process exit code (None: not a process llmtrace started)
    base_rank: int = 0  # whose records are the Trace's own stages and steps (0 unless rank 0 left none)
