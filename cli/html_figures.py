"""The HTML report's figures, drawn by matplotlib as inline SVG (text as paths: the page needs no font or network),
and the colour maps of its heat maps (tables, so that every cell can say its value on hover).

matplotlib's object API only (Figure, no pyplot): no global figure state, nothing left open. Each figure gets its own
`svg.hashsalt`, so the ids inside several inline SVGs of one page never collide.
"""

from __future__ import annotations

import io
import re
import warnings
from typing import Sequence

import matplotlib
from matplotlib.colors import to_hex
from matplotlib.figure import Figure

from llmtrace.tracer.trace.journey_records import NoCacheRun
from llmtrace.tracer.trace.records import StepRecord
from llmtrace.tracer.trace.report_data import RooflinePoint


def _svg(fig: Figure, salt: str) -> str:
    buffer = io.StringIO()
    with matplotlib.rc_context({"svg.hashsalt": salt, "svg.fonttype": "path"}), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a piece whose glyph DejaVu Sans lacks (CJK) is drawn as a box, not an error
        fig.savefig(buffer, format="svg", bbox_inches="tight")
    text = buffer.getvalue()
    return _scoped_ids(text[text.index("<svg"):], salt)  # inline: no XML declaration or DOCTYPE


def _scoped_ids(svg: str, scope: str) -> str:
    """Every id of the figure (matplotlib's figure_1, axes_1, glyph and clip-path ids) and every reference to one
    prefixed with `scope`: ids stay unique across the page's figures, and each figure refers only to its own."""
    def rename(match: re.Match[str]) -> str:
        return f'{match.group(1)}{scope}-{match.group(2)}'

    svg = re.sub(r'(\sid=")([^"]+)', rename, svg)
    return re.sub(r'((?:href="|url\()#)([^")]+)', rename, svg)


def _figure(width: float, height: float) -> Figure:
    return Figure(figsize=(width, height), dpi=96, layout="constrained")


def palette(name: str, levels: int) -> tuple[str, ...]:
    """`levels` colours of matplotlib's colour map `name` ("viridis", "magma"), lowest first, as #rrggbb: the HTML
    heat maps are tables whose cells take one of them (a value's level: its share of the scale's top)."""
    cmap = matplotlib.colormaps[name]
    return tuple(to_hex(cmap((i + 0.5) / levels)) for i in range(levels))


def roofline(points: Sequence[RooflinePoint], peak_flops: float | None, bandwidth: float | None,
             hardware: str) -> str:
    fig = _figure(7, 4.5)
    ax = fig.add_subplot()
    ax.set_xscale("log")
    ax.set_yscale("log")
    xs = [p.arithmetic_intensity for p in points]
    lo, hi = min([0.1, *xs]) / 2, max([1000.0, *xs]) * 2
    if peak_flops and bandwidth:
        grid = [lo * (hi / lo) ** (i / 200) for i in range(201)]
        ax.plot(grid, [min(peak_flops, bandwidth * x) for x in grid], color="black", label=f"roofline: {hardware}")
        ridge = peak_flops / bandwidth
        ax.axvline(ridge, color="gray", linestyle=":", label=f"ridge {ridge:.1f} FLOP/B")
    colors = {"prefill": "tab:orange", "decode": "tab:blue"}
    for p in points:
        ax.scatter([p.arithmetic_intensity], [p.flops_per_second], s=60, color=colors.get(p.phase, "tab:red"),
                   label=f"{p.phase} measured: {p.flops_per_second / 1e9:.2f} GFLOP/s at {p.arithmetic_intensity:.2f} "
                         "FLOP/B", zorder=3)
    ax.set_xlim(lo, hi)
    ys = [p.flops_per_second for p in points] + ([peak_flops] if peak_flops else [])
    ax.set_ylim(min(ys) / 10, max(ys) * 10)
    ax.set_xlabel("arithmetic intensity (FLOPs per byte of weights + KV moved)")
    ax.set_ylabel("FLOP/s")
    ax.set_title("Roofline" + ("" if peak_flops else " (measured points; no ceilings for a saved trace)"))
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    return _svg(fig, "roofline")


def decode_times(steps: Sequence[StepRecord]) -> str:
    fig = _figure(7, 3.2)
    ax = fig.add_subplot()
    xs = [s.step for s in steps]
    ax.plot(xs, [s.forward_ns / 1e6 for s in steps], marker="o", markersize=3, label="forward")
    ax.plot(xs, [(s.sample_ns + s.detokenize_ns) / 1e6 for s in steps], marker=".", markersize=3,
            label="sampling + detokenize")
    ax.set_xlabel("decode step")
    ax.set_ylabel("ms")
    ax.set_ylim(bottom=0)
    ax.set_title("Decode time per step")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    return _svg(fig, "decode")


def no_cache_ratios(run: NoCacheRun) -> str:
    fig = _figure(7, 3.2)
    ax = fig.add_subplot()
    steps = [s for s in run.steps if s.step > 0]
    xs = [s.positions for s in steps]
    ax.plot(xs, [s.analytic_ratio for s in steps], color="black", label="estimate (FLOPs)")
    if any(s.flops_ratio for s in steps):
        ax.plot(xs, [s.flops_ratio or 0 for s in steps], "o", markersize=4, label="counted FLOPs")
    ax.plot(xs, [s.time_ratio or 0 for s in steps], "s", markersize=4, label="measured time")
    ax.set_xlabel("tokens recomputed per step")
    ax.set_ylabel("uncached / cached")
    ax.set_title("Without a KV cache, step by step")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    return _svg(fig, "no-cache")
