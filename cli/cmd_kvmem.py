"""`llmtrace kvmem`: KV-cache bytes, the formula with numbers, a table over context lengths, GQA and a budget."""

from typing import Annotated, Optional

import typer

from llmtrace.cli.app import app
from llmtrace.cli.command import command_class
from llmtrace.cli.errors import run_guarded
from llmtrace.cli.options import DEFAULT_MODEL, BatchOption, JsonOption, ModelOption, dtype_option
from llmtrace.tracer.core.dtypes import DType


@app.command("kvmem", cls=command_class())
def kvmem(
    seq: Annotated[Optional[int], typer.Option(
        "--seq", "-s", min=1, show_default="the model's max context",
        help="Positions per sequence (prompt + generated tokens).")] = None,
    model: ModelOption = DEFAULT_MODEL,
    dtype: Annotated[Optional[DType], dtype_option(
        "--dtype", show_default="the cache `run` allocates: a float checkpoint's own dtype, else fp32 (a GGUF, a "
        "preset)", help="KV-cache dtype.")] = None,
    batch: BatchOption = 1,
    budget: Annotated[Optional[str], typer.Option(
        "--budget", metavar="<size>", help="Memory to fill, e.g. 24GiB or 80GB: how many positions fit (GB = 1e9 B, GiB = 2^30 B).")] = None,
    weights_dtype: Annotated[Optional[DType], dtype_option(
        "--weights-dtype", show_default="the checkpoint's (a GGUF's main type, e.g. q4_1), else fp16",
        help="With --budget: dtype of the weights that share the memory.")] = None,
    json_out: JsonOption = False,
) -> None:
    """KV-cache size: 2 × layers × KV heads × head dim × bytes × positions × batch.

    \b
    Examples:
      llmtrace kvmem --seq 2000
      llmtrace kvmem --model llama2-70b --seq 4096 --batch 8 --dtype int8
      llmtrace kvmem --model llama3-8b --budget 24GiB --json
    """

    def body() -> None:
        from llmtrace.tracer.analytic.flops_report import default_weights_dtype, weights_as_stored
        from llmtrace.tracer.analytic.kvmem import kvmem_report, parse_bytes, run_cache_dtype
        from llmtrace.tracer.checkpoint.resolve import resolve_model

        resolved = resolve_model(model)
        config = resolved.config
        weights, weights_from = ((weights_dtype, "option") if weights_dtype is not None
                                 else default_weights_dtype(resolved))
        stored = weights_as_stored(resolved) if weights_from == "file" else ()
        cache, note = (dtype, "") if dtype is not None else run_cache_dtype(resolved.weights)
        report = kvmem_report(
            config, seq if seq is not None else config.max_seq_len, cache, batch, dtype_note=note,
            budget_bytes=parse_bytes(budget) if budget is not None else None, weights_dtype=weights,
            stored_weight_bytes=sum(n_bytes for _, n_bytes, _ in stored) if stored else None,
        )
        from llmtrace.cli.json_output import print_record
        from llmtrace.cli.render_kvmem import render_kvmem

        print_record(report, json_out, render_kvmem)

    run_guarded(body)
