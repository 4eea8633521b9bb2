"""`llmtrace run`'s options, checked before torch is imported: one dataclass per help group, each parsing and
checking its own values once (`parse`), then the few rules that join two groups (COMBINATIONS), in one table.

Nothing here imports torch (tests/test_run_options.py checks it in a subprocess), so a bad value costs the user a
blink, not the seconds torch takes to import. Every message names the option as it is typed (--top-k, not top_k).
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Callable, ClassVar, Optional

from llmtrace.cli import run_options as panel
from llmtrace.tracer.core.dtypes import AutoDtype, DType
from llmtrace.tracer.core.errors import BadArgumentError
from llmtrace.tracer.trace.records import RunSettings

DEVICE_TYPES = ("cpu", "cuda", "mps")


@dataclass(frozen=True, slots=True)
class InputArgs:
    PANEL: ClassVar[str] = panel.INPUT
    prompt: Optional[str]
    file: Optional[Path]
    literal: bool
    chat: bool
    prompt_len: Optional[int]
    batch: Optional[int]

    def __post_init__(self) -> None:
        at_least_one("--prompt-len", self.prompt_len)
        at_least_one("--batch", self.batch)


@dataclass(frozen=True, slots=True)
class ModelArgs:
    PANEL: ClassVar[str] = panel.MODEL
    model: Optional[str]
    dtype: Any  # DType | AutoDtype, parsed by the option (cli/options.py)
    weights: Optional[str]
    tune: bool
    device: str
    dry_run: bool

    def __post_init__(self) -> None:
        kind, _, index = self.device.partition(":")
        if kind not in DEVICE_TYPES or (index and not (index.isdigit() and kind == "cuda")):
            raise BadArgumentError(f"--device must be cpu, cuda, cuda:N or mps, got {self.device!r}")


@dataclass(frozen=True, slots=True)
class SamplingArgs:
    PANEL: ClassVar[str] = panel.SAMPLING
    max_new_tokens: int
    temperature: float
    top_k: Optional[int]
    top_p: Optional[float]
    min_p: Optional[float]
    repetition_penalty: float
    seed: Optional[int]

    def __post_init__(self) -> None:
        from llmtrace.tracer.run.sampling_params import SamplingParams

        if self.max_new_tokens < 1:
            raise BadArgumentError(f"--max-new-tokens must be at least 1, got {self.max_new_tokens}")
        SamplingParams(temperature=self.temperature, top_k=self.top_k or 0,  # the sampler's own checks
                       top_p=1.0 if self.top_p is None else self.top_p, min_p=self.min_p or 0.0,
                       repetition_penalty=self.repetition_penalty, seed=self.seed)


@dataclass(frozen=True, slots=True)
class ViewArgs:
    PANEL: ClassVar[str] = panel.VIEWS
    detail: Any  # options.Detail
    staged: bool
    no_trace: bool
    temperatures: tuple[float, ...]  # given as "0.1,1,2"
    lens: bool
    attention: bool
    attention_steps: tuple[int, ...]  # given as "0,3"
    no_kv_cache: bool

    @classmethod
    def parse(cls, raw: dict[str, Any]) -> ViewArgs:
        return cls(**{**raw, "temperatures": parse_temperatures(raw["temperatures"]),
                      "attention_steps": parse_steps(raw["attention_steps"])})


@dataclass(frozen=True, slots=True)
class OutputArgs:
    PANEL: ClassVar[str] = panel.OUTPUTS
    json: bool  # the trace on stdout
    json_file: Optional[Path]
    chrome_trace: Optional[Path]
    html: Optional[Path]
    summary_json: bool
    trace_steps: str  # canonical: "all" or StepSelection.describe()

    @classmethod
    def parse(cls, raw: dict[str, Any]) -> OutputArgs:
        from llmtrace.tracer.trace.step_selection import StepSelection

        selection = StepSelection.parse(raw["trace_steps"])
        return cls(**{**raw, "trace_steps": "all" if selection is None else selection.describe()})

    def __post_init__(self) -> None:
        if self.html is not None and missing_module("matplotlib"):
            raise BadArgumentError("--html draws its figures with matplotlib, which is not installed; install it "
                                   "with pip install 'llmtrace[html]', or drop --html")

    @property
    def to_stdout(self) -> bool:
        """JSON takes stdout (--json, --summary-json): the report goes to stderr."""
        return self.json or self.summary_json

    def check_paths(self, prompt_file: Path | None) -> None:
        """Before the model runs: a typo must not cost a whole generation."""
        from llmtrace.cli.output_files import check_outputs, check_writable

        files = {"--json-file": self.json_file, "--chrome-trace": self.chrome_trace, "--html": self.html}
        check_outputs(files, {"--file": None if prompt_file is None or str(prompt_file) == "-" else prompt_file})
        for path in files.values():
            if path is not None:
                check_writable(path)


@dataclass(frozen=True, slots=True)
class PerformanceArgs:
    PANEL: ClassVar[str] = panel.PERFORMANCE
    threads: Optional[int]
    no_warmup: bool
    repeat: int
    batch_sweep: Optional[tuple[int, ...]]  # given as "1,2,4"
    no_roofline: bool

    @classmethod
    def parse(cls, raw: dict[str, Any]) -> PerformanceArgs:
        from llmtrace.tracer.run.batch_spec import parse_batches

        sweep = raw["batch_sweep"]
        return cls(**{**raw, "batch_sweep": None if sweep is None else parse_batches(sweep)})

    def __post_init__(self) -> None:
        at_least_one("--repeat", self.repeat)
        if self.threads is not None:
            cpus = available_cpus()
            if not 1 <= self.threads <= cpus:
                raise BadArgumentError(f"--threads must be between 1 and the {cpus} CPUs this process may use, got "
                                       f"{self.threads}; more threads than CPUs only slows torch down")


@dataclass(frozen=True, slots=True)
class ParallelArgs:
    PANEL: ClassVar[str] = panel.PARALLEL
    tp: int
    tp_timeout: float

    def __post_init__(self) -> None:
        at_least_one("--tp", self.tp)
        if not self.tp_timeout >= 0.5:  # also refuses nan
            raise BadArgumentError(f"--tp-timeout must be at least 0.5 seconds, got {self.tp_timeout}")


GROUPS = (InputArgs, ModelArgs, SamplingArgs, ViewArgs, OutputArgs, PerformanceArgs, ParallelArgs)


@dataclass(frozen=True, slots=True)
class RunArgs:
    """Every option of `run`, by group, checked."""

    input: InputArgs
    model: ModelArgs
    sampling: SamplingArgs
    views: ViewArgs
    outputs: OutputArgs
    performance: PerformanceArgs
    parallel: ParallelArgs

    @classmethod
    def parse(cls, raw: dict[str, Any]) -> RunArgs:
        """The command's parameters (name -> value, as typer passes them) in their groups, each group checked in
        the help's order, then the rules across groups; BadArgumentError for the first value refused."""
        unknown = set(raw) - {f.name for group in GROUPS for f in fields(group)}
        if unknown:  # a new option declared in run_options.py but given no group here
            raise TypeError(f"run options without a group in cli/run_args.py: {sorted(unknown)}")
        groups = [_parse_group(group, raw) for group in GROUPS]
        args = cls(*groups)
        for broken, message in COMBINATIONS:
            if broken(args):
                raise BadArgumentError(message(args) if callable(message) else message)
        args.outputs.check_paths(args.input.file)
        return args

    @property
    def dtype(self) -> DType | AutoDtype:
        return self.model.dtype

    def settings(self, prompt: str, batch_prompts: tuple[str, ...] = ()) -> RunSettings:
        """The engine's record of what was asked (tracer/trace/records.py), for `prompt` as read."""
        i, m, s, v, o, p = self.input, self.model, self.sampling, self.views, self.outputs, self.performance
        settings = RunSettings(
            model=m.model or "", prompt=prompt, max_new_tokens=s.max_new_tokens, temperature=s.temperature,
            top_k=s.top_k, top_p=s.top_p, min_p=s.min_p, repetition_penalty=s.repetition_penalty, seed=s.seed,
            dtype=m.dtype.name, device=m.device, threads=p.threads, chat=i.chat, trace=not v.no_trace,
            dry_run=m.dry_run, prompt_tokens=i.prompt_len, warmup=not p.no_warmup, staged=v.staged,
            trace_steps=o.trace_steps, temperatures=v.temperatures, no_kv_cache=v.no_kv_cache, lens=v.lens,
            attention=v.attention, attention_steps=v.attention_steps,
            batch=i.batch if i.batch is not None else 1, batch_prompts=batch_prompts, weights=m.weights or "",
        )
        if batch_prompts:
            from llmtrace.tracer.run.batch_spec import check_batch_settings

            check_batch_settings(settings)
        return settings


def _parse_group(group: Any, raw: dict[str, Any]) -> Any:
    own = {f.name: raw[f.name] for f in fields(group)}
    return group.parse(own) if hasattr(group, "parse") else group(**own)


# --batch-sweep times bare greedy batched decode steps: the options it does not combine with
_SWEEP_EXCLUSIVE: tuple[tuple[str, Callable[[RunArgs], bool]], ...] = (
    ("--batch", lambda a: a.input.batch is not None), ("--dry-run", lambda a: a.model.dry_run),
    ("--tp", lambda a: a.parallel.tp > 1), ("--lens", lambda a: a.views.lens),
    ("--attention", lambda a: a.views.attention), ("--no-kv-cache", lambda a: a.views.no_kv_cache),
    ("--html", lambda a: a.outputs.html is not None), ("--chrome-trace", lambda a: a.outputs.chrome_trace is not None),
    ("--summary-json", lambda a: a.outputs.summary_json), ("--staged", lambda a: a.views.staged),
)


def _sweep_conflict(args: RunArgs) -> str:
    return next((flag for flag, given in _SWEEP_EXCLUSIVE if given(args)), "")


def _sweeping(args: RunArgs) -> bool:
    return args.performance.batch_sweep is not None


# (is the combination given?, the message): the rules that join options of two groups, checked in this order
COMBINATIONS: tuple[tuple[Callable[[RunArgs], bool], Any], ...] = (
    (lambda a: a.outputs.json and a.outputs.summary_json,
     "--json and --summary-json both write to stdout; write the trace to a file with --json-file PATH"),
    (lambda a: a.model.dry_run and (a.views.no_kv_cache or a.views.lens or a.views.attention),
     "--no-kv-cache, --lens and --attention look at a real generation; drop --dry-run"),
    (lambda a: a.model.dry_run and a.views.no_trace, "--dry-run shows traced shapes and FLOPs; drop --no-trace"),
    (lambda a: a.model.dry_run and a.outputs.html is not None, "--html reports a real generation; drop --dry-run"),
    (lambda a: a.model.tune and (a.model.dry_run or a.parallel.tp > 1 or bool(a.model.weights)),
     "--tune times this machine for a real run on one device with its own pick; drop --dry-run, --tp and --weights"),
    (lambda a: _sweeping(a) and bool(_sweep_conflict(a)),
     lambda a: f"--batch-sweep times batched decode steps on its own; drop {_sweep_conflict(a)}"),
    (lambda a: _sweeping(a) and a.sampling.temperature > 0,
     "--batch-sweep decodes greedily (every batch the same work); drop --temperature"),
    (lambda a: _sweeping(a) and a.sampling.max_new_tokens < 3,
     lambda a: f"--batch-sweep times --max-new-tokens - 1 decode steps per generation and needs at least 2; got "
               f"--max-new-tokens {a.sampling.max_new_tokens}"),
    (lambda a: a.model.dry_run and a.performance.repeat > 1, "--repeat times real runs; drop --dry-run"),
    (lambda a: a.parallel.tp > 1 and (a.performance.repeat > 1 or a.views.lens or a.views.attention
                                      or a.views.no_kv_cache or a.outputs.html is not None
                                      or a.input.batch is not None),
     "--tp runs one sequence's generation over its ranks; drop --batch, --repeat, --lens, --attention, --no-kv-cache "
     "and --html (they look at one device's model)"),
)


def at_least_one(option: str, value: int | None) -> None:
    if value is not None and value < 1:
        raise BadArgumentError(f"{option} must be at least 1, got {value}")


def parse_steps(text: str) -> tuple[int, ...]:
    """--attention-steps '0,3' -> (0, 3): step numbers, 0 = the prefill."""
    parts = [p.strip() for p in text.split(",") if p.strip()]
    if not all(p.isdigit() for p in parts):
        raise BadArgumentError(f"--attention-steps takes step numbers >= 0 separated by commas, e.g. 0,3; got {text!r}")
    return tuple(sorted({int(p) for p in parts}))


def parse_temperatures(text: str) -> tuple[float, ...]:
    """--temperatures '0.1,1,2' -> (0.1, 1.0, 2.0); '' -> () (no lesson); ranges checked by the engine's rule."""
    from llmtrace.tracer.run.sampling_params import check_temperatures

    parts = [p.strip() for p in text.split(",") if p.strip()]
    try:
        values = tuple(float(p) for p in parts)
    except ValueError:
        raise BadArgumentError(f"--temperatures takes numbers separated by commas, e.g. 0.1,1,2; got {text!r}") \
            from None
    return check_temperatures(values)


def available_cpus() -> int:
    """CPUs this process may run on (its affinity mask, as taskset or a container's cpuset sets it)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def missing_module(name: str) -> bool:
    """True when `name` cannot be imported (an optional extra not installed); finds it without importing it."""
    try:
        return importlib.util.find_spec(name) is None
    except (ImportError, ValueError):
        return True
