"""Two traces side by side: is it the same model, what else differs, where the time, FLOPs and bytes differ per phase
and per stage role, and the token where the two generations part.

Pure functions of the records (no torch), so two saved traces compare anywhere. Per-step figures: the prefill is one
step; decode figures are the mean over each run's decode steps (the runs may have generated different counts).
Ratios are B / A (None where A is zero or one side lacks the row).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Iterable

from llmtrace.tracer.trace.records import DECODE, PREFILL, StageRecord
from llmtrace.tracer.trace.run_trace import Trace
from llmtrace.tracer.trace.summary import StageTotals, role_rows, stage_totals

PHASE_ROLE = ""  # the role of a phase's whole-forward row
DIFF_SCHEMA = "llmtrace.diff/1"  # `diff --json` (tracer/trace/diff_schema.json)

# Settings worth naming when they differ (the prompt, sampling and how the run was traced all change the numbers).
_SETTINGS = ("prompt", "chat", "max_new_tokens", "temperature", "top_k", "top_p", "min_p", "repetition_penalty", "seed",
             "dtype", "device", "threads", "trace", "staged", "warmup")
_ENVIRONMENT = ("device_name", "device", "threads", "dtype", "torch_version", "llmtrace_version")


@dataclass(frozen=True, slots=True)
class FieldDifference:
    """One named field whose value differs between A and B (values as text)."""

    name: str  # e.g. "config.n_layers", "settings.dtype", "environment.device_name"
    a: str
    b: str


@dataclass(frozen=True, slots=True)
class Figures:
    """One run's figures for one row, per step."""

    steps: int  # steps the figures are the mean of (1 for the prefill)
    calls: int  # stage calls per step (0 for a phase row with tracing off)
    time_ns: float  # forward time per step (phase rows) or the stage's own time per step (role rows)
    flops: float
    bytes_read: float
    bytes_written: float


@dataclass(frozen=True, slots=True)
class DiffRow:
    """One phase (role == PHASE_ROLE: the whole forward) or one stage role within it, for A and B."""

    phase: str
    role: str
    kind: str
    a: Figures | None  # None: this run has no such row (a role of the other path, or no decode step)
    b: Figures | None
    time_ratio: float | None  # B / A
    flops_ratio: float | None
    bytes_ratio: float | None  # of bytes read + written


@dataclass(frozen=True, slots=True)
class Divergence:
    """Where the generated tokens part: the first generated position at which they differ."""

    common_tokens: int  # generated tokens both runs agree on, from the first
    a_tokens: int  # tokens each run generated
    b_tokens: int
    index: int | None  # 0-based generated position of the first difference; None: one is a prefix of the other
    a_token_id: int | None
    b_token_id: int | None
    a_piece: str
    b_piece: str
    a_probability: float | None  # of the token each drew there, after its filters
    b_probability: float | None
    common_text: str  # the pieces both generated before they part


@dataclass(frozen=True, slots=True)
class TraceDiff:
    same_model: bool  # every model config field equal
    model_differences: tuple[FieldDifference, ...]
    setting_differences: tuple[FieldDifference, ...]
    environment_differences: tuple[FieldDifference, ...]
    rows: tuple[DiffRow, ...]  # per phase: the phase row, then its roles (A's order, then roles only B has)
    divergence: Divergence
    schema: str = DIFF_SCHEMA  # `--json` writes it first


def diff_traces(a: Trace, b: Trace) -> TraceDiff:
    model = _differences("config", a.config, b.config, [f.name for f in fields(a.config) if f.name != "source"])
    return TraceDiff(
        same_model=not model,
        model_differences=model,
        setting_differences=_differences("settings", a.settings, b.settings, _SETTINGS),
        environment_differences=_differences("environment", a.environment, b.environment, _ENVIRONMENT),
        rows=tuple(row for phase in (PREFILL, DECODE) for row in _phase_rows(a, b, phase)),
        divergence=_divergence(a, b),
    )


def _differences(prefix: str, a: object, b: object, names: Iterable[str]) -> tuple[FieldDifference, ...]:
    return tuple(FieldDifference(f"{prefix}.{name}", _text(getattr(a, name)), _text(getattr(b, name)))
                 for name in names if getattr(a, name) != getattr(b, name))


def _text(value: object) -> str:
    return "none" if value is None else str(value)


def _phase_rows(a: Trace, b: Trace, phase: str) -> list[DiffRow]:
    steps_a = [s for s in a.steps if s.phase == phase]
    steps_b = [s for s in b.steps if s.phase == phase]
    stages_a, stages_b = a.stages_of(phase), b.stages_of(phase)
    rows = [_row(phase, PHASE_ROLE, "forward",
                 _phase_figures(len(steps_a), sum(s.forward_ns for s in steps_a), stages_a),
                 _phase_figures(len(steps_b), sum(s.forward_ns for s in steps_b), stages_b))]
    roles_a = {r.role: r for r in role_rows(stages_a)}
    roles_b = {r.role: r for r in role_rows(stages_b)}
    for role in [*roles_a, *(r for r in roles_b if r not in roles_a)]:
        ra, rb = roles_a.get(role), roles_b.get(role)
        kind = (ra or rb).kind  # type: ignore[union-attr]
        rows.append(_row(phase, role, kind,
                         _figures(len(steps_a), ra.totals, ra.totals.stage_ns) if ra and steps_a else None,
                         _figures(len(steps_b), rb.totals, rb.totals.stage_ns) if rb and steps_b else None))
    return rows


def _phase_figures(steps: int, forward_ns: int, stages: tuple[StageRecord, ...]) -> Figures | None:
    return _figures(steps, stage_totals(stages), forward_ns) if steps else None


def _figures(steps: int, totals: StageTotals, time_ns: int) -> Figures:
    return Figures(steps=steps, calls=totals.calls // steps, time_ns=time_ns / steps, flops=totals.flops / steps,
                   bytes_read=totals.bytes_read / steps, bytes_written=totals.bytes_written / steps)


def _row(phase: str, role: str, kind: str, a: Figures | None, b: Figures | None) -> DiffRow:
    def ratio(field: str) -> float | None:
        if a is None or b is None:
            return None
        x = getattr(a, field) if field != "bytes" else a.bytes_read + a.bytes_written
        y = getattr(b, field) if field != "bytes" else b.bytes_read + b.bytes_written
        return y / x if x else None

    return DiffRow(phase, role, kind, a, b, ratio("time_ns"), ratio("flops"), ratio("bytes"))


def _divergence(a: Trace, b: Trace) -> Divergence:
    ids_a, ids_b = [s.token_id for s in a.steps], [s.token_id for s in b.steps]
    common = 0
    while common < min(len(ids_a), len(ids_b)) and ids_a[common] == ids_b[common]:
        common += 1
    parted = common < len(ids_a) and common < len(ids_b)
    sa = a.steps[common] if parted else None
    sb = b.steps[common] if parted else None
    return Divergence(
        common_tokens=common, a_tokens=len(ids_a), b_tokens=len(ids_b), index=common if parted else None,
        a_token_id=sa.token_id if sa else None, b_token_id=sb.token_id if sb else None,
        a_piece=sa.piece if sa else "", b_piece=sb.piece if sb else "",
        a_probability=sa.probability if sa else None, b_probability=sb.probability if sb else None,
        common_text="".join(s.text for s in a.steps[:common]),
    )
