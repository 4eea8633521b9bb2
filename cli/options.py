"""Option types shared by the commands: `Annotated` aliases and `str` Enums, so each is declared once."""

from __future__ import annotations

from enum import Enum
from typing import Annotated

import typer


class DtypeChoice(str, Enum):
    """Storage dtypes llmtrace budgets for (llmtrace.tracer.core.dtypes): int8/int4 include one fp16 scale per 32 values."""

    fp32 = "fp32"
    bf16 = "bf16"
    fp16 = "fp16"
    fp8 = "fp8"
    int8 = "int8"
    int4 = "int4"


class KernelsChoice(str, Enum):
    """The kernel model (llmtrace.tracer.analytic.kernels): which kernels a pass runs, so what it moves."""

    eager = "eager"
    fused = "fused"


KERNELS_HELP = ("eager: every op reads and writes its tensors, attention scores materialised (llmtrace's own "
                "model); fused: FlashAttention (scores on chip, masked tiles skipped) with elementwise ops fused "
                "into the matmuls (vLLM, llama.cpp).")


class Detail(str, Enum):
    """How much of a traced forward `run` and `show` print: totals, one row per layer, or every stage."""

    summary = "summary"
    layers = "layers"
    ops = "ops"


DetailOption = Annotated[Detail, typer.Option(help="summary: totals only; layers: one row per layer; ops: every "
                                                   "stage of every layer.")]

DEFAULT_MODEL = "llama-7b"  # the seed article's model

ModelOption = Annotated[
    str,
    typer.Option("--model", "-m", metavar="PRESET|PATH",
                 help="A preset (see `llmtrace models`), an HF model folder or config.json, or a .gguf file. "
                      "Only headers are read, never weights."),
]
BatchOption = Annotated[int, typer.Option("--batch", "-b", min=1, help="Sequences processed together.")]
JsonOption = Annotated[bool, typer.Option("--json", help="Machine-readable output on stdout (schema in README.md).")]
