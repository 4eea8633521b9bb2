"""Rich rendering of a FlopsReport: model line, parameters and weight bytes, one table per phase. Reads records only.

A phase table has a formula column when the console is wide enough for it; narrower (an 80-column terminal), each
component's formula goes on a dim line under its name, so no cell is cut or wrapped mid-number.
"""

from __future__ import annotations

from rich.console import Console, Group
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from llmtrace.cli import formatting as fmt
from llmtrace.cli.render_moe import experts_line, reads_table, reads_title
from llmtrace.cli.tables import report_table
from llmtrace.tracer.analytic.estimate import ELEMENTWISE, MATMUL, PhaseEstimate, Totals
from llmtrace.tracer.analytic.flops_report import FlopsReport

_WEIGHTS_FROM = {"option": "", "file": " (the file's: each tensor at its stored size)",
                 "checkpoint": " (the checkpoint's)", "default": " (default; --dtype to change)"}
_KIND_STYLE = {MATMUL: "", ELEMENTWISE: "dim", "memory": "dim italic"}
_FORMULA_COLUMN_MIN_WIDTH = 110  # below this, formulas go under the component names


def render_flops(console: Console, r: FlopsReport, macs: bool) -> None:
    m, p = r.model, r.params
    head = ["(LM head tied: counted once)"] if p.tied else [f"+ LM head {fmt.count(p.lm_head)}"]
    weights = [f"{k} {fmt.nbytes(v)}" for k, v in r.weight_bytes.items()]
    # Each line as phrases that stay whole: at 80 columns a line breaks between them, never inside one
    lines = [
        [f"[bold]{escape(m.name)}[/] [dim]({escape(m.source)})[/]"],
        [f"  d={m.dim},", f"{m.n_layers} layers,", f"{m.n_heads} heads / {m.n_kv_heads} KV heads,",
         f"head dim {m.head_dim},", f"FFN {m.ffn_dim},", f"vocab {fmt.count(m.vocab_size)},",
         f"LM head {'tied to the embedding' if m.tie_embeddings else 'separate'}"],
        [f"Parameters [bold]{fmt.count(p.total)}[/] =", f"embedding {fmt.count(p.embedding)}",
         f"+ {m.n_layers} layers × {fmt.count(p.per_layer)}", f"+ final norm {fmt.count(p.final_norm)}", *head],
        [f"Weights: {weights[0]}", *(f"· {w}" for w in weights[1:]), "(int8/int4 include one fp16 scale per 32 values)"],
    ]
    if r.moe is not None:
        lines.insert(3, experts_line(p, r.moe))
    if r.checkpoint is not None:
        c = r.checkpoint
        match = "as the config gives" if c.n_params == p.total else f"config gives {fmt.count(p.total)}"
        lines.append([f"Checkpoint ({c.format}, {len(c.files)} file{'s' if len(c.files) != 1 else ''}):",
                      f"[bold]{fmt.count(c.n_params)}[/] parameters ({match}),", f"{fmt.bytes_both(c.total_bytes)}:",
                      ", ".join(f"{s.dtype} {fmt.count(s.params)}" for s in c.by_dtype)])
    unit = "MACs for matmuls (1 MAC = 2 FLOPs), FLOPs for elementwise work" if macs else "2 FLOPs per multiply-add"
    prompt = f"{r.prompt_len} tokens" + (f" (counted by the tokenizer of {escape(r.prompt_tokenizer)})"
                                         if r.prompt_tokenizer else "")
    other = "eager" if r.kernels == "fused" else "fused"
    lines += [
        [f"Counting: {unit};", "matmuls exact,", "elementwise work estimated", "(constants in README)."],
        [f"Weights {r.weights_dtype}{_WEIGHTS_FROM[r.weights_dtype_from]},", f"KV cache {r.kv_dtype},",
         f"activations {r.activation_dtype}.", f"Prompt {prompt},", f"{r.new_tokens} new tokens,", f"batch {r.batch}."],
        [*fmt.phrases(f"Kernels: {r.kernels_description}"), f"(--kernels {other}: the other)."],
    ]
    header = "\n".join(fmt.flow(line, console.width) for line in lines)
    g = r.generation
    formulas_apart = console.width >= _FORMULA_COLUMN_MIN_WIDTH
    # One print for everything: each console.print call has a fixed cost, and this command must answer in a blink.
    console.print(Group(
        Text.from_markup(header),
        Text.from_markup(f"\n[bold]Prefill of {r.prefill.new_tokens} tokens[/], batch {r.batch}"),
        _phase_table(r.prefill, macs, formulas_apart),
        Text.from_markup(_phase_notes(r.prefill.totals, macs, prefill=True, kernels=r.kernels)),
        Text.from_markup(f"\n[bold]One decode step at context L={r.decode_context}[/] (attends to "
                         f"{r.decode.kv_len} positions), batch {r.batch}"),
        _phase_table(r.decode, macs, formulas_apart),
        Text.from_markup(_phase_notes(r.decode.totals, macs, prefill=False, kernels=r.kernels)),
        *((Text.from_markup(reads_title(r.moe)), reads_table(r.moe)) if r.moe is not None else ()),
        Text.from_markup(f"\n[bold]Whole generation[/]: prefill of {g.prompt_len} + {g.decode_steps} decode steps "
                         f"(L={g.prompt_len}..{g.final_kv_len - 1}), summed step by step, batch {g.batch}"),
        _generation_table(r, macs),
        Text.from_markup(_generation_notes(r)),
    ))


def _flops(value: int, kind: str, macs: bool) -> str:
    """A figure in FLOPs, or in MACs (FLOPs / 2) for a matmul under --macs; elementwise work stays in FLOPs."""
    return fmt.flops(value, matmul_as_macs=macs and kind == MATMUL)


def _phase_table(phase: PhaseEstimate, macs: bool, formulas_apart: bool) -> Table:
    t = phase.totals
    table = report_table()
    table.add_column("component", no_wrap=formulas_apart)
    if formulas_apart:
        table.add_column("formula (one layer)")
    table.add_column("per layer", justify="right", no_wrap=True)
    table.add_column("all layers", justify="right", no_wrap=True)
    table.add_column("share", justify="right", no_wrap=True)
    for c in phase.components:
        style = _KIND_STYLE.get(c.kind, "")
        if formulas_apart:
            named = [c.label, c.formula]
        else:
            named = [Text.assemble(c.label, "\n", (f"  {c.formula}", "dim"))]
        table.add_row(*named, _flops(c.flops, c.kind, macs) if c.per_layer else "",
                      _flops(c.total_flops, c.kind, macs), fmt.share(c.total_flops, t.total_flops),
                      style=style, end_section=c is phase.components[-1])
    blank = [""] if formulas_apart else []
    table.add_row("matmuls", *blank, _flops(phase.per_layer_flops_of(MATMUL), MATMUL, macs),
                  _flops(t.matmul_flops, MATMUL, macs), fmt.share(t.matmul_flops, t.total_flops))
    table.add_row("elementwise (estimate)", *blank, _flops(phase.per_layer_flops_of(ELEMENTWISE), ELEMENTWISE, macs),
                  _flops(t.elementwise_flops, ELEMENTWISE, macs), fmt.share(t.elementwise_flops, t.total_flops))
    table.add_row("total", *blank, fmt.flops(t.per_layer_flops), fmt.flops(t.total_flops), "100%", style="bold")
    return table


def _phase_notes(t: Totals, macs: bool, prefill: bool, kernels: str) -> str:
    lines = []
    if prefill and kernels == "fused":
        lines.append(
            f"  Attention QKᵀ+PV: {_flops(t.attention_useful_flops, MATMUL, macs)} over the P causal pairs "
            f"only (P = T·(T+1)/2: fused kernels skip the masked tiles; --kernels eager computes all T²)."
        )
    elif prefill:
        lines.append(
            f"  Attention QKᵀ+PV: {_flops(t.attention_dense_flops, MATMUL, macs)} executed densely, "
            f"{_flops(t.attention_useful_flops, MATMUL, macs)} useful under the causal mask "
            f"({_flops(t.attention_masked_flops, MATMUL, macs)} on masked pairs); "
            f"useful total {fmt.flops(t.useful_flops)}."
        )
    lines += [
        f"  Bytes: weights {fmt.bytes_both(t.weight_bytes)}, KV read {fmt.bytes_both(t.kv_read_bytes)}, "
        f"KV written {fmt.bytes_both(t.kv_write_bytes)}, activations between kernels "
        f"{fmt.bytes_both(t.activation_bytes)}.",
        f"  Arithmetic intensity {fmt.intensity(t.arithmetic_intensity)} (FLOPs ÷ all bytes moved; "
        f"{fmt.intensity(t.weights_kv_intensity)} over weights + KV alone, the most any fusion could reach).",
    ]
    return "\n".join(lines)


def _generation_table(r: FlopsReport, macs: bool) -> Table:
    g = r.generation
    table = report_table()
    table.add_column("component")
    for name in ("prefill", "decode steps", "total", "share"):
        table.add_column(name, justify="right", no_wrap=True)
    total = g.totals.total_flops
    for c in g.components:
        table.add_row(c.label, _flops(c.prefill_flops, c.kind, macs), _flops(c.decode_flops, c.kind, macs),
                      _flops(c.total_flops, c.kind, macs), fmt.share(c.total_flops, total),
                      style=_KIND_STYLE.get(c.kind, ""), end_section=c is g.components[-1])
    for label, kind, pre, dec, tot in (
        ("matmuls", MATMUL, g.prefill_totals.matmul_flops, g.decode_totals.matmul_flops, g.totals.matmul_flops),
        ("elementwise (estimate)", ELEMENTWISE, g.prefill_totals.elementwise_flops,
         g.decode_totals.elementwise_flops, g.totals.elementwise_flops),
    ):
        table.add_row(label, _flops(pre, kind, macs), _flops(dec, kind, macs), _flops(tot, kind, macs),
                      fmt.share(tot, total))
    table.add_row("total", fmt.flops(g.prefill_totals.total_flops), fmt.flops(g.decode_totals.total_flops),
                  fmt.flops(total), "100%", style="bold")
    return table


def _generation_notes(r: FlopsReport) -> str:
    g = r.generation
    lines = []
    if g.exceeds_max_seq_len:
        lines.append(f"  [yellow]Note: {fmt.count(g.final_kv_len)} positions exceed the model's trained context "
                     f"({fmt.count(r.model.max_seq_len)}).[/]")
    lines += [
        f"  Bytes: weights {fmt.bytes_both(g.totals.weight_bytes)}, KV read {fmt.bytes_both(g.totals.kv_read_bytes)}. "
        f"Arithmetic intensity {fmt.intensity(g.totals.arithmetic_intensity)} "
        f"(prefill {fmt.intensity(g.prefill_totals.arithmetic_intensity)}, "
        f"decode steps {fmt.intensity(g.decode_totals.arithmetic_intensity)}).",
        "",
        f"Rule of thumb 2 × {'active ' if r.moe is not None else ''}parameters = {fmt.flops(r.two_x_params)} per token. Counted: this decode step "
        f"{fmt.flops(r.decode_step_flops_per_token)} per token ({fmt.times(r.decode_vs_rule, fmt.EXACT)}), the whole "
        f"generation {fmt.flops(r.generation_flops_per_token)} per token fed "
        f"({fmt.times(r.generation_vs_rule, fmt.EXACT)}). The gap: the embedding is a lookup (0 FLOPs), the LM head "
        "runs on the last position only, attention grows with the context.",
    ]
    return "\n".join(lines)
