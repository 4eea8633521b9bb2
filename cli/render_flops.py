"""Rich rendering of a FlopsReport: model line, parameters and weight bytes, one table per phase. Reads records only."""

from __future__ import annotations

from rich.console import Console
from rich.markup import escape

from llmtrace.cli import units
from llmtrace.cli.text_table import TextTable
from llmtrace.tracer.analytic.estimate import ELEMENTWISE, MATMUL, PhaseEstimate, Totals
from llmtrace.tracer.analytic.flops_report import FlopsReport

_WEIGHTS_FROM = {"option": "", "checkpoint": " (the checkpoint's)", "default": " (default; --dtype to change)"}
_KIND_STYLE = {MATMUL: "", ELEMENTWISE: "dim", "memory": "dim italic"}


def render_flops(console: Console, r: FlopsReport, macs: bool) -> None:
    m, p = r.model, r.params
    head = " (LM head tied: counted once)" if p.tied else f" + LM head {p.lm_head:,}"
    lines = [
        f"[bold]{escape(m.name)}[/] [dim]({escape(m.source)})[/]",
        f"  d={m.dim}, {m.n_layers} layers, {m.n_heads} heads / {m.n_kv_heads} KV heads, head dim {m.head_dim}, "
        f"FFN {m.ffn_dim}, vocab {m.vocab_size:,}, LM head {'tied to the embedding' if m.tie_embeddings else 'separate'}",
        f"Parameters [bold]{p.total:,}[/] = embedding {p.embedding:,} + {m.n_layers} layers × {p.per_layer:,} "
        f"+ final norm {p.final_norm:,}{head}",
        "Weights: " + " · ".join(f"{k} {units.gb(v)}" for k, v in r.weight_bytes.items())
        + " (int8/int4 include one fp16 scale per 32 values)",
    ]
    if r.checkpoint is not None:
        c = r.checkpoint
        parts = ", ".join(f"{s.dtype} {s.params:,}" for s in c.by_dtype)
        match = "as the config gives" if c.n_params == p.total else f"config gives {p.total:,}"
        lines.append(
            f"Checkpoint ({c.format}, {len(c.files)} file{'s' if len(c.files) != 1 else ''}): [bold]{c.n_params:,}[/] "
            f"parameters ({match}), {units.bytes_both(c.total_bytes)}: {parts}"
        )
    unit = "MACs for matmuls (1 MAC = 2 FLOPs), FLOPs for elementwise work" if macs else "2 FLOPs per multiply-add"
    prompt = f"{r.prompt_len} tokens" + (f" (counted by the tokenizer of {escape(r.prompt_tokenizer)})"
                                         if r.prompt_tokenizer else "")
    lines += [
        f"Counting: {unit}; matmuls exact, elementwise work estimated (constants in README).",
        f"Weights {r.weights_dtype}{_WEIGHTS_FROM[r.weights_dtype_from]}, KV cache {r.kv_dtype}, "
        f"activations {r.activation_dtype}. "
        f"Prompt {prompt}, {r.new_tokens} new tokens, batch {r.batch}.",
        f"Kernels: {r.kernels_description} (--kernels {'eager' if r.kernels == 'fused' else 'fused'}: the other).",
    ]
    g = r.generation
    width = console.width
    # One print for everything: each console.print call has a fixed cost, and this command must answer in a blink.
    console.print(
        "\n".join(lines),
        f"\n[bold]Prefill of {r.prefill.new_tokens} tokens[/], batch {r.batch}",
        _phase_table(r.prefill, macs).render(width),
        _phase_notes(r.prefill.totals, macs, prefill=True, kernels=r.kernels),
        f"\n[bold]One decode step at context L={r.decode_context}[/] (attends to {r.decode.kv_len} positions), "
        f"batch {r.batch}",
        _phase_table(r.decode, macs).render(width),
        _phase_notes(r.decode.totals, macs, prefill=False, kernels=r.kernels),
        f"\n[bold]Whole generation[/]: prefill of {g.prompt_len} + {g.decode_steps} decode steps "
        f"(L={g.prompt_len}..{g.final_kv_len - 1}), summed step by step, batch {g.batch}",
        _generation_table(r, macs).render(width),
        _generation_notes(r),
        sep="\n", soft_wrap=True,
    )


def _phase_table(phase: PhaseEstimate, macs: bool) -> TextTable:
    t = phase.totals
    table = TextTable(["component", "formula (one layer)", "per layer", "all layers", "share"], "<<>>>", fold=1)
    for c in phase.components:
        table.add_row(
            c.label, c.formula, units.flops(c.flops, c.kind, macs) if c.per_layer else "",
            units.flops(c.total_flops, c.kind, macs), units.share(c.total_flops, t.total_flops),
            style=_KIND_STYLE.get(c.kind, ""),
        )
    table.add_separator()
    table.add_row("matmuls", "", units.flops(_layer(phase, MATMUL), MATMUL, macs),
                  units.flops(t.matmul_flops, MATMUL, macs), units.share(t.matmul_flops, t.total_flops))
    table.add_row("elementwise (estimate)", "", units.flops(_layer(phase, ELEMENTWISE), ELEMENTWISE, macs),
                  units.flops(t.elementwise_flops, ELEMENTWISE, macs), units.share(t.elementwise_flops, t.total_flops))
    table.add_row("total", "", units.si(t.per_layer_flops, "FLOP"), units.si(t.total_flops, "FLOP"), "100%",
                  style="bold")
    return table


def _layer(phase: PhaseEstimate, kind: str) -> int:
    return sum(c.flops for c in phase.components if c.per_layer and c.kind == kind)


def _phase_notes(t: Totals, macs: bool, prefill: bool, kernels: str) -> str:
    lines = []
    if prefill and kernels == "fused":
        lines.append(
            f"  Attention QKᵀ+PV: {units.flops(t.attention_useful_flops, MATMUL, macs)} over the P causal pairs "
            f"only (P = T·(T+1)/2: fused kernels skip the masked tiles; --kernels eager computes all T²)."
        )
    elif prefill:
        skipped = t.attention_dense_flops - t.attention_useful_flops
        lines.append(
            f"  Attention QKᵀ+PV: {units.flops(t.attention_dense_flops, MATMUL, macs)} executed densely, "
            f"{units.flops(t.attention_useful_flops, MATMUL, macs)} useful under the causal mask "
            f"({units.flops(skipped, MATMUL, macs)} on masked pairs); useful total {units.si(t.useful_flops, 'FLOP')}."
        )
    lines += [
        f"  Bytes: weights {units.bytes_both(t.weight_bytes)}, KV read {units.bytes_both(t.kv_read_bytes)}, "
        f"KV written {units.bytes_both(t.kv_write_bytes)}, activations between kernels "
        f"{units.bytes_both(t.activation_bytes)}.",
        f"  Arithmetic intensity {t.arithmetic_intensity:,.1f} FLOP/B (FLOPs ÷ all bytes moved; "
        f"{t.weights_kv_intensity:,.1f} over weights + KV alone, the most any fusion could reach).",
    ]
    return "\n".join(lines)


def _generation_table(r: FlopsReport, macs: bool) -> TextTable:
    g = r.generation
    table = TextTable(["component", "prefill", "decode steps", "total", "share"], "<>>>>")
    total = g.totals.total_flops
    for c in g.components:
        table.add_row(c.label, units.flops(c.prefill_flops, c.kind, macs), units.flops(c.decode_flops, c.kind, macs),
                      units.flops(c.total_flops, c.kind, macs), units.share(c.total_flops, total),
                      style=_KIND_STYLE.get(c.kind, ""))
    table.add_separator()
    for label, kind, pre, dec, tot in (
        ("matmuls", MATMUL, g.prefill_totals.matmul_flops, g.decode_totals.matmul_flops, g.totals.matmul_flops),
        ("elementwise (estimate)", ELEMENTWISE, g.prefill_totals.elementwise_flops,
         g.decode_totals.elementwise_flops, g.totals.elementwise_flops),
    ):
        table.add_row(label, units.flops(pre, kind, macs), units.flops(dec, kind, macs), units.flops(tot, kind, macs),
                      units.share(tot, total))
    table.add_row("total", units.si(g.prefill_totals.total_flops, "FLOP"),
                  units.si(g.decode_totals.total_flops, "FLOP"), units.si(total, "FLOP"), "100%", style="bold")
    return table


def _generation_notes(r: FlopsReport) -> str:
    g = r.generation
    lines = []
    if g.exceeds_max_seq_len:
        lines.append(f"  [yellow]Note: {g.final_kv_len:,} positions exceed the model's trained context "
                     f"({r.model.max_seq_len:,}).[/]")
    lines += [
        f"  Bytes: weights {units.bytes_both(g.totals.weight_bytes)}, KV read {units.bytes_both(g.totals.kv_read_bytes)}. "
        f"Arithmetic intensity {g.totals.arithmetic_intensity:,.1f} FLOP/B "
        f"(prefill {g.prefill_totals.arithmetic_intensity:,.1f}, decode steps {g.decode_totals.arithmetic_intensity:,.1f}).",
        "",
        f"Rule of thumb 2 × parameters = {units.si(r.two_x_params, 'FLOP')} per token. Counted: this decode step "
        f"{units.si(r.decode_step_flops_per_token, 'FLOP')} per token ({r.decode_vs_rule:.3f}×), the whole generation",
        f"{units.si(r.generation_flops_per_token, 'FLOP')} per token fed ({r.generation_vs_rule:.3f}×). The gap: the "
        "embedding is a lookup (0 FLOPs), the LM head runs on the last position only, attention grows with the context.",
    ]
    return "\n".join(lines)
