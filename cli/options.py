"""Option types shared by the commands: `Annotated` aliases and `str` Enums, so each is declared once.

The conventions every command follows (tests/test_run_options.py checks the first for all of them):
- placeholders `<lowercase>` as typer writes `<int>`: `<path>`, `<preset|path>`, `<t,t,...>`; never PATH or
  `<int range>` (cli/command.py writes a range as `<int>`);
- the same option, the same name: `-n/--max-new-tokens` (Hugging Face's max_new_tokens, llama.cpp's -n) and
  `-p/--prompt-len` in run, flops and roofline; `-m/--model`, `-b/--batch` where they apply;
- `--json` is a flag that prints the command's record on stdout and nothing else; a file is `--json-file PATH`;
- a renamed option keeps its old spelling, read but not shown (cli/command.py's `command_class(renamed)`), so
  scripts do not break; every command is declared with `cls=command_class(...)`, which also lists options by
  their `rich_help_panel` group in the plain help.
"""

from __future__ import annotations

from enum import Enum
from typing import Annotated, Any, Callable

import typer

from llmtrace.tracer.core.dtypes import AUTO, COMPUTE_DTYPES, DTYPES, get_compute_dtype, get_dtype
from llmtrace.tracer.core.errors import LlmtraceError


def _as_option_value(parse: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """A parser for typer: the engine's one-line error becomes click's "Invalid value for '--dtype': ..."."""

    def parser(value: Any) -> Any:
        try:
            return parse(value)
        except LlmtraceError as exc:
            raise typer.BadParameter(str(exc)) from None

    return parser


def dtype_option(*names: str, help: str, **options: Any) -> Any:
    """A storage-dtype option (llmtrace.tracer.core.dtypes.DTYPES; aliases such as float16 or q8_0 accepted), parsed
    into a DType as the command line is read. int8/int4 include one fp16 scale per 32 values."""
    return typer.Option(*names, parser=_as_option_value(_storage_dtype), metavar=f"<{'|'.join(DTYPES)}>", help=help,
                        **options)


def _storage_dtype(value: Any) -> Any:
    """The six storage dtypes the options offer (a GGUF's block types come from its file, not from an option)."""
    return get_dtype(value, DTYPES.values())


def compute_dtype_option(*names: str, help: str, **options: Any) -> Any:
    """A compute-dtype option: auto or a format torch computes in, parsed into AUTO or a DType."""
    choices = "|".join([AUTO.name, *(d.name for d in COMPUTE_DTYPES)])
    return typer.Option(*names, parser=_as_option_value(get_compute_dtype), metavar=f"<{choices}>", help=help,
                        **options)


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
    kernels = "kernels"  # the layers view, with the kernels' details under the header and the route's in the summary


DETAIL_HELP = ("summary: totals only; layers: one row per layer; ops: every stage of every layer; kernels: layers, "
               "with each matrix type's kernel, its numerics and why, and why each backend not taken was not.")
DetailOption = Annotated[Detail, typer.Option(help=DETAIL_HELP)]

DEFAULT_MODEL = "llama-7b"  # the seed article's model

ModelOption = Annotated[
    str,
    typer.Option("--model", "-m", metavar="<preset|path>",
                 help="A preset (see `llmtrace models`), an HF model folder or config.json, or a .gguf file. "
                      "Only headers are read, never weights."),
]
BatchOption = Annotated[int, typer.Option("--batch", "-b", min=1, help="Sequences processed together.")]
JsonOption = Annotated[bool, typer.Option("--json", help="Machine-readable output on stdout: one JSON object whose "
                                          "\"schema\" field names its schema (README, \"`--json` schemas\").")]
