"""`llmtrace run --batch-sweep 1,2,4,…`: parse, load, call the sweep engine (llmtrace.tracer.run.batch_sweep) and
render its record or write it as JSON (schema: tracer/run/batch_sweep_schema.json)."""

from __future__ import annotations

from functools import partial
from pathlib import Path
from typing import Any

from llmtrace.tracer.core.errors import BadArgumentError
from llmtrace.tracer.trace.records import RunSettings

# run options a sweep does not combine with: it times bare greedy batched decode steps
_EXCLUSIVE = ("--batch", "--dry-run", "--tp", "--lens", "--attention", "--no-kv-cache", "--html", "--chrome-trace",
              "--summary-json", "--staged")


def check_sweep_options(given: dict[str, bool], settings: RunSettings) -> None:
    """One line naming the first option --batch-sweep cannot take, or sampling it does not do."""
    for flag in _EXCLUSIVE:
        if given.get(flag):
            raise BadArgumentError(f"--batch-sweep times batched decode steps on its own; drop {flag}")
    if settings.temperature > 0:
        raise BadArgumentError("--batch-sweep decodes greedily (every batch the same work); drop --temperature")
    if settings.max_new_tokens < 3:
        raise BadArgumentError(f"--batch-sweep times --max-new-tokens - 1 decode steps per generation and needs at "
                               f"least 2; got --max-new-tokens {settings.max_new_tokens}")


def sweep_prompt_list(text: str, from_file: bool) -> tuple[str, ...]:
    """--file's non-empty lines (one per sequence), else the prompt."""
    if not from_file:
        return (text,)
    return tuple(line for line in text.splitlines() if line.strip())


def run_batch_sweep_cli(console: Any, settings: RunSettings, dtype: Any, batches_text: str, from_file: bool,
                        repeat: int, json_path: Path | None, json_stdout: Any, remeasure: bool = False) -> None:
    """Parse, load the model, sweep (with progress), then render or write the record. `remeasure`: measure the
    kernel choice again whatever is saved (`--remeasure`)."""
    from llmtrace.tracer.run.batch_sweep import parse_batches, sweep_prompts

    batches = parse_batches(batches_text)
    prompts = sweep_prompts(sweep_prompt_list(settings.prompt, from_file), batches, from_file)

    from llmtrace.tracer.checkpoint.resolve import bundled_source, classify_model, model_name

    source = classify_model(settings.model) if settings.model else bundled_source()

    import torch
    from rich.markup import escape

    from llmtrace.tracer.core.dtypes import COMPUTE_DTYPES, get_dtype
    from llmtrace.tracer.hardware.dtype_policy import dtype_of
    from llmtrace.tracer.load.kernel_pick import Reuse
    from llmtrace.tracer.load.loader import load_model
    from llmtrace.tracer.load.stored_weights import tensors_as_read
    from llmtrace.tracer.run.batch_sweep import sweep
    from llmtrace.tracer.run.decode_measure import measure_decode_ceilings
    from llmtrace.tracer.run.roofline_check import this_machine_profile

    if settings.threads is not None:
        torch.set_num_threads(settings.threads)
    what = model_name(source)
    with console.status(f"loading {what} …") as status:
        loaded = load_model(source, dtype=dtype, device=settings.device, weights=settings.weights or None,
                            reuse=Reuse.asked(remeasure),
                            progress=lambda step: status.update(f"measuring this machine's products for this model "
                                                                f"(first run only): {step} …"))
        compute = get_dtype(dtype_of(loaded.model.norm.weight.dtype).name, COMPUTE_DTYPES)
        status.update("this machine's roofline profile …")
        machine = this_machine_profile(settings.device.split(":")[0], compute,
                                       lambda what_: status.update(f"measuring this machine: {what_} …"))
    console.print(f"[dim]{escape(what)}: {escape(loaded.weight_format)}, weights {loaded.weights.mode}, {compute} "
                  f"activations, {torch.get_num_threads()} threads; batches {', '.join(map(str, batches))}[/]")
    stored = tensors_as_read(source, loaded.weights)
    with console.status("batch sweep …") as status:
        result = sweep(loaded, machine.profile, prompts, batches, partial(measure_decode_ceilings, repeats=3),
                       steps=settings.max_new_tokens - 1, repeats=repeat, stored=stored,
                       progress=lambda what_: status.update(f"batch sweep: {what_} …"))
    if json_path is not None:
        from llmtrace.cli.json_output import json_text

        text = json_text(result, indent=1) + "\n"
        if str(json_path) == "-":
            json_stdout.write(text)
            json_stdout.flush()
        else:
            from llmtrace.cli.output_files import write_output

            write_output(json_path, text)
            console.print(f"[dim]sweep written to {json_path} (JSON; schema tracer/run/batch_sweep_schema.json)[/]")
    from llmtrace.cli.render_batch_sweep import render_batch_sweep

    render_batch_sweep(console, result)
