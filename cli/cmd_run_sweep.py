"""`llmtrace run --batch-sweep 1,2,4,…`: load, call the sweep engine (llmtrace.tracer.run.batch_sweep) and
render its record or write it as JSON (schema: tracer/run/batch_sweep_schema.json)."""

from __future__ import annotations

from functools import partial
from typing import Any

from llmtrace.tracer.trace.records import RunSettings


def sweep_prompt_list(text: str, from_file: bool) -> tuple[str, ...]:
    """--file's non-empty lines (one per sequence), else the prompt."""
    if not from_file:
        return (text,)
    return tuple(line for line in text.splitlines() if line.strip())


def run_batch_sweep_cli(console: Any, settings: RunSettings, dtype: Any, batches: tuple[int, ...], from_file: bool,
                        repeat: int, outputs: Any) -> None:
    """Load the model, sweep (with progress), then write the record (cli/run_outputs.py) and render it. `batches`:
    --batch-sweep parsed (cli/run_args.py checked it and what it combines with)."""
    from llmtrace.tracer.run.batch_sweep import sweep_prompts

    prompts = sweep_prompts(sweep_prompt_list(settings.prompt, from_file), batches, from_file)

    from llmtrace.tracer.checkpoint.resolve import bundled_source, classify_model, model_name

    source = classify_model(settings.model) if settings.model else bundled_source()

    import torch
    from rich.markup import escape

    from llmtrace.tracer.core.dtypes import COMPUTE_DTYPES, get_dtype
    from llmtrace.tracer.hardware.dtype_policy import dtype_of
    from llmtrace.tracer.load.loader import load_model
    from llmtrace.tracer.load.stored_weights import tensors_as_read
    from llmtrace.tracer.run.batch_sweep import sweep
    from llmtrace.tracer.run.decode_measure import measure_decode_ceilings
    from llmtrace.tracer.run.roofline_check import this_machine_profile

    if settings.threads is not None:
        torch.set_num_threads(settings.threads)
    what = model_name(source)
    with console.status(f"loading {what} …") as status:
        loaded = load_model(source, dtype=dtype, device=settings.device, weights=settings.weights or None)
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
    from llmtrace.cli.json_output import json_text

    outputs.save_record(json_text(result, indent=1), "sweep", "tracer/run/batch_sweep_schema.json")
    outputs.say_written(console)
    from llmtrace.cli.render_batch_sweep import render_batch_sweep

    render_batch_sweep(console, result)
