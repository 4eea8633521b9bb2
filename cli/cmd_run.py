"""`llmtrace run "prompt"`: trace a real generation and show one token's journey, stage by stage, live.

Sections in the order of the journey: 1 tokenization, 2 embedding, 3 positions (RoPE), 4 transformer layers,
5 LM head and sampling, 6 decode (streamed live), 7 decode by stage, 8 summary. `--dry-run` builds any preset on the
meta device and shows shapes and FLOPs without weights.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Callable, Optional

import typer

from llmtrace.cli.app import app
from llmtrace.cli.errors import fail, run_guarded
from llmtrace.cli.options import Detail, DetailOption, compute_dtype_option
from llmtrace.tracer.core.dtypes import AUTO, AutoDtype, DType
from llmtrace.tracer.core.errors import BadArgumentError

if TYPE_CHECKING:  # the run's own modules are imported when it runs: `llmtrace --help` imports this one too
    from rich.console import Console

    from llmtrace.tracer.roofline.compare import MeasuredVsBound
    from llmtrace.tracer.trace.records import RunSettings
    from llmtrace.tracer.trace.report import RunReport
    from llmtrace.tracer.trace.repeat_summary import RepeatSummary
    from llmtrace.tracer.trace.run_trace import Trace
    from llmtrace.tracer.trace.summary_block import SummaryBlock

DRY_RUN_DEFAULT_PROMPT = "今天天气真"  # the seed article's example


@app.command("run", epilog=(  # \b: click keeps the lines as they are (one example each)
    "\b\nExamples:\n  llmtrace run \"今天天气真\"\n  llmtrace run capital --detail ops\n"
    "  llmtrace run --model llama-7b --dry-run\n"
    "  llmtrace run sky --temperature 0.8 --top-p 0.9 --seed 1 --json trace.json"))
def run_command(
    prompt: Annotated[Optional[str], typer.Argument(
        help="The prompt; '-' reads it from standard input; a sample name (capital, code, seed_zh, sky, story) "
             "traces that sample prompt (--literal traces the word itself).")] = None,
    model: Annotated[Optional[str], typer.Option(
        "--model", "-m", metavar="PATH|PRESET",
        help="A .gguf file or HF model folder (default: the bundled SmolLM2-135M-Instruct); a preset name with "
             "--dry-run.")] = None,
    max_new_tokens: Annotated[int, typer.Option(help="Stop after this many new tokens (or at EOS).")] = 32,
    temperature: Annotated[float, typer.Option(help="0 = greedy (argmax); from 1e-06 up samples.")] = 0.0,
    top_k: Annotated[Optional[int], typer.Option(help="Keep the k most likely tokens (needs --temperature > 0).")] = None,
    top_p: Annotated[Optional[float], typer.Option(help="Nucleus: keep the fewest tokens whose probability sums to "
                                                        "p (needs --temperature > 0).")] = None,
    min_p: Annotated[Optional[float], typer.Option(help="Drop tokens below min_p × the top probability.")] = None,
    repetition_penalty: Annotated[float, typer.Option(help="> 1 discourages tokens already seen (1 = off).")] = 1.0,
    seed: Annotated[Optional[int], typer.Option(help="Seed for sampling (same seed, same tokens).")] = None,
    dtype: Annotated[Any, compute_dtype_option(  # DType | AutoDtype: typer declares no unions
        "--dtype", help="Compute dtype; auto = the fastest numerically safe one, measured on this machine for this "
                        "model's products on first use (seconds; saved) and never fewer significand bits than the "
                        "checkpoint's.")] = AUTO,
    weights: Annotated[Optional[str], typer.Option(
        "--weights", metavar="auto|stored|dense|KERNEL",
        help="How a GGUF's matrices are multiplied. auto: the fastest acceptable of the stored kernels and dense "
             "dtypes, measured on this machine for this model on first use (saved); stored: the fastest acceptable "
             "stored kernel; dense: dequantize every matrix to --dtype; a kernel's name (i8dot, i16dot, native, "
             "int4pack, blocks) runs that kernel; Q4_1:i8dot,Q8_0:i16dot a kernel per type.")] = None,
    remeasure: Annotated[bool, typer.Option(
        "--remeasure", help="Measure this machine's products for this model again (--dtype/--weights auto) and "
                            "replace the saved choice: after a first run on a busy machine, a new CPU setting, or "
                            "to check it. `llmtrace hardware --measure` measures the roofline's ceilings again.")
    ] = False,
    device: Annotated[str, typer.Option(help="cpu, cuda or mps.")] = "cpu",
    threads: Annotated[Optional[int], typer.Option(help="torch CPU threads (default: torch's choice).")] = None,
    chat: Annotated[bool, typer.Option("--chat", help="Wrap the prompt in the model's chat template.")] = False,
    detail: DetailOption = Detail.layers,
    json_path: Annotated[Optional[Path], typer.Option(
        "--json", metavar="PATH", help="Write the whole trace as JSON (schema: tracer/trace/trace_schema.json); "
                                       "'-' = stdout alone.")] = None,
    chrome_trace: Annotated[Optional[Path], typer.Option(
        "--chrome-trace", metavar="PATH", help="Write a Chrome/Perfetto trace (open in ui.perfetto.dev).")] = None,
    html: Annotated[Optional[Path], typer.Option(
        "--html", metavar="PATH", help="Write a self-contained HTML report (figures as inline SVG; opens offline; "
                                       "needs the html extra: matplotlib).")] = None,
    no_trace: Annotated[bool, typer.Option("--no-trace", help="No hooks: time each step only.")] = False,
    trace_steps: Annotated[str, typer.Option(
        "--trace-steps", metavar="STEPS",
        help="Decode steps that keep every stage record in the trace: all, or a list of first, last, every:K and "
             "step numbers (e.g. first,last,every:64); the others keep their sums, so totals stay exact and a long "
             "trace stays small.")] = "all",
    staged: Annotated[bool, typer.Option(
        "--staged", help="Run and trace stage by stage: the 17 stages of a layer apart, Q, K, V, gate and up as "
                         "separate products. On the native decode step each stage is its own phase timed in C; "
                         "elsewhere (the prefill, other models) each stage module is wrapped. By default the traced "
                         "run is the fused path an untraced run takes.")] = False,
    summary_json: Annotated[bool, typer.Option(
        "--summary-json", help="Print the run's summary (TTFT, tokens/s, FLOPs, bytes, KV, peak memory, roofline "
                               "verdict) as one JSON line on stdout, the report going to stderr.")] = False,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Meta device: shapes and FLOPs for any preset, no "
                                                            "weights, no memory.")] = False,
    file: Annotated[Optional[Path], typer.Option("--file", "-f", help="Read the prompt from this file ('-': standard "
                                                                      "input).")] = None,
    literal: Annotated[bool, typer.Option("--literal", help="Trace PROMPT as given, even when it names a sample "
                                                            "prompt.")] = False,
    prompt_tokens: Annotated[Optional[int], typer.Option(
        help="--dry-run of a preset (no tokenizer): the prompt length to assume.")] = None,
    no_warmup: Annotated[bool, typer.Option(
        "--no-warmup", help="Skip the untimed warm-up pass, so the first prefill includes one-off kernel set-up "
                            "(oneDNN JIT, allocator growth).")] = False,
    repeat: Annotated[int, typer.Option(
        "--repeat", min=1, help="Run the generation K times (after the one warm-up) and report the median and "
                                "spread of TTFT, decode time per token and each stage, as llama-bench -r does; the "
                                "first run is the one shown and saved.")] = 1,
    temperatures: Annotated[str, typer.Option(
        metavar="T,T,...", help="The sampling lesson: the first token's logits at these temperatures side by side, "
                                "with what top-k/top-p/min-p keep at each ('' = no lesson).")] = "0.1,1,2",
    lens: Annotated[bool, typer.Option(
        "--lens", help="Logit lens: what the residual stream after each layer would predict (top tokens, the "
                       "chosen token's rank), per step; runs stage by stage.")] = False,
    attention: Annotated[bool, typer.Option(
        "--attention", help="Attention weights of each step's predicted position, per layer and head (a heat "
                            "strip over the prompt, the most focused heads); runs stage by stage.")] = False,
    attention_steps: Annotated[str, typer.Option(
        metavar="N,N,...", help="With --attention: the steps whose full weights the JSON keeps (0 = the prefill; "
                                "each at most 65,536 values; every step keeps its per-head summary).")] = "0",
    no_kv_cache: Annotated[bool, typer.Option(
        "--no-kv-cache", help="After the run, generate its tokens again without a KV cache (every step recomputes "
                              "the whole sequence) and compare time and FLOPs step by step (slow: about the prompt "
                              "length x the run's decode time).")] = False,
    batch: Annotated[Optional[int], typer.Option(
        "--batch", metavar="N", help="Generate N sequences together (one batched prefill, then one decode step for "
                                     "all): the prompts are --file's first N non-empty lines, or the prompt N times. "
                                     "Each has its own positions, sampler (seed + its index) and stop; finished ones "
                                     "leave the batch.")] = None,
    batch_sweep: Annotated[Optional[str], typer.Option(
        "--batch-sweep", metavar="B,B,...",
        help="Measure decode time per step at each batch size (real batched generations of --max-new-tokens - 1 "
             "timed greedy steps, --repeat rounds; prompts: --file's lines or the prompt repeated) beside the "
             "prediction from this machine's kernels measured at decode's shapes (saved for `roofline`) and the "
             "copy + GEMM roofline, with the crossover of each; e.g. 1,2,4,8,16,32,64.")] = None,
    no_roofline: Annotated[bool, typer.Option(
        "--no-roofline", help="Skip the roofline comparison in the summary (and the quick measurement of this "
                              "machine that a first run makes when no 'this-machine' profile is saved).")] = False,
    tp: Annotated[int, typer.Option(
        "--tp", min=1, help="Tensor parallelism: split the model over N ranks (processes; gloo on CPU, NCCL with one "
                            "GPU each on cuda), Megatron-style, and trace every rank and collective; also runs under "
                            "torchrun --nproc-per-node N. With --dry-run: rank 0's shapes, FLOPs and collectives on "
                            "the meta device.")] = 1,
    tp_timeout: Annotated[float, typer.Option(
        "--tp-timeout", min=0.5, metavar="SECONDS",
        help="--tp: the longest a collective waits for a missing rank; a rank that dies or hangs ends the run "
             "within about this long.")] = 60.0,
) -> None:
    """Trace a real generation: every stage of every token, with shapes, FLOPs, bytes and time."""
    from llmtrace.cli.console import ReaderGoneSafe, stdout_console
    from llmtrace.cli.interrupts import deferred_interrupts, stop_signals_interrupt
    from llmtrace.cli.output_files import check_outputs, check_writable, write_output
    from llmtrace.cli.prompt_input import resolve_prompt
    from llmtrace.tracer.trace.chrome import chrome_trace as chrome_trace_doc
    from llmtrace.tracer.trace.records import RunSettings
    from llmtrace.tracer.trace.run_trace import STOP_INTERRUPTED

    json_to_stdout = json_path is not None and str(json_path) == "-"
    if json_to_stdout and summary_json:
        raise fail("--json - and --summary-json both write to stdout; give --json a file path")
    stdout = ReaderGoneSafe(sys.stdout)  # a reader that leaves (`| head -1`) must not stop the run
    console = stdout_console(stderr=json_to_stdout or summary_json,
                             file=None if json_to_stdout or summary_json else stdout)

    def body() -> int:
        given = resolve_prompt(prompt, file, literal, DRY_RUN_DEFAULT_PROMPT if dry_run else None)
        text = given.text
        if given.source:
            console.print(f"[dim]prompt: {given.source}[/]")
        prompts = batch_prompts(text, batch, file) if batch is not None else ()
        settings = RunSettings(
            model=model or "", prompt=text, max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k,
            top_p=top_p, min_p=min_p, repetition_penalty=repetition_penalty, seed=seed, dtype=dtype.name,
            device=device, threads=threads, chat=chat, trace=not no_trace, dry_run=dry_run,
            prompt_tokens=prompt_tokens, warmup=not no_warmup, staged=staged,
            trace_steps=_trace_steps(trace_steps),
            temperatures=parse_temperatures(temperatures), no_kv_cache=no_kv_cache, lens=lens, attention=attention,
            attention_steps=parse_steps(attention_steps),
            batch=batch if batch is not None else 1, batch_prompts=prompts,
            weights=weights or "",
        )
        _check_settings(settings)
        if html is not None and settings.dry_run:
            raise BadArgumentError("--html reports a real generation; drop --dry-run")
        files = {"--json": None if json_to_stdout else json_path, "--chrome-trace": chrome_trace, "--html": html}
        check_outputs(files, {"--file": None if file is None or str(file) == "-" else file})
        for path in files.values():
            if path is not None:
                check_writable(path)  # before the model runs: a typo must not cost a whole generation
        if remeasure and (dry_run or tp > 1):
            raise BadArgumentError("--remeasure measures this machine for a real run on one device; drop --dry-run "
                                   "and --tp (a --tp run's ranks read the choice `llmtrace run --remeasure` saves)")
        if batch_sweep is not None:
            from llmtrace.cli.cmd_run_sweep import check_sweep_options, run_batch_sweep_cli

            check_sweep_options({"--batch": batch is not None, "--dry-run": dry_run, "--tp": tp > 1, "--lens": lens,
                                 "--attention": attention, "--no-kv-cache": no_kv_cache, "--html": html is not None,
                                 "--chrome-trace": chrome_trace is not None, "--summary-json": summary_json,
                                 "--staged": staged}, settings)
            with stop_signals_interrupt() as received:
                try:
                    run_batch_sweep_cli(console, settings, dtype, batch_sweep, file is not None, repeat,
                                        json_path, stdout, remeasure)
                except KeyboardInterrupt:
                    return received.exit_code
            return 0
        if repeat > 1 and dry_run:
            raise BadArgumentError("--repeat times real runs; drop --dry-run")
        if tp > 1 and (repeat > 1 or lens or attention or no_kv_cache or html is not None or batch is not None):
            raise BadArgumentError("--tp runs one sequence's generation over its ranks; drop --batch, --repeat, "
                                   "--lens, --attention, --no-kv-cache and --html (they look at one device's model)")
        written: list[str] = []

        def save(trace: Trace, block: SummaryBlock, comparison: MeasuredVsBound | None,
                 repeated: RepeatSummary | None = None, again: bool = False) -> None:
            """Write the outputs as soon as the run has its trace and summary, before the ending is rendered: nothing
            after it (rendering to a closed pipe, --repeat, a signal) can lose them. Stop signals wait for the
            writes. `again`: after --repeat's runs, the JSON once more with their spreads (`repeated`; stdout, which
            takes one document, gets the JSON only then)."""
            with deferred_interrupts(received):
                if json_path is not None and ((json_to_stdout or repeated is not None) if again
                                              else not (repeat > 1 and json_to_stdout)):
                    text = trace.to_json(indent=1, summary=block, repeat=repeated)
                    if json_to_stdout:
                        stdout.write(text + "\n")
                        stdout.flush()
                    else:
                        write_output(json_path, text)
                        if not again:
                            written.append(f"trace written to {json_path} (JSON; schema "
                                           "tracer/trace/trace_schema.json)")
                if again:
                    return
                if chrome_trace is not None:
                    write_output(chrome_trace, json.dumps(chrome_trace_doc(trace), ensure_ascii=False))
                    written.append(f"Chrome trace written to {chrome_trace} (open in ui.perfetto.dev)")
                if summary_json:
                    from llmtrace.cli.json_output import json_text

                    stdout.write(json_text(block, indent=None) + "\n")
                    stdout.flush()
                if html is not None:
                    from llmtrace.cli.render_html import html_report

                    write_output(html, html_report(trace, comparison))
                    written.append(f"HTML report written to {html} (self-contained: open it in any browser)")

        with stop_signals_interrupt() as received:
            if tp > 1 and not dry_run:
                from llmtrace.cli.cmd_run_tp import run_tensor_parallel_cli

                try:
                    trace, code = run_tensor_parallel_cli(console, settings, dtype, detail.value, tp, tp_timeout,
                                                          available_cpus(), save)
                except KeyboardInterrupt:  # before the ranks ran (their own stop goes through the launcher's gate)
                    return received.exit_code
                for line in written:
                    console.print(f"[dim]{line}[/]")
                if trace is not None and trace.stop_reason == STOP_INTERRUPTED:
                    return received.exit_code
                return code
            try:
                trace = _run(console, settings, dtype, detail.value, save, roofline=not no_roofline, repeat=repeat,
                             tp=tp, remeasure=remeasure)
                for line in written:
                    console.print(f"[dim]{line}[/]")
            except KeyboardInterrupt:  # while loading (nothing to keep) or after `save` (the files are whole)
                return received.exit_code
        return received.exit_code if trace.stop_reason == STOP_INTERRUPTED else 0

    code = run_guarded(body)
    if code:
        raise typer.Exit(code)


def batch_prompts(text: str, batch: int, file: Path | None) -> tuple[str, ...]:
    """--batch N's prompts: the first N non-empty lines of --file (or of standard input), else the prompt N times."""
    if batch < 1:
        raise BadArgumentError(f"--batch must be at least 1, got {batch}")
    if file is None:
        return (text,) * batch
    lines = [line for line in text.splitlines() if line.strip()]
    if len(lines) < batch:
        where = "standard input" if str(file) == "-" else str(file)
        raise BadArgumentError(f"--batch {batch} takes one prompt per line, but {where} has {len(lines)} non-empty "
                               f"line{'s' if len(lines) != 1 else ''}; give a smaller --batch or more lines")
    return tuple(lines[:batch])


def _trace_steps(spec: str) -> str:
    """--trace-steps, checked now and spelled canonically ('all' or StepSelection.describe())."""
    from llmtrace.tracer.trace.step_selection import StepSelection

    selection = StepSelection.parse(spec)
    return "all" if selection is None else selection.describe()


def parse_steps(text: str) -> tuple[int, ...]:
    """'0,3' -> (0, 3): step numbers, 0 = the prefill."""
    parts = [p.strip() for p in text.split(",") if p.strip()]
    if not all(p.isdigit() for p in parts):
        raise BadArgumentError(f"--attention-steps takes step numbers >= 0 separated by commas, e.g. 0,3; got {text!r}")
    return tuple(sorted({int(p) for p in parts}))


def parse_temperatures(text: str) -> tuple[float, ...]:
    """'0.1,1,2' -> (0.1, 1.0, 2.0); '' -> () (no lesson). Range checks are the engine's (check_temperatures)."""
    from llmtrace.tracer.run.sampling_lesson import check_temperatures

    parts = [p.strip() for p in text.split(",") if p.strip()]
    try:
        values = tuple(float(p) for p in parts)
    except ValueError:
        raise BadArgumentError(f"--temperatures takes numbers separated by commas, e.g. 0.1,1,2; got {text!r}") \
            from None
    return check_temperatures(values)


def _check_settings(settings: RunSettings) -> None:
    """Everything that depends only on the arguments, before a model is loaded or a header printed."""
    if settings.max_new_tokens < 1:
        raise BadArgumentError(f"--max-new-tokens must be at least 1, got {settings.max_new_tokens}")
    if settings.threads is not None:
        cpus = available_cpus()
        if not 1 <= settings.threads <= cpus:
            raise BadArgumentError(f"--threads must be between 1 and the {cpus} CPUs this process may use, got "
                                   f"{settings.threads}; more threads than CPUs only slows torch down")
    if settings.prompt_tokens is not None and settings.prompt_tokens < 1:
        raise BadArgumentError(f"--prompt-tokens must be at least 1, got {settings.prompt_tokens}")
    if settings.dry_run and (settings.no_kv_cache or settings.lens or settings.attention):
        raise BadArgumentError("--no-kv-cache, --lens and --attention look at a real generation; drop --dry-run")
    if settings.dry_run and settings.trace is False:
        raise BadArgumentError("--dry-run shows traced shapes and FLOPs; drop --no-trace")
    if not settings.dry_run:
        if not settings.prompt:
            raise BadArgumentError("the prompt is empty; give some text, e.g. llmtrace run \"今天天气真\"")
        from llmtrace.tracer.run.generate import sampling_params

        sampling_params(settings)  # temperature, top-k/p, min-p, penalty, seed: one line now, not after loading
    if settings.batch_prompts:
        from llmtrace.tracer.run.batch_generate import check_batch_settings

        check_batch_settings(settings)


def available_cpus() -> int:
    """CPUs this process may run on (its affinity mask, as taskset or a container's cpuset sets it)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _run(console: Console, settings: RunSettings, dtype: DType | AutoDtype, detail: str,
         save: Callable[..., None], roofline: bool = True,
         repeat: int = 1, tp: int = 1, remeasure: bool = False) -> Trace:
    """The run, rendered as it goes; `save` gets its trace, summary block and roofline comparison (None: none)
    before the ending is rendered, and with --repeat once more after the repeats with their spreads. `remeasure`:
    measure the kernel choice again whatever is saved."""
    from rich.live import Live

    from llmtrace.cli.render_attention import render_attention
    from llmtrace.cli.render_lens import render_lens
    from llmtrace.cli.render_run import (
        render_embedding,
        render_header,
        render_kernel_choice,
        render_layers,
        render_lm_head,
        render_positions,
        render_tokenization,
    )
    from llmtrace.cli.render_run_batch import BatchDecodeView, render_batch_first_tokens, render_batch_tokenization
    from llmtrace.cli.render_run_live import DecodeView, RedrawPacer
    from llmtrace.cli.render_run_report import render_ending
    from llmtrace.cli.render_sampling_lesson import render_sampling_lesson
    from llmtrace.cli.console import warn
    from llmtrace.tracer.checkpoint.resolve import bundled_source, classify_model, model_name
    from llmtrace.tracer.trace.report import run_report
    from llmtrace.tracer.trace.run_trace import STOP_INTERRUPTED
    from llmtrace.tracer.trace.summary_block import summary_block

    # Classified before torch is imported: a wrong --model fails in a blink, with the error every command gives.
    source = classify_model(settings.model) if settings.model else bundled_source()

    import torch

    from llmtrace.tracer.hardware.dtype_policy import dtype_of
    from llmtrace.tracer.load.kernel_pick import Reuse
    from llmtrace.tracer.load.loader import load_model
    from llmtrace.tracer.run.batch_generate import BatchTokenized, generation_for
    from llmtrace.tracer.run.generate import Finished, PrefillDone, Tokenized, TokenStep
    from llmtrace.tracer.run.no_cache import NoCacheProgress

    if settings.threads is not None:
        torch.set_num_threads(settings.threads)
    what = model_name(source)
    tp_dry = None  # --dry-run --tp N: rank 0's shard on the meta device (tracer/run/tp_dry_run.py)
    with console.status(f"loading {what} …") as status:
        if tp > 1:
            from llmtrace.tracer.run.tp_dry_run import TensorParallelDryRun

            tp_dry = TensorParallelDryRun(settings.model or None, dtype, tp)
            loaded = tp_dry.loaded
        else:
            loaded = load_model(source, dtype=dtype, device=settings.device, dry_run=settings.dry_run,
                                weights=settings.weights or None, reuse=Reuse.asked(remeasure),
                                progress=lambda step: status.update(f"measuring this machine's products for this "
                                                                    f"model (first run only): {step} …"))
    for note in (loaded.cache_note, loaded.kernel_note):
        if note:
            warn(note, "note")
    weights = loaded.weights
    weights_note = (f"weights {weights.label}: {weights.reason}"
                    if weights.reason and weights.news and not settings.dry_run else "")
    param = loaded.model.norm.weight  # dense in the compute dtype (a stored matrix's parameter is a placeholder)
    render_header(console, loaded.config, loaded.weight_format, loaded.load_seconds, str(param.device),
                  torch.get_num_threads(), str(param.dtype).removeprefix("torch."), settings.dry_run, weights_note)
    render_kernel_choice(console, loaded.kernels, dtype_of(param.dtype).name)
    generation = generation_for(loaded, settings)
    batched = bool(settings.batch_prompts)
    live: Live | None = None
    pacer = RedrawPacer()
    view: DecodeView | BatchDecodeView | None = None
    trace: Trace | None = None
    tokenization = None
    status: Any = None  # the --no-kv-cache replay's progress line
    try:
        for event in generation.events():
            if isinstance(event, BatchTokenized):
                render_batch_tokenization(console, event.records, event.pads)
            elif isinstance(event, Tokenized):
                tokenization = event.record
                render_tokenization(console, event.record, event.prompt_tokens, settings.prompt_tokens is not None)
            elif isinstance(event, PrefillDone):
                render_embedding(console, loaded.config, event.stages, settings.dry_run)
                render_positions(console, event.rope, tokenization, loaded.config.n_layers)
                render_layers(console, event.stages, event.step, detail, settings.dry_run)
                if batched:
                    render_batch_first_tokens(console, event.step)
                else:
                    render_lm_head(console, event.stages, event.step, settings, loaded.config, settings.dry_run)
                render_sampling_lesson(console, event.lesson, event.step, settings)
                render_lens(console, event.lens)
                render_attention(console, event.attention)
                if batched:
                    view = BatchDecodeView(settings.batch, event.limit, event.step)
                elif not settings.dry_run:
                    view = DecodeView(event.limit, event.step)
                if view is not None:
                    # "visible": the final render (every step) may be taller than the terminal; while streaming,
                    # the view keeps itself to the terminal's height. No refresh thread: it would render beside the
                    # model's steps, on the cores they use; the loop redraws between steps, paced.
                    live = Live(view, console=console, auto_refresh=False, transient=False,
                                vertical_overflow="visible")
                    live.start()
            elif isinstance(event, TokenStep):
                if view is not None and live is not None:
                    view.add(event.step, event.generated)
                    pacer.redraw(live.refresh)
            elif isinstance(event, NoCacheProgress):
                if live is not None and view is not None:  # the decode stream is done: show the replay's progress
                    view.finish(False)
                    live.refresh()
                    live.stop()
                    live = None
                    if not console.is_terminal:
                        console.line()
                if status is None:
                    status = console.status("")
                    status.start()
                status.update(f"without a KV cache: step {event.done}/{event.total} recomputed "
                              f"({event.step.positions} tokens) …")
            elif isinstance(event, Finished):
                trace = event.trace
    except KeyboardInterrupt:
        trace = generation.trace()
    finally:
        generation.close()
        if status is not None:
            status.stop()
        if live is not None:
            if view is not None:
                view.finish(trace is None or trace.stop_reason == STOP_INTERRUPTED)
            live.stop()
            if not console.is_terminal:
                console.line()  # Live leaves no newline after its last render when it cannot redraw
    if trace is None:
        trace = generation.trace()
    if tp_dry is not None:
        trace = tp_dry.finish(trace, generation.origin_ns)
    report = run_report(trace)
    comparison, note = (None, "")
    if roofline and not settings.dry_run:
        try:
            comparison, note = _roofline_for(console, trace, report, source, loaded)
        except KeyboardInterrupt:  # stopped while measuring: the run itself is kept
            note = "roofline: skipped (interrupted)"
    block = summary_block(trace, comparison, report.summary)
    save(trace, block, comparison)
    if tp_dry is not None:  # one rank's pass: the one-device estimate check does not apply, the per-device one does
        from llmtrace.cli.render_tp import render_tp_dry_run
        from llmtrace.tracer.trace.tp_summary import tp_dry_run_passes

        render_tp_dry_run(console, tp_dry_run_passes(trace), tp)
        return trace
    render_ending(console, trace, detail, report, comparison, note)
    if repeat > 1:
        repeated = _repeat(console, loaded, trace, repeat) if trace.stop_reason != STOP_INTERRUPTED else None
        save(trace, block, comparison, repeated, again=True)
    return trace


def _repeat(console: Console, loaded: object, first: Trace, repeat: int) -> RepeatSummary | None:
    """K - 1 more runs of the same generation (same seed, so the same tokens; no second warm-up), then the
    medians and spreads of all K (llmtrace.tracer.trace.repeat_summary)."""
    from dataclasses import replace

    from llmtrace.cli.render_run_repeat import render_repeat
    from llmtrace.tracer.run.batch_generate import generation_for
    from llmtrace.tracer.trace.repeat_summary import repeat_summary

    # the repeats time the generation itself: no second sampling lesson or no-cache replay (both after the timed steps)
    settings = replace(first.settings, warmup=False, seed_drawn=False, temperatures=(), no_kv_cache=False)
    traces = [first]
    try:
        with console.status(f"repeating the generation: 2 of {repeat} …") as status:
            for k in range(2, repeat + 1):
                status.update(f"repeating the generation: {k} of {repeat} …")
                generation = generation_for(loaded, settings)
                try:
                    traces.append(generation.run())
                finally:
                    generation.close()
    except KeyboardInterrupt:
        console.print(f"[dim]--repeat interrupted after {len(traces)} runs[/]")
    if len(traces) == 1:
        return None
    summary = repeat_summary(traces)
    render_repeat(console, summary)
    return summary


def _roofline_for(console: Console, trace: Trace, report: RunReport, source: Any = None,
                  loaded: Any = None) -> tuple[MeasuredVsBound | None, str]:
    """The run against this machine's roofline (llmtrace.tracer.run.roofline_check), or why there is none; says so
    when a first run measured this machine for it. A run that read its weights as stored is bounded by those bytes."""
    from llmtrace.cli import formatting as fmt
    from llmtrace.cli.console import warn
    from llmtrace.tracer.load.stored_weights import tensors_as_read
    from llmtrace.tracer.run.roofline_check import run_roofline

    try:
        stored = () if loaded is None else tensors_as_read(source, loaded.weights)
        with console.status("roofline …") as status:
            result = run_roofline(trace, report.summary,
                                  progress=lambda what: status.update(f"measuring this machine for the roofline "
                                                                      f"(first run only): {what} …"), stored=stored)
    except Exception as exc:  # optional: the run and its files stand whatever fails here
        if os.environ.get("LLMTRACE_DEBUG") == "1":
            raise
        return None, f"roofline: skipped after an internal error ({type(exc).__name__}: {exc})"
    if result.measured is not None and result.not_saved:  # a busy machine, a read-only or full home: this run still
        #                                                     has its bound
        warn(f"roofline: measured this machine in {fmt.duration_s(result.measured.seconds)} "
             f"({', '.join(result.measured.dtypes)} GEMMs, copy); not saved: {result.not_saved}")
    if result.measured is not None and result.saved_to is not None:
        home = str(Path.home())
        shown = "~" + result.saved_to[len(home):] if result.saved_to.startswith(home + os.sep) else result.saved_to
        console.print(f"[dim]roofline: measured this machine in {fmt.duration_s(result.measured.seconds)} "
                      f"({', '.join(result.measured.dtypes)} GEMMs, copy); saved as 'this-machine' in {shown}[/]")
    return result.comparison, result.note
