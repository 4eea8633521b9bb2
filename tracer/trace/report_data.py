"""Figures the HTML report draws, as records worked out from a trace (no torch, no plotting): the time of every
stage role in every layer (the heat map) and the measured points of the roofline.

The report (llmtrace.cli.render_html) only draws these and the trace's own records.
"""

from __future__ import annotations

from dataclasses import dataclass

from llmtrace.tracer.trace.records import DECODE, PREFILL
from llmtrace.tracer.trace.run_trace import Trace
from llmtrace.tracer.trace.summary import phase_summary


@dataclass(frozen=True, slots=True)
class LayerStageGrid:
    """Time per layer x stage role in one phase: the mean over its traced steps of each stage's own time."""

    phase: str
    steps: int  # the traced steps averaged over
    roles: tuple[str, ...]  # in a layer's order
    layers: tuple[int, ...]
    ns: tuple[tuple[float, ...], ...]  # [layer][role]; 0 where the role did not run in that layer


@dataclass(frozen=True, slots=True)
class RooflinePoint:
    """One phase as measured: FLOPs per byte of weight and KV traffic, and the FLOP/s it reached."""

    phase: str
    arithmetic_intensity: float
    flops_per_second: float
    bytes_per_second: float  # weights + KV moved per second of forward time


def layer_stage_grid(trace: Trace, phase: str) -> LayerStageGrid | None:
    """None when the phase has no traced stage inside a layer (--no-trace, or no decode step). The mean is over the
    steps whose stage records the trace kept (--trace-steps may keep some only), as decode_by_stage's is."""
    steps = len(trace.traced_steps(phase))
    stages = [s for s in trace.stages if s.phase == phase and s.layer is not None]
    if not steps or not stages:
        return None
    roles = tuple(dict.fromkeys(s.short_name for s in stages))
    layers = tuple(sorted({s.layer for s in stages}))  # type: ignore[type-var]
    column = {role: i for i, role in enumerate(roles)}
    row = {layer: i for i, layer in enumerate(layers)}
    grid = [[0.0] * len(roles) for _ in layers]
    for s in stages:
        grid[row[s.layer]][column[s.short_name]] += s.duration_ns / steps
    return LayerStageGrid(phase, steps, roles, layers, tuple(tuple(r) for r in grid))


def roofline_points(trace: Trace) -> tuple[RooflinePoint, ...]:
    """The prefill and the decode steps (together) as measured; phases without traced FLOPs are left out."""
    points = []
    for phase in (PREFILL, DECODE):
        summary = phase_summary(trace, phase)
        if summary.totals.flops and summary.forward_ns:
            points.append(RooflinePoint(phase, summary.arithmetic_intensity, summary.flops_per_second,
                                        summary.min_bytes_per_second))
    return tuple(points)
