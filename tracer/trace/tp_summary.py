"""What a tensor-parallel run's communication cost, measured beside what `roofline --tp` predicts for the same run.

Measured: the base rank's collective records (tracer/trace/tp_records.py), per phase. Predicted: the roofline's
formula (tracer/analytic/tensor_parallel.py, tracer/roofline/analysis.py): each layer's two all-reduces of B x T x dim
activations, a ring sending 2(N-1)/N of the payload, at the link's one-way bandwidth, with no latency term. For the
link this run measured its own: the bus bandwidth of a 4 MiB all-reduce over the run's process group (gloo over
loopback on a CPU). Because the roofline leaves latency out, the summary also gives the latency-aware figure
(the measured time of one decode-sized all-reduce + the ring bytes at that bandwidth), which is what small decode
payloads actually see.

Per rank: FLOPs, weight bytes and bytes sent, from each rank's own records. Pure Python over the records.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from llmtrace.tracer.analytic.tensor_parallel import ALLREDUCES_PER_LAYER, ring_allreduce_bytes
from llmtrace.tracer.trace.records import DECODE, PREFILL, StageRecord
from llmtrace.tracer.trace.run_trace import Trace
from llmtrace.tracer.trace.summary import stage_totals
from llmtrace.tracer.trace.tp_records import ALL_REDUCE, CollectiveRecord


@dataclass(frozen=True, slots=True)
class CommPhase:
    """One phase's communication on the base rank: measured, and as the roofline predicts it."""

    phase: str
    steps: int  # steps with collective records
    tokens_per_step: float  # T: prompt tokens in the prefill, 1 in decode
    collectives_per_step: int
    layer_allreduce_payload_bytes: int  # one per-layer all-reduce's B x T x dim activations
    measured_layer_allreduce_ns: float  # median of one per-layer all-reduce
    measured_layer_ns_per_step: float  # all per-layer all-reduces of a step, mean over steps
    measured_comm_ns_per_step: float  # every collective of a step (embedding and LM head included), mean
    measured_comm_ns_per_token: float  # measured_comm_ns_per_step / tokens_per_step
    forward_ns_per_step: float  # the base rank's forward, mean over the same steps
    predicted_layer_allreduce_ns: float  # roofline --tp: ring bytes / bandwidth (no latency)
    predicted_layer_ns_per_step: float  # x 2 per layer x layers
    predicted_comm_ns_per_token: float  # / tokens_per_step
    latency_aware_layer_allreduce_ns: float  # one decode-sized all-reduce's measured time + ring bytes / bandwidth

    @property
    def comm_share(self) -> float:
        """Fraction of the forward spent in collectives."""
        return self.measured_comm_ns_per_step / self.forward_ns_per_step if self.forward_ns_per_step else 0.0


@dataclass(frozen=True, slots=True)
class RankCost:
    """One rank's work, from its own stage and collective records."""

    rank: int
    prefill_flops: int
    decode_flops_per_step: float  # mean over its traced decode steps
    weight_bytes_per_decode_step: float
    bytes_sent_per_decode_step: float  # by its collectives, ring estimate
    peak_rss_bytes: int  # its process's resident set at its highest (0: not recorded)


@dataclass(frozen=True, slots=True)
class TensorParallelSummary:
    tp: int
    backend: str
    bus_bandwidth: float  # bytes/s, measured (0 when not measured)
    small_allreduce_seconds: float  # one decode-sized all-reduce, measured
    phases: tuple[CommPhase, ...]
    ranks: tuple[RankCost, ...]
    status: str


def _phase_steps(records: list[StageRecord] | tuple[StageRecord, ...], phase: str) -> dict[int, list[StageRecord]]:
    out: dict[int, list[StageRecord]] = {}
    for s in records:
        if s.phase == phase:
            out.setdefault(s.step, []).append(s)
    return out


def _rank_cost(rank: int, stages: tuple[StageRecord, ...], collectives: list[CollectiveRecord],
               peak_rss_bytes: int) -> RankCost:
    prefill = stage_totals(s for s in stages if s.phase == PREFILL)
    decode = _phase_steps(stages, DECODE)
    sent = [c for c in collectives if c.phase == DECODE]
    steps = max(1, len(decode))
    return RankCost(
        rank=rank, prefill_flops=prefill.flops,
        decode_flops_per_step=sum(stage_totals(v).flops for v in decode.values()) / steps,
        weight_bytes_per_decode_step=sum(stage_totals(v).weight_bytes_read for v in decode.values()) / steps,
        bytes_sent_per_decode_step=sum(c.bytes_sent for c in sent) / max(1, len({c.step for c in sent})),
        peak_rss_bytes=peak_rss_bytes,
    )


def _phase(trace: Trace, phase: str, mine: list[CollectiveRecord], bandwidth: float,
           small_seconds: float, tp: int) -> CommPhase | None:
    steps = {s.step: s for s in trace.steps if s.phase == phase}
    by_step: dict[int, list[CollectiveRecord]] = {}
    for c in mine:
        if c.phase == phase and c.step in steps:
            by_step.setdefault(c.step, []).append(c)
    if not by_step:
        return None
    layers = trace.config.n_layers
    layer_calls = [c for cs in by_step.values() for c in cs if c.kind == ALL_REDUCE and c.layer is not None]
    payload = layer_calls[0].payload_bytes if layer_calls else 0
    tokens = statistics.mean(steps[k].input_tokens for k in by_step)
    count = len(by_step)
    measured_layer = sum(c.duration_ns for c in layer_calls) / count
    measured_all = sum(c.duration_ns for cs in by_step.values() for c in cs) / count
    ring = ring_allreduce_bytes(payload, tp)
    predicted_one = ring / bandwidth * 1e9 if bandwidth > 0 else 0.0
    predicted_step = predicted_one * ALLREDUCES_PER_LAYER * layers
    return CommPhase(
        phase=phase, steps=count, tokens_per_step=tokens,
        collectives_per_step=round(sum(len(cs) for cs in by_step.values()) / count),
        layer_allreduce_payload_bytes=payload,
        measured_layer_allreduce_ns=statistics.median(c.duration_ns for c in layer_calls) if layer_calls else 0.0,
        measured_layer_ns_per_step=measured_layer, measured_comm_ns_per_step=measured_all,
        measured_comm_ns_per_token=measured_all / tokens if tokens else 0.0,
        forward_ns_per_step=statistics.mean(steps[k].forward_ns for k in by_step),
        predicted_layer_allreduce_ns=predicted_one, predicted_layer_ns_per_step=predicted_step,
        predicted_comm_ns_per_token=predicted_step / tokens if tokens else 0.0,
        latency_aware_layer_allreduce_ns=small_seconds * 1e9 + predicted_one,
    )


def tensor_parallel_summary(trace: Trace) -> TensorParallelSummary | None:
    """None for a one-device trace."""
    setup = trace.tensor_parallel
    if setup is None:
        return None
    link = setup.link
    bandwidth = link.bus_bandwidth if link is not None else 0.0
    small = link.small_seconds if link is not None else 0.0
    mine = [c for c in trace.collectives if c.rank == setup.base_rank]
    phases = tuple(p for p in (_phase(trace, ph, mine, bandwidth, small, setup.tp) for ph in (PREFILL, DECODE))
                   if p is not None)
    ranks = [_rank_cost(setup.base_rank, trace.stages, mine, trace.peak_rss_bytes)]
    for other in trace.rank_stages:
        ranks.append(_rank_cost(other.rank, other.stages, [c for c in trace.collectives if c.rank == other.rank],
                                other.peak_rss_bytes))
    return TensorParallelSummary(tp=setup.tp, backend=setup.backend, bus_bandwidth=bandwidth,
                                 small_allreduce_seconds=small, phases=phases,
                                 ranks=tuple(sorted(ranks, key=lambda r: r.rank)), status=setup.status)


# ---- dry runs -------------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class CollectiveSize:
    """One collective a forward makes on every rank, by size (a dry run's records grouped)."""

    kind: str
    after: str  # the stage role: "attention.wo", "feed_forward.w2" (once per layer), "tok_embeddings", "output"
    per_pass: int  # how many one forward makes
    payload_bytes: int  # each one's tensor per rank
    bytes_sent: int  # each one's ring bytes per rank


@dataclass(frozen=True, slots=True)
class RankPass:
    """One pass as one rank runs it, beside the analytic per-device figure `roofline --tp` uses."""

    phase: str
    new_tokens: int
    context_length: int
    traced_flops: int  # rank 0's stage records
    analytic_flops: int  # tracer/analytic/tensor_parallel.py device_cost: the same pass, split by formula
    single_device_flops: int  # the whole model's pass (estimate)
    replicated_flops: int  # of traced_flops, what every rank repeats (norms, residual adds)
    weight_bytes: int  # traced, rank 0
    collectives: tuple[CollectiveSize, ...]

    @property
    def equal(self) -> bool:
        return self.traced_flops == self.analytic_flops


def tp_dry_run_passes(trace: Trace) -> tuple[RankPass, ...]:
    """A --dry-run --tp N trace's passes: rank 0's traced figures, the analytic per-device ones, the collectives."""
    from llmtrace.tracer.analytic import estimate
    from llmtrace.tracer.analytic.kernels import Kernels
    from llmtrace.tracer.analytic.tensor_parallel import device_cost, replicated_components
    from llmtrace.tracer.core.dtypes import get_dtype

    setup = trace.tensor_parallel
    if setup is None:
        return ()
    dtypes = estimate.Dtypes.for_weights(get_dtype(trace.environment.dtype))
    replicated = replicated_components()
    out = []
    for step in trace.steps:
        if step.phase == PREFILL:
            est = estimate.prefill(trace.config, step.input_tokens, dtypes, kernels=Kernels.EAGER)
        else:
            est = estimate.decode_step(trace.config, step.context_length - step.input_tokens, dtypes,
                                       kernels=Kernels.EAGER)
        stages = [s for s in trace.stages if s.phase == step.phase and s.step == step.step]
        traced = stage_totals(stages)
        cost = device_cost(trace.config, est, dtypes.activations.bytes_per_value, setup.tp)
        sizes: dict[tuple[str, str, int], list[CollectiveRecord]] = {}
        for c in trace.collectives:
            if c.phase == step.phase and c.step == step.step:
                role = c.after.split(".", 2)[2] if c.layer is not None else c.after
                sizes.setdefault((c.kind, role, c.payload_bytes), []).append(c)
        out.append(RankPass(
            phase=step.phase, new_tokens=step.input_tokens, context_length=step.context_length,
            traced_flops=traced.flops, analytic_flops=cost.flops, single_device_flops=est.totals.total_flops,
            replicated_flops=sum(s.flops for s in stages if s.short_name in replicated),
            weight_bytes=traced.weight_bytes_read,
            collectives=tuple(CollectiveSize(kind, role, len(cs), payload, cs[0].bytes_sent)
                              for (kind, role, payload), cs in sizes.items()),
        ))
    return tuple(out)
