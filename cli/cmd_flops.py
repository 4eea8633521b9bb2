"""`llmtrace flops`: FLOPs and bytes per component for a prefill, one decode step and a whole generation."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Optional

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

if TYPE_CHECKING:
    from llmtrace.tracer.checkpoint.resolve import ResolvedModel

# The old spelling, still read: -n is --max-new-tokens in every command, as in `run` (HF generate's max_new_tokens)
RENAMED = {"--new-tokens": "--max-new-tokens"}
DEFAULT_PROMPT_LEN = 128
DEFAULT_NEW_TOKENS = 128


@app.command("flops", cls=command_class(RENAMED))
def flops(
    model: ModelOption = DEFAULT_MODEL,
    prompt_len: Annotated[Optional[int], typer.Option(
        "--prompt-len", "-p", min=1, show_default=str(DEFAULT_PROMPT_LEN), help="Prompt length P in tokens.")] = None,
    prompt: Annotated[Optional[str], typer.Option(
        "--prompt", metavar="<text>", help="Prompt text; its length is counted with the model's own tokenizer (folder or .gguf).")] = None,
    new_tokens: Annotated[int, typer.Option(
        "--max-new-tokens", "-n", min=1, help="Tokens N to generate (a run may stop sooner, at EOS; here all N "
                                              "count).")] = DEFAULT_NEW_TOKENS,
    context: Annotated[Optional[int], typer.Option(
        "--context", "-L", min=0, show_default="P",
        help="Positions L already cached for the single decode step shown.")] = None,
    dtype: Annotated[Optional[DType], dtype_option(
        "--dtype", show_default="the checkpoint's where listed, else fp16",
        help="Weight dtype, for bytes moved and arithmetic intensity.")] = None,
    kv_dtype: Annotated[Optional[DType], dtype_option(
        "--kv-dtype", show_default="the weight dtype; fp16 for fp8/int8/int4 weights", help="KV-cache dtype.")] = None,
    batch: BatchOption = 1,
    kernels: Annotated[KernelsChoice, typer.Option(
        "--kernels", help=KERNELS_HELP + " Changes the attention FLOPs of a prefill and every byte figure.")]
    = KernelsChoice.fused,
    macs: Annotated[bool, typer.Option("--macs", help="Show matmul MACs (multiply-accumulates) instead of FLOPs.")] = False,
    json_out: JsonOption = False,
) -> None:
    """FLOPs per component (formula, per layer, all layers, share) for prefill, one decode step and a generation.

    \b
    Examples:
      llmtrace flops                           # llama-7b, P=128, N=128
      llmtrace flops --model llama3-8b --prompt-len 2000 --max-new-tokens 500
      llmtrace flops --model path/to/model.gguf --prompt "The sky is blue"
      llmtrace flops --model llama2-70b --dtype int4 --batch 8 --json
      llmtrace flops -m llama3-8b -p 8192 --kernels eager  # as llmtrace runs it
    """

    def body() -> None:
        # Imported inside the command: `llmtrace --help` and the other commands do not pay for them.
        from llmtrace.tracer.analytic.flops_report import flops_report
        from llmtrace.tracer.checkpoint.resolve import resolve_model
        from llmtrace.tracer.core.errors import BadArgumentError

        if prompt is not None and prompt_len is not None:
            raise BadArgumentError("give either --prompt or --prompt-len, not both")
        resolved = resolve_model(model, vocabulary=prompt is not None)  # a GGUF header read once, vocabulary too
        p_len, tokenizer_source = _prompt_length(resolved, prompt, prompt_len)
        report = flops_report(
            resolved, p_len, new_tokens, dtype, kv_dtype,
            batch=batch, decode_context=context, prompt_tokenizer=tokenizer_source, kernels=kernels.value,
        )
        from llmtrace.cli.json_output import print_record
        from llmtrace.cli.render_flops import render_flops

        print_record(report, json_out, render_flops, macs)

    run_guarded(body)


def _prompt_length(resolved: ResolvedModel, prompt: str | None, prompt_len: int | None) -> tuple[int, str | None]:
    """P: --prompt's tokens counted with the model's own tokenizer (and which tokenizer), else --prompt-len."""
    if prompt is None:
        return DEFAULT_PROMPT_LEN if prompt_len is None else prompt_len, None
    from llmtrace.tracer.checkpoint.prompt_tokens import count_prompt_tokens
    from llmtrace.tracer.core.errors import BadArgumentError

    counted = count_prompt_tokens(resolved, prompt)
    if counted.n_tokens == 0:
        raise BadArgumentError("--prompt has no tokens; give some text or --prompt-len N")
    return counted.n_tokens, counted.tokenizer
