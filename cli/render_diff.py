"""`llmtrace diff`: two traces side by side, rendered from a TraceDiff record (llmtrace.tracer.trace.diff)."""

from __future__ import annotations

from rich.console import Console
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from llmtrace.cli import formatting as fmt
from llmtrace.cli.render_run import section
from llmtrace.tracer.core.contract import short_label
from llmtrace.tracer.trace.diff import PHASE_ROLE, DiffRow, Figures, TraceDiff
from llmtrace.tracer.trace.records import PREFILL

_SHARED_LABELS = frozenset({"attention_norm", "ffn_norm", "attn_residual", "ffn_residual"})


def render_diff(console: Console, diff: TraceDiff, name_a: str, name_b: str) -> None:
    console.print(f"[bold]A[/] {escape(name_a)}\n[bold]B[/] {escape(name_b)}")
    console.print(_identity(diff))
    for phase in dict.fromkeys(row.phase for row in diff.rows):
        rows = [r for r in diff.rows if r.phase == phase]
        if rows[0].a is None and rows[0].b is None:
            continue
        console.print(section(_phase_title(phase, rows[0]), _table(rows)))
    console.print(section("Where the generations part", Text.from_markup(_divergence(diff))))


def _identity(diff: TraceDiff) -> Text:
    lines = []
    if diff.same_model:
        lines.append("[green]same model[/] (every config field equal)")
    else:
        changed = ", ".join(f"{d.name.removeprefix('config.')} {d.a} vs {d.b}" for d in diff.model_differences)
        lines.append(f"[yellow]different models[/]: {escape(changed)}")
    for label, items in (("settings", diff.setting_differences), ("environment", diff.environment_differences)):
        if items:
            shown = "; ".join(_field(d.name.split(".", 1)[1], d.a, d.b) for d in items)
            lines.append(f"{label} differ: {escape(shown)}")
        else:
            lines.append(f"[dim]{label}: the same[/]")
    return Text.from_markup("\n".join(lines))


def _field(name: str, a: str, b: str) -> str:
    if name != "prompt":
        return f"{name} {a} vs {b}"
    return f"prompt {_quoted(a)} vs {_quoted(b)}"


def _quoted(text: str, width: int = 24) -> str:
    return repr(text if len(text) <= width else text[: width - 1] + "…")


def _phase_title(phase: str, row: DiffRow) -> str:
    def steps(f: Figures | None) -> str:
        return "-" if f is None else str(f.steps)

    if phase == PREFILL:
        return "Prefill  one forward over the prompt; × = B/A"
    return f"Decode  per step, mean of A {steps(row.a)} / B {steps(row.b)} steps; × = B/A"


def _table(rows: list[DiffRow]) -> Table:
    table = Table(show_edge=False, pad_edge=False, box=None)
    for name in ("stage", "A time", "B time", "×", "A FLOPs", "×", "bytes ×"):
        table.add_column(name, justify="left" if name == "stage" else "right", no_wrap=True)
    for row in rows:
        phase_row = row.role == PHASE_ROLE
        table.add_row(
            "forward" if phase_row else _label(row.role),
            _time(row.a), _time(row.b), _ratio(row.time_ratio),
            *_costs(row),
            style="bold" if phase_row else None, end_section=phase_row,
        )
    return table


def _costs(row: DiffRow) -> tuple[str, str, str]:
    """A's FLOPs with the B/A ratios of FLOPs and bytes; a row only B has shows B's FLOPs, marked (--json: all)."""
    if row.a is None and row.b is not None:
        return f"[dim]B {fmt.flops(row.b.flops)}[/]", "-", "-"
    if row.a is None:
        return "-", "-", "-"
    return fmt.flops(row.a.flops), _ratio(row.flops_ratio), _ratio(row.bytes_ratio)


def _label(role: str) -> str:
    label = short_label(role)
    if role in _SHARED_LABELS:
        label += " (FFN)" if role.startswith("ffn") else " (attn)"
    return label


def _time(f: Figures | None) -> str:
    return "-" if f is None else fmt.duration_ns(f.time_ns)


def _ratio(value: float | None) -> str:
    return "-" if value is None else fmt.times(value)


def _divergence(diff: TraceDiff) -> str:
    d = diff.divergence
    agreed = f"the first {d.common_tokens} generated token{'s' if d.common_tokens != 1 else ''} agree"
    if d.common_tokens:
        agreed += f" ({escape(repr(d.common_text))})"
    if d.index is None:
        if d.a_tokens == d.b_tokens:
            return f"identical generations: {agreed}"
        longer = "A" if d.a_tokens > d.b_tokens else "B"
        return f"{agreed}; then {longer} goes on ({d.a_tokens} vs {d.b_tokens} tokens)"

    def drew(piece: str, token_id: int | None, p: float | None) -> str:
        prob = "" if p is None else f", p {fmt.probability(p)}"
        return f"[bold]{escape(fmt.piece(piece))}[/] (id {token_id}{prob})"

    return (f"{agreed}; at generated token {d.index + 1} A drew {drew(d.a_piece, d.a_token_id, d.a_probability)}, "
            f"B drew {drew(d.b_piece, d.b_token_id, d.b_probability)}")
