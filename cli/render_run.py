"""`llmtrace run`, sections 1-5 of the journey: tokenization, embedding, positions, layers, LM head.

Renderers read trace records only (tracer/trace/records.py, tracer/trace/summary.py); they compute nothing but
display arithmetic.
"""

from __future__ import annotations

import math
from typing import Sequence

from rich.console import Console, Group
from rich.markup import escape
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from llmtrace.cli import formatting as fmt
from llmtrace.cli.render_kernels import detail_lines, dtype_name, kernel_line
from llmtrace.cli.tables import natural_width
from llmtrace.tracer.analytic.tensor_parallel import vocab_slice
from llmtrace.tracer.core.config import ModelConfig
from llmtrace.tracer.core.contract import short_label
from llmtrace.tracer.hardware.kernel_choice import KernelChoice
from llmtrace.tracer.trace.records import (
    MATMUL_KINDS,
    CandidateRecord,
    RopeRecord,
    RunSettings,
    StageRecord,
    StepRecord,
    TokenizationRecord,
)
from llmtrace.tracer.trace.report import embedding_table_bytes
from llmtrace.tracer.trace.summary import layer_rows, stage_totals

MAX_TOKEN_ROWS = 48
MAX_CANDIDATES = 10


PANEL_FRAME = 4  # columns a section's panel takes around its body: two borders, two spaces of padding


def section(title: str, body: object, subtitle: str | None = None) -> Panel:
    return Panel(body, title=f"[bold]{title}[/]", title_align="left", subtitle=subtitle, subtitle_align="right")


def render_header(console: Console, config: ModelConfig, weight_format: str, load_seconds: float, device: str,
                  threads: int, dtype: str, dry_run: bool, weights_note: str = "") -> None:
    """Two lines, before the kernels line: the model (its name as every view writes it, and its shape) and how it
    was loaded. The shape's other figures (head dim, vocabulary, a tied head) are in sections 2, 3 and 5, the
    checkpoint's path in the trace (`model.source`). `weights_note`: why the weights are held as they are, when
    that says more than the kernels line (a matrix type the named kernel cannot run)."""
    window = [phrase] if (phrase := fmt.window_label(config)) else []
    moe = config.moe
    ffn = (f"FFN {config.ffn_dim}" if moe is None else
           f"{moe.n_experts} experts of FFN {config.ffn_dim}, {moe.experts_per_token} per token")
    model = [f"[bold]{escape(config.name)}[/]", f"· {config.n_layers} layers", f"· dim {config.dim}",
             f"· {config.n_heads} heads ({config.n_kv_heads} KV)", f"· {ffn}", *window]
    if dry_run:  # the loader's format says "dry run (meta device) fp32" already
        how = [escape(weight_format)]
    else:
        short = dtype_name(dtype)
        how = [escape(weight_format), *([] if short in weight_format else [f"· {short}"]), f"· {device}",
               f"· {threads} thread{'s' if threads != 1 else ''}", f"· loaded in {fmt.duration_s(load_seconds)}"]
    # each line broken only between its phrases at the console's width (an 80-column terminal)
    lines = [fmt.flow(model, console.width), fmt.flow([f"[dim]{phrase}[/]" for phrase in how], console.width)]
    if weights_note:
        lines.append(f"[dim]{escape(weights_note)}[/]")
    console.print("\n".join(lines))


def render_kernel_choice(console: Console, choice: KernelChoice | None, dtype: str, detail: str = "") -> None:
    """The kernels in one short line under the header (cli/render_kernels.py), and with `--detail kernels` the
    details; nothing when no choice was recorded (an older trace)."""
    if choice is None:
        return
    lines = [kernel_line(choice, dtype)] + (detail_lines(choice) if detail == "kernels" else [])
    console.print(Text("\n".join(line for line in lines if line), style="dim"))


# ---- 1 tokenization ---------------------------------------------------------------------------------------------


def render_tokenization(console: Console, record: TokenizationRecord | None, prompt_tokens: int,
                        tokens_given: bool = False) -> None:
    """`tokens_given`: a dry run's prompt length came from --prompt-len, not from the prompt's characters."""
    if record is None:
        why = "as --prompt-len says" if tokens_given else "one per character of the prompt; set --prompt-len"
        console.print(section("1 · Tokenization", Text(
            f"no tokenizer in a dry run of a preset: assuming {prompt_tokens} prompt tokens ({why})")))
        return
    table = Table(show_edge=False, pad_edge=False, box=None)
    table.add_column("#", justify="right", style="dim")
    table.add_column("piece")
    table.add_column("id", justify="right", style="cyan")
    table.add_column("bytes", style="dim")
    shown = list(zip(record.pieces, record.ids))[:MAX_TOKEN_ROWS]
    for index, (piece, token_id) in enumerate(shown):
        table.add_row(str(index), fmt.piece(piece), str(token_id), _piece_bytes(piece))
    if len(record.ids) > MAX_TOKEN_ROWS:
        table.add_row("…", f"{len(record.ids) - MAX_TOKEN_ROWS} more", "", "")
    chars = len(record.model_text)
    utf8 = len(record.model_text.encode("utf-8"))
    notes = [
        f"{chars} characters ({utf8} UTF-8 bytes) → [bold]{len(record.ids)} tokens[/] in {fmt.duration_ns(record.duration_ns)}"
        + (" · chat template applied" if record.model_text != record.text else "")
        + (" · BOS prepended" if record.add_bos else ""),
    ]
    if any(_piece_bytes(p) for p in record.pieces):
        notes.append("[dim]<0x..> are raw UTF-8 bytes: the vocabulary has no token for the whole character, so it "
                     "is spelled in byte pieces (a CJK character is 3 bytes).[/]")
    console.print(section("1 · Tokenization  text → pieces → ids", Group(table, Text.from_markup("\n".join(notes)))))


def _piece_bytes(piece: str) -> str:
    """For pieces shown as raw bytes (<0xE4><0xBB>): how many bytes of a character they hold."""
    count = piece.count("<0x")
    if count and piece.replace("<0x", "").replace(">", "").isalnum():
        return f"{count} byte" + ("s" if count > 1 else "") + " of a character"
    return ""


# ---- 2 embedding ------------------------------------------------------------------------------------------------


def _rank_share(config: ModelConfig, tp: int) -> str:
    """", rank 0's 1/2 of 32,000 rows" after a table of a --tp N run's rank (its stages are rank 0's), else ""."""
    return f", rank 0's 1/{tp} of {config.vocab_size:,} rows" if tp > 1 else ""


def render_embedding(console: Console, config: ModelConfig, stages: Sequence[StageRecord], dry_run: bool,
                     tp: int = 1) -> None:
    """`tp`: the ranks of a --tp run, whose stages are rank 0's: the table it holds is its slice of the rows."""
    embed = next((s for s in stages if s.kind == "embedding"), None)
    if embed is None:
        console.print(section("2 · Embedding", Text("not traced (--no-trace)")))
        return
    rows = embed.input_shapes[0]
    held, table_bytes = embedding_table(config, embed, tp)
    lines = [
        f"table tok_embeddings {fmt.shape((vocab_slice(config, tp), config.dim))} {held}"
        + (f" = {fmt.nbytes(table_bytes)}" if table_bytes is not None else "") + _rank_share(config, tp),
        f"ids {fmt.shape(rows)} → one row each → output [bold]{fmt.shape(embed.output_shapes[0])}[/]",
        f"bytes read: {fmt.nbytes(embed.weight_bytes_read)} (only the {math.prod(rows)} rows looked up), "
        f"written {fmt.nbytes(embed.activation_bytes_written)}; 0 FLOPs (a gather)"
        + ("" if dry_run else f" · {fmt.duration_ns(embed.duration_ns)}"),
    ]
    scale = next((s for s in stages if s.kind == "scale"), None)
    if scale is not None:  # Gemma: the rows times sqrt(dim), a stage of its own
        lines.append(f"then × √{config.dim} = {config.dim**0.5:.4g} (its own stage, in the model's dtype): "
                     f"{fmt.flops(scale.flops)}" + ("" if dry_run else f" · {fmt.duration_ns(scale.duration_ns)}"))
    console.print(section("2 · Embedding  ids → vectors", Text.from_markup("\n".join(lines))))


def embedding_table(config: ModelConfig, embed: StageRecord, tp: int = 1) -> tuple[str, int | None]:
    """How the embedding table is held ("q8_0 (native) as stored", "float32") and its bytes (None: unknown); under
    --tp N, rank 0's slice of it."""
    stored = embed.weight_format not in ("", "fp32", "fp16", "bf16")  # held as the GGUF stores it: "q8_0 (int4pack)"
    if stored:
        return f"{embed.weight_format} as stored", embed.weight_bytes_read * vocab_slice(config, tp) // math.prod(
            embed.input_shapes[0])
    return embed.dtype, embedding_table_bytes(config, embed.dtype, tp)


# ---- 3 positions ------------------------------------------------------------------------------------------------


def render_positions(console: Console, rope: RopeRecord | None, tokenization: TokenizationRecord | None,
                     config: ModelConfig) -> None:
    if rope is None:
        return
    table = Table(show_edge=False, pad_edge=False, box=None)
    table.add_column("pos", justify="right")
    table.add_column("token")
    table.add_column("fastest pair (i=0)", justify="right")
    table.add_column("slowest pair", justify="right")
    pieces = tokenization.pieces if tokenization is not None else ()
    positions = rope.positions
    shown = positions if len(positions) <= 12 else positions[:6] + positions[-6:]
    for index, pos in enumerate(shown):
        if len(positions) > 12 and index == 6:
            table.add_row("…", "", "", "")
        piece = fmt.piece(pieces[pos]) if pos < len(pieces) else ""
        table.add_row(str(pos), piece, _angle(pos * rope.inv_freq_first), _angle(pos * rope.inv_freq_last))
    rotary = config.rotary_dim  # the values of a head RoPE turns: its D, or a partial rotary's R
    pairs = rotary // 2
    n_layers = config.n_layers
    scaled = f", {rope.scaling} scaling" if rope.scaling else ""
    turned = f"head dim {rope.head_dim} = {pairs} pairs" if rotary == rope.head_dim else (
        f"the first {rotary} of each head's {rope.head_dim} values = {pairs} pairs (the other "
        f"{rope.head_dim - rotary} pass through unturned)")
    local = ""
    if config.rope_local_theta is not None and config.mixed_windows:  # Gemma 3: the table is the global layers'
        local = (f"\nThat is the {len(config.full_layers)} global layers' θ; the {config.windowed_layers} windowed "
                 f"layers turn by θ = {config.rope_local_theta:g}, unscaled.")
    text = Text.from_markup(
        f"RoPE θ = {rope.theta:g}{scaled}; {turned}, pair i turns by "
        f"position × θ^(−2i/{rotary}) rad (from {rope.inv_freq_first:.3g} down to {rope.inv_freq_last:.3g} "
        f"rad per position).\nApplied to Q and K inside attention in each of the {n_layers} layers, not added to "
        "the embedding: a score then depends only on the distance between two positions." + local
    )
    console.print(section(f"3 · Positions  {len(positions)} positions rotated", Group(table, text)))


def _angle(radians: float) -> str:
    return f"{radians:.3f} rad ({math.degrees(radians) % 360:.1f}°)"


# ---- 4 layers ---------------------------------------------------------------------------------------------------

def _block_note(stages: Sequence[StageRecord]) -> str:
    """What one block computes, from the stages it ran: LLaMA's pre-norm with SwiGLU, or Gemma's norms after each
    sub-block too with GeGLU."""
    names = {r.short_name for r in stages if r.layer == 0}
    gate = "GeGLU" if "feed_forward.gelu" in names else "SwiGLU"
    if "post_attention_norm" in names:
        return (f"norms before and after: x + RMSNorm(attention(RMSNorm(x))), then h + RMSNorm(FFN(RMSNorm(h))) "
                f"with {gate} (three matrices)")
    return f"pre-norm: x + attention(RMSNorm(x)), then h + FFN(RMSNorm(h)) with {gate} (three matrices)"


def render_layers(console: Console, stages: Sequence[StageRecord], step: StepRecord, detail: str,
                  dry_run: bool) -> None:
    if not stages:
        console.print(section("4 · Transformer layers", Text(
            f"not traced (--no-trace): prefill of {step.input_tokens} tokens took {fmt.duration_ns(step.forward_ns)}")))
        return
    rows = layer_rows(stages)
    total = stage_totals(stages)
    per_layer = rows[0].totals if rows else total
    matmul_share = fmt.share(total.matmul_flops, total.flops)
    summary = (
        f"prefill of {step.input_tokens} tokens: {fmt.flops(total.flops)} ({matmul_share} in matmuls), "
        f"{fmt.nbytes(total.bytes_read)} read"
        + ("" if dry_run else f", {fmt.duration_ns(step.forward_ns)} forward")
        + f"\none layer: {fmt.flops(per_layer.flops)}, weights {fmt.nbytes(per_layer.weight_bytes_read)}; "
        + _block_note(stages)
        + "\n" + _path_note(stages)
    )
    if detail == "summary":
        body: object = Text(summary)
    else:
        # The widest layout that fits the panel: stage inputs (--detail ops) and the bars go first when it is narrow.
        layouts = [(True, True), (False, True), (False, False)] if detail == "ops" else [(False, True), (False, False)]
        for inputs, bars in layouts:
            table = _layers_table(stages, step, detail, dry_run, inputs, bars)
            if natural_width(console, table) <= console.width - PANEL_FRAME:
                break
        body = Group(table, Text(summary))
    console.print(section(f"4 · Transformer layers × {len(rows)}  (prefill)", body))


def _layers_table(stages: Sequence[StageRecord], step: StepRecord, detail: str, dry_run: bool, inputs: bool,
                  bars: bool) -> Table:
    rows = layer_rows(stages)
    total = stage_totals(stages)
    forward_ns = step.forward_ns
    max_wall = max((r.wall_ns for r in rows), default=1) or 1
    max_flops = max((r.totals.flops for r in rows), default=1) or 1
    ops = detail == "ops"
    table = Table(show_edge=False, pad_edge=False, box=None)
    table.add_column("layer / stage" if ops else "layer", no_wrap=True)
    table.add_column("in → out" if inputs else "output", no_wrap=True)
    if not dry_run:
        table.add_column("time", justify="right", no_wrap=True)
    table.add_column("FLOPs", justify="right", no_wrap=True)
    if ops:
        table.add_column("read", justify="right", no_wrap=True)
    table.add_column("share", justify="right", no_wrap=True)
    if bars:
        table.add_column("", no_wrap=True)
    for row in rows:
        share = fmt.share(row.wall_ns, forward_ns) if not dry_run else fmt.share(row.totals.flops, total.flops)
        fraction = row.wall_ns / max_wall if not dry_run else row.totals.flops / max_flops
        cells = [f"[bold]layer {row.layer}[/]", fmt.shape(row.stages[-1].output_shapes[0])]
        if not dry_run:
            cells.append(fmt.duration_ns(row.wall_ns))
        cells.append(fmt.flops(row.totals.flops))
        if ops:
            cells.append(fmt.nbytes(row.totals.bytes_read))
        cells.append(share)
        if bars:
            cells.append(fmt.bar(fraction, 16))
        table.add_row(*cells)
        if ops:
            for stage in row.stages:
                _add_stage_row(table, stage, forward_ns, total.flops, dry_run, inputs, bars)
    for stage in (s for s in stages if s.layer is None):
        cells = [short_label(stage.stage), fmt.shape(stage.output_shapes[0])]
        if not dry_run:
            cells.append(fmt.duration_ns(stage.duration_ns))
        cells.append(fmt.flops(stage.flops))
        if ops:
            cells.append(fmt.nbytes(stage.bytes_read))
        cells.append(fmt.share(stage.duration_ns, forward_ns) if not dry_run else fmt.share(stage.flops, total.flops))
        if bars:
            cells.append("")
        table.add_row(*cells)
    return table


def _path_note(stages: Sequence[StageRecord]) -> str:
    """Which way through the model was traced (tracer/trace/hooks.py's mechanisms): fused or stage by stage."""
    if any(s.short_name == "attention.wqkv" for s in stages):
        return ("traced: the fused path, what an untraced run executes; Q|K|V and gate|up are one packed product "
                "each (--staged runs them apart)")
    return "traced: stage by stage, one module per stage (Q, K, V, gate and up as separate products)"


def _add_stage_row(table: Table, stage: StageRecord, forward_ns: int, total_flops: int, dry_run: bool,
                   inputs: bool, bars: bool) -> None:
    label = short_label(stage.short_name)
    out = fmt.shape(stage.output_shapes[0])
    if inputs:
        shapes = " ".join(fmt.shape(s) for s in stage.input_shapes if len(s) > 1)
        out = f"{shapes} → {out}"
    style = "" if stage.kind in MATMUL_KINDS else "dim"
    cells = [Text(f"  {label}", style=style), Text(out, style="dim")]
    if not dry_run:
        cells.append(Text(fmt.duration_ns(stage.duration_ns), style=style))
    cells.append(Text(fmt.flops(stage.flops), style=style))
    cells.append(Text(fmt.nbytes(stage.bytes_read), style="dim"))
    share = fmt.share(stage.duration_ns, forward_ns) if not dry_run else fmt.share(stage.flops, total_flops)
    cells.append(Text(share, style="dim"))
    if bars:
        cells.append(Text(""))
    table.add_row(*cells)


# ---- 5 LM head --------------------------------------------------------------------------------------------------


def render_lm_head(console: Console, stages: Sequence[StageRecord], step: StepRecord, settings: RunSettings,
                   config: ModelConfig, dry_run: bool, tp: int = 1) -> None:
    head = next((s for s in stages if s.kind == "lm_head"), None)
    lines = []
    if head is not None:
        tied = "the embedding matrix itself (tied)" if config.tie_embeddings else "its own matrix (not tied)"
        lines.append(
            f"final RMSNorm of the last position {fmt.shape(head.input_shapes[0])} × W_out "
            f"{fmt.shape((vocab_slice(config, tp), config.dim))}ᵀ{_rank_share(config, tp)} → logits "
            f"[bold]{fmt.shape(head.output_shapes[0])}[/] · "
            f"{fmt.flops(head.flops)} · reads {fmt.nbytes(head.weight_bytes_read)} of weights, {tied}"
            + ("" if dry_run else f" · {fmt.duration_ns(head.duration_ns)}")
        )
    if dry_run:
        console.print(section("5 · LM head  hidden state → logits", Text.from_markup("\n".join(lines))))
        return
    lines.append(_sampling_explanation(step, settings))
    table = Table(show_edge=False, pad_edge=False, box=None)
    for name, justify in (("", "left"), ("piece", "left"), ("id", "right"), ("logit", "right"),
                          ("p raw", "right"), (f"p T={settings.temperature:g}", "right"), ("kept", "left"),
                          ("p final", "right")):
        table.add_column(name, justify=justify)  # type: ignore[arg-type]
    for cand in step.candidates[:MAX_CANDIDATES]:
        chosen = cand.token_id == step.token_id
        kept = _kept_cell(cand)
        table.add_row("→" if chosen else "", fmt.piece(cand.piece), str(cand.token_id), f"{cand.logit:.2f}",
                      fmt.probability(cand.prob_raw), fmt.probability(cand.prob_tempered), kept,
                      fmt.probability(cand.prob_final), style="bold" if chosen else None)
    console.print(section("5 · LM head and sampling  logits → probabilities → first token",
                          Group(Text.from_markup("\n".join(lines)), table)))


def _kept_cell(cand: CandidateRecord) -> str:
    """✓, or the filter that dropped the token: the first one that did not keep it (the flags are cumulative, and a
    filter that is off keeps everything, so only an active filter can be named)."""
    for name, kept in (("top-k", cand.kept_top_k), ("top-p", cand.kept_top_p), ("min-p", cand.kept_min_p)):
        if not kept:
            return f"✗ {name}"
    return "✓"


def _survivors(step: StepRecord, settings: RunSettings) -> str:
    """How many tokens each active filter left, and what sampling did to the entropy (SampleResult's figures)."""
    s = step.sampling
    if s is None:
        return ""
    if step.greedy:
        return (f"the model's distribution over {s.vocab_size:,} tokens has entropy {s.entropy_raw_bits:.2f} bits; "
                f"greedy keeps 1 token (0 bits)")
    kept = []
    if settings.top_k:
        kept.append(f"top-k {settings.top_k} kept {s.n_after_top_k:,}")
    if settings.top_p is not None and settings.top_p < 1:
        mass = (f": the fewest whose probabilities reach {settings.top_p:g} ({100 * s.top_p_mass:.1f}%)"
                if s.top_p_mass is not None else "")
        kept.append(f"top-p {settings.top_p:g} kept {s.n_after_top_p:,}{mass}")
    if settings.min_p:
        kept.append(f"min-p {settings.min_p:g} kept {s.n_after_min_p:,}")
    counts = ", then ".join(kept) or f"no filter: all {s.n_final:,} tokens stay in the draw"
    of = f" of {s.vocab_size:,} tokens" if kept else ""
    return f"{counts}{of}; entropy {s.entropy_raw_bits:.2f} → {s.entropy_final_bits:.2f} bits"


def _chosen(step: StepRecord) -> str:
    """The chosen token with the model's own probability, and the final one when sampling changed it."""
    model_p = step.sampling.probability_raw if step.sampling is not None else None
    if step.greedy or model_p is None:
        p = f"model p = {fmt.probability(model_p)}" if model_p is not None else f"p = {fmt.probability(step.probability)}"
    else:
        p = f"model p = {fmt.probability(model_p)}, after sampling {fmt.probability(step.probability)}"
    return f"[bold]{fmt.piece(step.piece)}[/] (id {step.token_id}, {p})"


def _sampling_explanation(step: StepRecord, settings: RunSettings) -> str:
    chosen = _chosen(step)
    survivors = _survivors(step, settings)
    if step.greedy:
        text = f"greedy (temperature 0): the argmax is taken → {chosen}"
        if settings.repetition_penalty != 1.0:
            text += f"; repetition penalty {settings.repetition_penalty:g} applied to tokens already seen"
        return text + (f"\n{survivors}" if survivors else "")
    parts = [f"temperature {settings.temperature:g} divides the logits"]
    if settings.top_k:
        parts.append(f"top-k {settings.top_k} keeps the {settings.top_k} highest")
    if settings.top_p is not None and settings.top_p < 1:
        parts.append(f"top-p {settings.top_p:g} keeps the fewest whose probabilities sum to ≥ {settings.top_p:g}")
    if settings.min_p:
        parts.append(f"min-p {settings.min_p:g} drops those below {settings.min_p:g} × the top probability")
    if settings.repetition_penalty != 1.0:
        parts.append(f"repetition penalty {settings.repetition_penalty:g} on tokens already seen")
    seed = ""
    if settings.seed is not None:
        seed = f" (seed {settings.seed}, drawn)" if settings.seed_drawn else f" (seed {settings.seed})"
    text = "; ".join(parts) + f"; survivors renormalised and one drawn{seed} → {chosen}"
    return text + (f"\n{survivors}" if survivors else "")
