"""`llmtrace run`'s options, declared once each, in the groups its help lists them under.

Each option is an `Annotated` type whose `rich_help_panel` names its group; cli/run_args.py holds one dataclass per
group with the same field names, which checks the group's values (tests/test_run_options.py holds the two to each
other). Placeholders are `<lowercase>`, as typer writes `<int>`: one style across the commands.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from llmtrace.cli.options import DETAIL_HELP, Detail, compute_dtype_option

INPUT = "Input"
MODEL = "Model and precision"
SAMPLING = "Sampling"
VIEWS = "Views"
OUTPUTS = "Outputs"
PERFORMANCE = "Performance"
PARALLEL = "Parallel"
PANELS = (INPUT, MODEL, SAMPLING, VIEWS, OUTPUTS, PERFORMANCE, PARALLEL)  # the help's order

# ---- input ---------------------------------------------------------------------------------------------------------
Prompt = Annotated[Optional[str], typer.Argument(
    show_default=False,
    help="The prompt; '-' reads it from standard input; a sample name (capital, code, seed_zh, sky, story) traces "
         "that sample prompt (--literal traces the word itself).")]
File = Annotated[Optional[Path], typer.Option(
    "--file", "-f", metavar="<path>", rich_help_panel=INPUT,
    help="Read the prompt from this file ('-': standard input).")]
Literal = Annotated[bool, typer.Option(
    "--literal", rich_help_panel=INPUT, help="Trace PROMPT as given, even when it names a sample prompt.")]
Chat = Annotated[bool, typer.Option(
    "--chat", rich_help_panel=INPUT, help="Wrap the prompt in the model's chat template.")]
PromptLen = Annotated[Optional[int], typer.Option(
    "--prompt-len", "-p", metavar="<int>", rich_help_panel=INPUT,
    help="With --dry-run of a preset (no tokenizer): the prompt length in tokens to assume.")]
Batch = Annotated[Optional[int], typer.Option(
    "--batch", metavar="<int>", rich_help_panel=INPUT,
    help="Generate N sequences together (one batched prefill, then one decode step for all): the prompts are "
         "--file's first N non-empty lines, or the prompt N times. Each has its own positions, sampler (seed + its "
         "index) and stop; finished ones leave the batch.")]

# ---- model and precision -------------------------------------------------------------------------------------------
Model = Annotated[Optional[str], typer.Option(
    "--model", "-m", metavar="<path|preset>", rich_help_panel=MODEL,
    help="A .gguf file or HF model folder (default: the bundled SmolLM2-135M-Instruct); a preset name with "
         "--dry-run.")]
DtypeOption = Annotated[Any, compute_dtype_option(  # DType | AutoDtype: typer declares no unions
    "--dtype", rich_help_panel=MODEL,
    help="Compute dtype; auto = the default table's (README \"Default kernels\"): fp32 for a GGUF, a float "
         "checkpoint's own dtype.")]
Weights = Annotated[Optional[str], typer.Option(
    "--weights", metavar="<auto|tuned|stored|dense|kernel>", rich_help_panel=MODEL,
    help="How a GGUF's matrices are multiplied. auto: the default table for this CPU (README \"Default kernels\"; "
         "nothing measured); tuned: `llmtrace tune`'s saved pick; stored: the table's stored kernels; dense: "
         "dequantize every matrix to --dtype; a kernel's name (i8dot, i16dot, native, int4pack, blocks) runs that "
         "kernel; Q4_1:i8dot,Q8_0:i16dot a kernel per type.")]
Tune = Annotated[bool, typer.Option(
    "--tune", rich_help_panel=MODEL,
    help="First time this model's products on this machine (`llmtrace tune`: seconds, saved), then run with the "
         "pick (--weights tuned).")]
Device = Annotated[str, typer.Option(
    "--device", metavar="<cpu|cuda|mps>", rich_help_panel=MODEL,
    help="Where the model runs (cuda:1: the second GPU).")]
DryRun = Annotated[bool, typer.Option(
    "--dry-run", rich_help_panel=MODEL,
    help="Meta device: shapes and FLOPs for any preset, no weights, no memory.")]

# ---- sampling ------------------------------------------------------------------------------------------------------
MaxNewTokens = Annotated[int, typer.Option(
    "--max-new-tokens", "-n", metavar="<int>", rich_help_panel=SAMPLING,
    help="Stop after this many new tokens (or at EOS).")]
Temperature = Annotated[float, typer.Option(
    "--temperature", metavar="<float>", rich_help_panel=SAMPLING,
    help="0 = greedy (argmax); from 1e-06 up samples.")]
TopK = Annotated[Optional[int], typer.Option(
    "--top-k", metavar="<int>", rich_help_panel=SAMPLING,
    help="Keep the k most likely tokens (needs --temperature > 0).")]
TopP = Annotated[Optional[float], typer.Option(
    "--top-p", metavar="<float>", rich_help_panel=SAMPLING,
    help="Nucleus: keep the fewest tokens whose probability sums to p (needs --temperature > 0).")]
MinP = Annotated[Optional[float], typer.Option(
    "--min-p", metavar="<float>", rich_help_panel=SAMPLING,
    help="Drop tokens below this fraction of the top token's probability (needs --temperature > 0).")]
RepetitionPenalty = Annotated[float, typer.Option(
    "--repetition-penalty", metavar="<float>", rich_help_panel=SAMPLING,
    help="> 1 discourages tokens already seen (1 = off).")]
Seed = Annotated[Optional[int], typer.Option(
    "--seed", metavar="<int>", rich_help_panel=SAMPLING, help="Seed for sampling (same seed, same tokens).")]

# ---- views ---------------------------------------------------------------------------------------------------------
DetailChoice = Annotated[Detail, typer.Option(
    "--detail", rich_help_panel=VIEWS,
    help=DETAIL_HELP)]
Staged = Annotated[bool, typer.Option(
    "--staged", rich_help_panel=VIEWS,
    help="Run and trace stage by stage: the 17 stages of a layer apart, Q, K, V, gate and up as separate products. "
         "On the native decode step each stage is its own phase timed in C; elsewhere (the prefill, other models) "
         "each stage module is wrapped. By default the traced run is the fused path an untraced run takes.")]
NoTrace = Annotated[bool, typer.Option(
    "--no-trace", rich_help_panel=VIEWS,
    help="Time each whole step only: no per-layer or per-stage times, FLOPs or bytes (the run as an untraced "
         "program runs it).")]
Temperatures = Annotated[str, typer.Option(
    "--temperatures", metavar="<t,t,...>", rich_help_panel=VIEWS,
    help="The sampling lesson: the first token's logits at these temperatures side by side, with what "
         "top-k/top-p/min-p keep at each ('' = no lesson).")]
Lens = Annotated[bool, typer.Option(
    "--lens", rich_help_panel=VIEWS,
    help="Logit lens: what the residual stream after each layer would predict (top tokens, the chosen token's "
         "rank), per step; runs stage by stage.")]
Attention = Annotated[bool, typer.Option(
    "--attention", rich_help_panel=VIEWS,
    help="Attention weights of each step's predicted position, per layer and head (a heat strip over the prompt, "
         "the most focused heads); runs stage by stage.")]
AttentionSteps = Annotated[str, typer.Option(
    "--attention-steps", metavar="<n,n,...>", rich_help_panel=VIEWS,
    help="With --attention: the steps whose full weights the JSON keeps (0 = the prefill; each at most 65,536 "
         "values; every step keeps its per-head summary).")]
NoKvCache = Annotated[bool, typer.Option(
    "--no-kv-cache", rich_help_panel=VIEWS,
    help="After the run, generate its tokens again without a KV cache (every step recomputes the whole sequence) "
         "and compare time and FLOPs step by step (slow: about the prompt length x the run's decode time).")]

# ---- outputs -------------------------------------------------------------------------------------------------------
Json = Annotated[bool, typer.Option(
    "--json", rich_help_panel=OUTPUTS,
    help="Print the whole trace as JSON on stdout (schema: tracer/trace/trace_schema.json), the report going to "
         "stderr; with --batch-sweep, the sweep's record.")]
JsonFile = Annotated[Optional[Path], typer.Option(
    "--json-file", metavar="<path>", rich_help_panel=OUTPUTS,
    help="Write the whole trace as JSON to this file (gzip when it ends in .gz); `--json PATH`, its old spelling, "
         "still works.")]
ChromeTrace = Annotated[Optional[Path], typer.Option(
    "--chrome-trace", metavar="<path>", rich_help_panel=OUTPUTS,
    help="Write a Chrome/Perfetto trace (open in ui.perfetto.dev).")]
Html = Annotated[Optional[Path], typer.Option(
    "--html", metavar="<path>", rich_help_panel=OUTPUTS,
    help="Write a self-contained HTML report (figures as inline SVG; opens offline; needs the html extra: "
         "matplotlib).")]
SummaryJson = Annotated[bool, typer.Option(
    "--summary-json", rich_help_panel=OUTPUTS,
    help="Print the run's summary (TTFT, tokens/s, FLOPs, bytes, KV, peak memory, roofline verdict) as one JSON "
         "line on stdout, the report going to stderr.")]
TraceSteps = Annotated[str, typer.Option(
    "--trace-steps", metavar="<steps>", rich_help_panel=OUTPUTS,
    help="Decode steps that keep every stage record in the trace: all, or a list of first, last, every:K and step "
         "numbers (e.g. first,last,every:64); the others keep their sums, so totals stay exact and a long trace "
         "stays small.")]

# ---- performance ---------------------------------------------------------------------------------------------------
Threads = Annotated[Optional[int], typer.Option(
    "--threads", metavar="<int>", rich_help_panel=PERFORMANCE, help="torch CPU threads (default: torch's choice).")]
NoWarmup = Annotated[bool, typer.Option(
    "--no-warmup", rich_help_panel=PERFORMANCE,
    help="Skip the untimed warm-up pass, so the first prefill includes one-off kernel set-up (oneDNN JIT, "
         "allocator growth).")]
Repeat = Annotated[int, typer.Option(
    "--repeat", "-r", metavar="<int>", rich_help_panel=PERFORMANCE,
    help="Run the generation K times (after the one warm-up) and report the median and spread of TTFT, decode time "
         "per token and each stage, as llama-bench -r does; the first run is the one shown and saved.")]
BatchSweep = Annotated[Optional[str], typer.Option(
    "--batch-sweep", metavar="<b,b,...>", rich_help_panel=PERFORMANCE,
    help="Measure decode time per step at each batch size (real batched generations of --max-new-tokens - 1 timed "
         "greedy steps, --repeat rounds; prompts: --file's lines or the prompt repeated) beside the prediction from "
         "this machine's kernels measured at decode's shapes (saved for `roofline`) and the copy + GEMM roofline, "
         "with the crossover of each; e.g. 1,2,4,8,16,32,64.")]
NoRoofline = Annotated[bool, typer.Option(
    "--no-roofline", rich_help_panel=PERFORMANCE,
    help="Skip the roofline comparison in the summary (and the quick measurement of this machine that a first run "
         "makes when no 'this-machine' profile is saved).")]

# ---- parallel ------------------------------------------------------------------------------------------------------
Tp = Annotated[int, typer.Option(
    "--tp", metavar="<int>", rich_help_panel=PARALLEL,
    help="Tensor parallelism: split the model over N ranks (processes; gloo on CPU, NCCL with one GPU each on "
         "cuda), Megatron-style, and trace every rank and collective; also runs under torchrun --nproc-per-node N. "
         "With --dry-run: rank 0's shapes, FLOPs and collectives on the meta device.")]
TpTimeout = Annotated[float, typer.Option(
    "--tp-timeout", metavar="<seconds>", rich_help_panel=PARALLEL,
    help="--tp: the longest a collective waits for a missing rank; a rank that dies or hangs ends the run within "
         "about this long.")]
