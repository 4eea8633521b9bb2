"""`llmtrace roofline`: prefill and decode of a model against a machine's compute and memory ceilings."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from llmtrace.cli.app import app
from llmtrace.cli.command import command_class
from llmtrace.cli.errors import run_guarded
from llmtrace.cli.options import (
    DEFAULT_MODEL,
    KERNELS_HELP,
    BatchOption,
    JsonOption,
    KernelsChoice,
    ModelOption,
    dtype_option,
)
from llmtrace.tracer.core.dtypes import DType

# The old spelling, still read: -n is --max-new-tokens in every command, as in `run` (HF generate's max_new_tokens)
RENAMED = {"--new-tokens": "--max-new-tokens"}
DEFAULT_HARDWARE = "a100-80gb"  # the seed article's GPU


@app.command("roofline", cls=command_class(RENAMED))
def roofline(
    model: ModelOption = DEFAULT_MODEL,
    hardware: Annotated[str, typer.Option(
        "--hardware", "-H", metavar="<name>",
        help="A profile from `llmtrace hardware` (a100-80gb, h100-sxm, rtx-4090, m3-max, ...) or this-machine "
             "after `llmtrace hardware --measure`.")] = DEFAULT_HARDWARE,
    prompt_len: Annotated[int, typer.Option("--prompt-len", "-p", min=1, help="Prompt tokens per sequence.")] = 512,
    new_tokens: Annotated[int, typer.Option(
        "--max-new-tokens", "-n", min=1, help="Tokens to generate per sequence.")] = 128,
    batch: BatchOption = 1,
    dtype: Annotated[Optional[DType], dtype_option(
        "--dtype", show_default="the checkpoint's (a GGUF's main type, e.g. q4_1), else fp16",
        help="Weights dtype (int8/int4: block formats, multiplied in fp16).")] = None,
    kv_dtype: Annotated[Optional[DType], dtype_option(
        "--kv-dtype", help="KV-cache dtype (default: the activation dtype; fp16 for quantized weights).")] = None,
    tp: Annotated[int, typer.Option("--tp", min=1, help="Tensor-parallel devices (must divide the heads).")] = 1,
    kernels: Annotated[Optional[KernelsChoice], typer.Option(
        "--kernels", show_default="fused on a GPU profile, eager on this-machine", help=KERNELS_HELP)] = None,
    json_out: JsonOption = False,
) -> None:
    """Why decode runs at hundreds of tokens/s, not tens of thousands: FLOPs and bytes of each pass against the
    hardware's ridge point, predicted TTFT and tokens/s, the batch where decode turns compute-bound, memory fit.

    \b
    Examples:
      llmtrace roofline                        # llama-7b fp16 on an A100 80GB
      llmtrace roofline --model llama3-8b --hardware rtx-4090 --dtype int4
      llmtrace roofline --model llama2-70b --hardware h100-sxm --tp 4 --batch 32
      llmtrace roofline -m llama3.1-405b -H h200 --tp 8 --dtype fp8 --json
      llmtrace roofline -m llama3.1-8b -H h100-sxm -p 8192 --kernels eager
    """

    def body() -> None:
        from llmtrace.tracer.analytic.flops_report import default_weights_dtype, weights_as_stored
        from llmtrace.tracer.checkpoint.resolve import resolve_model
        from llmtrace.tracer.hardware.store import resolve_hardware
        from llmtrace.tracer.roofline.analysis import roofline as predict
        from llmtrace.tracer.roofline.measured_decode import measured_roofline

        resolved = resolve_model(model)
        weights, weights_from = (dtype, "option") if dtype is not None else default_weights_dtype(resolved)
        profile = resolve_hardware(hardware)
        report = predict(
            resolved.config, profile, prompt_len=prompt_len, new_tokens=new_tokens,
            batch=batch, dtype=weights, kv_dtype=kv_dtype, tp=tp,
            kernels=kernels.value if kernels else None, weights_from=weights_from,
            stored=weights_as_stored(resolved) if weights_from == "file" else (),
        )
        if tp == 1:  # measured kernels are one device's
            report = measured_roofline(report, resolved.config, profile, weights, weights_from)
        from llmtrace.cli.json_output import print_record
        from llmtrace.cli.render_roofline import render_report

        print_record(report, json_out, render_report)

    run_guarded(body)
