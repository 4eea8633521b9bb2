"""The journey of one run on the terminal as the generation's events arrive: each section when its event comes, the
decode steps streamed live, the --no-kv-cache replay's progress line. Returns the run's trace."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rich.console import Console

    from llmtrace.tracer.trace.records import RunSettings
    from llmtrace.tracer.trace.run_trace import Trace


PREFILL_NOTE_BYTES = 1e9  # a prefill whose attention takes this much is said before it runs


def say_prefill_memory(console: Console, n_heads: int, tokens: int) -> None:
    """Before a long prompt's prefill: what its attention scores will take (the model refuses it when that does not
    fit: tracer/hardware/memory.py), so a run that grows by gigabytes says why beforehand."""
    from llmtrace.tracer.hardware.memory import prefill_attention_bytes

    need = prefill_attention_bytes(n_heads, 1, tokens, tokens)
    if need >= PREFILL_NOTE_BYTES:
        console.print(f"[dim]prefill of {tokens:,} tokens: its attention scores take {need / 1e9:,.1f} GB at their "
                      f"peak ({n_heads} heads × {tokens:,} × {tokens:,} positions, one layer at a time)[/]")


class JourneyStream:
    """Renders one generation's events (tracer/run/generate.py) in order; `run` drives it to the trace."""

    def __init__(self, console: Console, loaded: Any, settings: RunSettings, detail: str) -> None:
        from llmtrace.cli.render_run_live import RedrawPacer

        self.console, self.loaded, self.settings, self.detail = console, loaded, settings, detail
        self.batched = bool(settings.batch_prompts)
        self.live: Any = None  # rich.live.Live while the decode streams
        self.view: Any = None  # DecodeView | BatchDecodeView
        self.status: Any = None  # the --no-kv-cache replay's progress line
        self.tokenization: Any = None
        self.pacer = RedrawPacer()

    def run(self, generation: Any) -> Trace:
        from llmtrace.tracer.run.generate import Finished
        from llmtrace.tracer.trace.run_trace import STOP_INTERRUPTED

        trace: Trace | None = None
        try:
            for event in generation.events():
                if isinstance(event, Finished):
                    trace = event.trace
                else:
                    self.show(event)
        except KeyboardInterrupt:
            trace = generation.trace()
        finally:
            generation.close()
            if self.status is not None:
                self.status.stop()
            self._stop_live(trace is None or trace.stop_reason == STOP_INTERRUPTED)
        return trace if trace is not None else generation.trace()

    def show(self, event: Any) -> None:
        from llmtrace.cli.render_run import render_tokenization
        from llmtrace.cli.render_run_batch import render_batch_tokenization
        from llmtrace.tracer.run.batch_generate import BatchTokenized
        from llmtrace.tracer.run.generate import PrefillDone, Tokenized, TokenStep
        from llmtrace.tracer.run.no_cache import NoCacheProgress

        if isinstance(event, BatchTokenized):
            render_batch_tokenization(self.console, event.records, event.pads)
        elif isinstance(event, Tokenized):
            self.tokenization = event.record
            render_tokenization(self.console, event.record, event.prompt_tokens,
                                self.settings.prompt_tokens is not None)
            if not self.settings.dry_run:
                say_prefill_memory(self.console, self.loaded.config.n_heads, len(event.record.ids))
                from llmtrace.cli.render_run_progress import prefill_line

                # seconds at 7B: said until the first panel
                self.status = self.console.status(prefill_line(event.prompt_tokens, self.loaded.config.n_layers,
                                                               self.settings.warmup), refresh_per_second=4)
                self.status.start()
        elif isinstance(event, PrefillDone):
            if self.status is not None:
                self.status.stop()
                self.status = None
            self._prefill(event)
        elif isinstance(event, TokenStep):
            if self.view is not None and self.live is not None:
                self.view.add(event.step, event.generated)
                self.pacer.redraw(self.live.refresh)
        elif isinstance(event, NoCacheProgress):
            self._replay_progress(event)

    def _prefill(self, event: Any) -> None:
        """Sections 2-5 (and the lesson, lens and attention), then the live decode view."""
        from llmtrace.cli.render_attention import render_attention
        from llmtrace.cli.render_lens import render_lens
        from llmtrace.cli.render_run import render_embedding, render_layers, render_lm_head, render_positions
        from llmtrace.cli.render_run_batch import render_batch_first_tokens
        from llmtrace.cli.render_kernels import numerics_note
        from llmtrace.cli.render_sampling_lesson import render_sampling_lesson

        console, config, settings, dry = self.console, self.loaded.config, self.settings, self.settings.dry_run
        tp = getattr(self.loaded.model, "tp", 1)  # a --tp run's rank 0 (its dry run too): its slice of the rows
        render_embedding(console, config, event.stages, dry, tp)
        render_positions(console, event.rope, self.tokenization, config)
        render_layers(console, event.stages, event.step, self.detail, dry)
        if self.batched:
            render_batch_first_tokens(console, event.step)
        else:
            render_lm_head(console, event.stages, event.step, settings, config, dry, tp)
        numerics = numerics_note(self.loaded.kernels)
        render_sampling_lesson(console, event.lesson, event.step, settings, numerics)
        render_lens(console, event.lens, numerics)
        render_attention(console, event.attention, numerics)
        self._start_live(event)

    def _start_live(self, event: Any) -> None:
        from rich.live import Live

        from llmtrace.cli.render_run_batch import BatchDecodeView
        from llmtrace.cli.render_run_live import DecodeView

        if self.batched:
            self.view = BatchDecodeView(self.settings.batch, event.limit, event.step)
        elif not self.settings.dry_run:
            self.view = DecodeView(event.limit, event.step)
        if self.view is not None:
            # "visible": the final render (every step) may be taller than the terminal; while streaming, the view
            # keeps itself to the terminal's height. No refresh thread: it would render beside the model's steps,
            # on the cores they use; the loop redraws between steps, paced.
            self.live = Live(self.view, console=self.console, auto_refresh=False, transient=False,
                             vertical_overflow="visible")
            self.live.start()

    def _replay_progress(self, event: Any) -> None:
        if self.live is not None and self.view is not None:  # the decode stream is done: show the replay's progress
            self.view.finish(False)
            self.live.refresh()
            self._stop_live(None)
        if self.status is None:
            self.status = self.console.status("")
            self.status.start()
        self.status.update(f"without a KV cache: step {event.done}/{event.total} recomputed "
                           f"({event.step.positions} tokens) …")

    def _stop_live(self, interrupted: bool | None) -> None:
        """Stop the live view; `interrupted` (None: already finished) is how its last render ends."""
        if self.live is None:
            return
        if self.view is not None and interrupted is not None:
            self.view.finish(interrupted)
        self.live.stop()
        self.live = None
        if not self.console.is_terminal:
            self.console.line()  # Live leaves no newline after its last render when it cannot redraw
