"""`llmtrace models`: the presets with their key dimensions, parameter counts and KV bytes per token."""

from typing import Annotated

from llmtrace.cli.app import app
from llmtrace.cli.command import command_class
from llmtrace.cli.errors import run_guarded
from llmtrace.cli.options import JsonOption, dtype_option
from llmtrace.tracer.core.dtypes import FP16, DType


@app.command("models", cls=command_class())
def models(
    dtype: Annotated[DType, dtype_option("--dtype", help="Dtype of the weight and KV-cache columns.")] = FP16,
    json_out: JsonOption = False,
) -> None:
    """List the model presets usable as --model (each preset's source is cited in tracer/core/presets.py).

    \b
    Examples:
      llmtrace models
      llmtrace models --dtype int4 --json
    """

    def body() -> None:
        from llmtrace.tracer.analytic.catalog import models_report

        report = models_report(dtype)
        from llmtrace.cli.json_output import print_record
        from llmtrace.cli.render_models import render_models

        print_record(report, json_out, render_models)

    run_guarded(body)
