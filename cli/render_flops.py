"""Rich rendering of a FlopsReport: model line, parameters and weight bytes, one table per phase. Reads records only."""

from __future__ import annotations

from rich import box
from rich.console import Console
from rich.table import Table

from cli import units
from tracer.estimate import ELEMENTWISE, MATMUL, ComponentCost, PhaseEstimate, Totals
from tracer.flops_report import FlopsReport

_KIND_STYLE = {MATMUL: "", ELEMENTWISE: "dim", "memory": "dim italic"}


def render_flops(console: Console, r: FlopsReport, macs: bool) -> None:
    m, p = r.model, r.params
    console.print(
        f"[bold]{m.name}[/]  d={m.dim}, {m.n_layers} layers, {m.n_heads} heads ({m.n_kv_heads} KV heads), "
        f"head dim {m.head_dim}, FFN {m.ffn_dim}, vocab {m.vocab_size}, "
        f"LM head {'tied to the embedding' if m.tie_embeddings else 'separate'}  [dim]({m.source})[/]"
    )
    head = "tied, counted once" if p.tied else f"LM head {p.lm_head:,}"
    console.print(
        f"Parameters: [bold]{p.total:,}[/] (embedding {p.embedding:,}; {head}; {p.per_layer:,} per layer). "
        "Weights: " + " · ".join(f"{k} {units.gb(v)}" for k, v in r.weight_bytes.items())
    )
    if r.checkpoint is not None:
        c = r.checkpoint
        parts = ", ".join(f"{s.dtype} {s.params:,}" for s in c.by_dtype)
        match = "matches the config" if c.n_params == p.total else f"config gives {p.total:,}"
        console.print(
            f"Checkpoint ({c.format}, {len(c.files)} file{'s' if len(c.files) != 1 else ''}): "
            f"[bold]{c.n_params:,}[/] parameters ({match}), {units.bytes_both(c.total_bytes)}; {parts}"
        )
    unit = "MACs for matmuls (1 MAC = 2 FLOPs), FLOPs for elementwise work" if macs else "2 FLOPs per multiply-add"
    prompt = f"{r.prompt_len} tokens" + (f" (counted by {r.prompt_tokenizer})" if r.prompt_tokenizer else "")
    console.print(
        f"Convention: {unit}; matmul figures exact, elementwise figures estimated (constants in README). "
        f"Dtypes: weights {r.dtypes.weights}, KV {r.dtypes.kv}, activations {r.dtypes.activations}. "
        f"Batch {r.batch}, prompt {prompt}, {r.new_tokens} new tokens."
    )
    console.print(_phase_table(r.prefill, f"Prefill of {r.prefill.new_tokens} tokens", macs))
    _phase_notes(console, r.prefill.totals, macs, prefill=True)
    console.print(_phase_table(r.decode, f"One decode step at context L={r.decode_context} "
                                          f"(attends to {r.decode.kv_len} positions)", macs))
    _phase_notes(console, r.decode.totals, macs, prefill=False)
    console.print(_generation_table(r, macs))
    _generation_notes(console, r, macs)


def _phase_table(phase: PhaseEstimate, title: str, macs: bool) -> Table:
    t = phase.totals
    table = Table(title=f"[bold]{title}[/], batch {phase.batch}", title_justify="left", box=box.SIMPLE_HEAD,
                  padding=(0, 1), show_footer=False)
    table.add_column("component", no_wrap=True)
    table.add_column("formula (one layer)", overflow="fold")
    table.add_column("per layer", justify="right", no_wrap=True)
    table.add_column("all layers", justify="right", no_wrap=True)
    table.add_column("share", justify="right", no_wrap=True)
    for c in phase.components:
        table.add_row(
            c.label, c.formula, units.flops(c.flops, c.kind, macs) if c.per_layer else "",
            units.flops(c.total_flops, c.kind, macs), units.share(c.total_flops, t.total_flops),
            style=_KIND_STYLE.get(c.kind, ""),
        )
    table.add_section()
    table.add_row("matmuls", "", units.flops(_layer(phase, MATMUL), MATMUL, macs),
                  units.flops(t.matmul_flops, MATMUL, macs), units.share(t.matmul_flops, t.total_flops))
    table.add_row("elementwise (estimate)", "", units.flops(_layer(phase, ELEMENTWISE), ELEMENTWISE, macs),
                  units.flops(t.elementwise_flops, ELEMENTWISE, macs), units.share(t.elementwise_flops, t.total_flops))
    table.add_row("[bold]total[/]", "", units.si(t.per_layer_flops, "FLOP"), f"[bold]{units.si(t.total_flops, 'FLOP')}[/]",
                  "100%")
    return table


def _layer(phase: PhaseEstimate, kind: str) -> int:
    return sum(c.flops for c in phase.components if c.per_layer and c.kind == kind)


def _phase_notes(console: Console, t: Totals, macs: bool, prefill: bool) -> None:
    if prefill:
        skipped = t.attention_dense_flops - t.attention_useful_flops
        console.print(
            f"  Attention QKᵀ+PV executed densely: {units.flops(t.attention_dense_flops, MATMUL, macs)}; "
            f"the causal mask keeps {units.flops(t.attention_useful_flops, MATMUL, macs)} "
            f"({units.flops(skipped, MATMUL, macs)} spent on masked pairs). "
            f"Useful total: {units.si(t.useful_flops, 'FLOP')}."
        )
    console.print(
        f"  Bytes: weights {units.bytes_both(t.weight_bytes)}, KV read {units.bytes_both(t.kv_read_bytes)}, "
        f"KV written {units.bytes_both(t.kv_write_bytes)}, activations ~{units.bytes_both(t.activation_bytes)}. "
        f"Arithmetic intensity {t.arithmetic_intensity:,.1f} FLOP/B over weights+KV "
        f"({t.arithmetic_intensity_with_activations:,.1f} with activations)."
    )


def _generation_table(r: FlopsReport, macs: bool) -> Table:
    g = r.generation
    title = (f"[bold]Whole generation[/]: prefill {g.prompt_len} + {g.decode_steps} decode steps "
             f"(L={g.prompt_len}..{g.final_kv_len - 1}), summed step by step, batch {g.batch}")
    table = Table(title=title, title_justify="left", box=box.SIMPLE_HEAD, padding=(0, 1))
    table.add_column("component", no_wrap=True)
    table.add_column("prefill", justify="right", no_wrap=True)
    table.add_column("decode steps", justify="right", no_wrap=True)
    table.add_column("total", justify="right", no_wrap=True)
    table.add_column("share", justify="right", no_wrap=True)
    total = g.totals.total_flops
    for c in g.components:
        table.add_row(c.label, units.flops(c.prefill_flops, c.kind, macs), units.flops(c.decode_flops, c.kind, macs),
                      units.flops(c.total_flops, c.kind, macs), units.share(c.total_flops, total),
                      style=_KIND_STYLE.get(c.kind, ""))
    table.add_section()
    for label, kind, pre, dec, tot in (
        ("matmuls", MATMUL, g.prefill_totals.matmul_flops, g.decode_totals.matmul_flops, g.totals.matmul_flops),
        ("elementwise (estimate)", ELEMENTWISE, g.prefill_totals.elementwise_flops,
         g.decode_totals.elementwise_flops, g.totals.elementwise_flops),
    ):
        table.add_row(label, units.flops(pre, kind, macs), units.flops(dec, kind, macs), units.flops(tot, kind, macs),
                      units.share(tot, total))
    table.add_row("[bold]total[/]", units.si(g.prefill_totals.total_flops, "FLOP"),
                  units.si(g.decode_totals.total_flops, "FLOP"), f"[bold]{units.si(total, 'FLOP')}[/]", "100%")
    return table


def _generation_notes(console: Console, r: FlopsReport, macs: bool) -> None:
    g, rt = r.generation, r.rule_of_thumb
    if g.exceeds_max_seq_len:
        console.print(f"  [yellow]Note: {g.final_kv_len} positions exceed the model's trained context "
                      f"({r.model.max_seq_len}).[/]")
    console.print(
        f"  Bytes over the generation: weights {units.bytes_both(g.totals.weight_bytes)}, "
        f"KV read {units.bytes_both(g.totals.kv_read_bytes)}; arithmetic intensity "
        f"{g.totals.arithmetic_intensity:,.1f} FLOP/B (prefill {g.prefill_totals.arithmetic_intensity:,.1f}, "
        f"decode {g.decode_totals.arithmetic_intensity:,.1f})."
    )
    console.print(
        f"Rule of thumb 2 × parameters = {units.si(rt.two_x_params, 'FLOP')} per token. "
        f"This decode step: {units.si(rt.decode_step_flops_per_token, 'FLOP')} per token "
        f"({rt.decode_ratio:.3f}×); whole generation: {units.si(rt.generation_flops_per_token, 'FLOP')} per token fed "
        f"({rt.generation_ratio:.3f}×). The embedding lookup costs 0 FLOPs, the LM head runs once per sequence, "
        "and attention grows with the context."
    )
