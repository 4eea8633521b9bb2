"""A mixture of experts in the analytical views: its experts and active parameters in one line, and the experts a
decode step reads at several batch sizes (expected under uniform routing, at most, and the bound with all read)."""

from __future__ import annotations

from rich.table import Table

from llmtrace.cli import formatting as fmt
from llmtrace.cli.tables import report_table
from llmtrace.tracer.analytic.moe import MoeSummary
from llmtrace.tracer.analytic.params import ParamCount

_NORMS = {"renormalised": "the top k's weights renormalised to sum 1", "softmax": "softmax weights kept as they are"}


def experts_line(p: ParamCount, moe: MoeSummary) -> list[str]:
    """The phrases of 'Experts: 8 a layer, 2 per token (...); active parameters 12,879,925,248 of 46,702,792,704
    (27.6%), one expert ... a layer' (formatting.flow lays them out)."""
    return [f"Experts: {moe.n_experts} a layer,", f"{moe.experts_per_token} per token ({_NORMS[moe.router_norm]});",
            f"active parameters [bold]{fmt.count(p.active)}[/] of {fmt.count(p.total)} ({fmt.share(p.active, p.total)}),",
            f"one expert {fmt.count(p.expert_per_layer)} a layer"
            + ("" if moe.shared_expert_dim is None else ";"),
            *([] if moe.shared_expert_dim is None else
              [f"one shared expert ({fmt.count(moe.shared_expert_dim)} wide)", "run by every token beside them"])]


def reads_title(moe: MoeSummary) -> str:
    e, k = moe.n_experts, moe.experts_per_token
    return (f"\n[bold]Experts one decode step reads[/], per layer: E·(1 − (1 − k/E)^B) = {e}·(1 − (1 − {k}/{e})^B) "
            f"expected if routing is uniform, at most min(E, k·B); one expert {fmt.nbytes(moe.expert_bytes)} a "
            "layer")


def reads_table(moe: MoeSummary) -> Table:
    table = report_table()
    for name in ("batch", "experts expected", "at most", "weights read", "all experts read"):
        table.add_column(name, justify="right", no_wrap=True)
    for r in moe.reads:
        table.add_row(str(r.batch), fmt.figures(r.expected_experts), str(r.most_experts),
                      fmt.nbytes(r.expected_weight_bytes), fmt.nbytes(r.all_experts_weight_bytes))
    return table
