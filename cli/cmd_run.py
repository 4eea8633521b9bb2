"""`llmtrace run "prompt"`: trace a real generation and show one token's journey, stage by stage, live.

Sections in the order of the journey: 1 tokenization, 2 embedding, 3 positions (RoPE), 4 transformer layers,
5 LM head and sampling, 6 decode (streamed live), 7 decode by stage, 8 summary. `--dry-run` builds any preset on the
meta device and shows shapes and FLOPs without weights.

This module only declares the command: its options live in cli/run_options.py (one group of the help each), their
checks in cli/run_args.py (before torch is imported), the run itself in cli/run_flow.py and cli/run_live.py.
"""

from __future__ import annotations

import typer

from llmtrace.cli import run_options as o
from llmtrace.cli.app import app
from llmtrace.cli.command import command_class
from llmtrace.cli.options import Detail
from llmtrace.tracer.core.dtypes import AUTO

# Old spellings, still read (hidden from the help): --prompt-tokens became --prompt-len, as in flops and roofline;
# `--json PATH` became `--json-file PATH` (cli/run_legacy.py), `--json` printing to stdout as every command's does.
RENAMED = {"--prompt-tokens": "--prompt-len"}


def _legacy_json(args: list[str]) -> list[str]:
    from llmtrace.cli.run_legacy import legacy_json_path

    return legacy_json_path(args)


@app.command("run", cls=command_class(RENAMED, _legacy_json), epilog=(  # \b: click keeps the lines as they are
    "\b\nExamples:\n  llmtrace run \"今天天气真\"\n  llmtrace run capital --detail ops\n"
    "  llmtrace run --model llama-7b --dry-run\n"
    "  llmtrace run sky --temperature 0.8 --top-p 0.9 --json-file trace.json"))
def run_command(
    prompt: o.Prompt = None,
    file: o.File = None,
    literal: o.Literal = False,
    chat: o.Chat = False,
    prompt_len: o.PromptLen = None,
    batch: o.Batch = None,
    model: o.Model = None,
    dtype: o.DtypeOption = AUTO,
    weights: o.Weights = None,
    tune: o.Tune = False,
    device: o.Device = "cpu",
    dry_run: o.DryRun = False,
    max_new_tokens: o.MaxNewTokens = 32,
    temperature: o.Temperature = 0.0,
    top_k: o.TopK = None,
    top_p: o.TopP = None,
    min_p: o.MinP = None,
    repetition_penalty: o.RepetitionPenalty = 1.0,
    seed: o.Seed = None,
    detail: o.DetailChoice = Detail.layers,
    staged: o.Staged = False,
    no_trace: o.NoTrace = False,
    temperatures: o.Temperatures = "0.1,1,2",
    lens: o.Lens = False,
    attention: o.Attention = False,
    attention_steps: o.AttentionSteps = "0",
    no_kv_cache: o.NoKvCache = False,
    json: o.Json = False,
    json_file: o.JsonFile = None,
    chrome_trace: o.ChromeTrace = None,
    html: o.Html = None,
    summary_json: o.SummaryJson = False,
    trace_steps: o.TraceSteps = "all",
    threads: o.Threads = None,
    no_warmup: o.NoWarmup = False,
    repeat: o.Repeat = 1,
    batch_sweep: o.BatchSweep = None,
    no_roofline: o.NoRoofline = False,
    tp: o.Tp = 1,
    tp_timeout: o.TpTimeout = 60.0,
) -> None:
    """Trace a real generation: every stage of every token, with shapes, FLOPs, bytes and time."""
    options = dict(locals())  # first: the parameters alone, as typer passed them
    from llmtrace.cli.run_flow import run_cli

    code = run_cli(options)
    if code:
        raise typer.Exit(code)
