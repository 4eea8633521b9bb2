"""A traced run as one value: its records, settings, model config, environment and generated text.

`Trace.to_json()` writes the schema in tracer/trace/trace_schema.json (every record is `asdict()` of a frozen
dataclass, tuples as lists, but the stage records: a table, tracer/trace/stage_table.py, one line a row);
`Trace.from_json()` reads it back into equal records, and reads version 1's whole stage records too.
The Chrome / Perfetto view of a Trace is tracer/trace/chrome.py's `chrome_trace(trace)`, which reads a Trace
(never the other way round: a Trace knows nothing of its views).
"""

from __future__ import annotations

import json
import uuid
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any, Callable, TypeVar

from llmtrace.tracer.core.config import ModelConfig, MoeSpec, RopeScaling
from llmtrace.tracer.core.errors import FileFormatError, short_repr
from llmtrace.tracer.core.json_input import is_int, parse_json
from llmtrace.tracer.hardware.kernel_choice import CandidateTiming, KernelChoice, TypeKernel
from llmtrace.tracer.trace.batch_records import BatchRun, SequenceRecord
from llmtrace.tracer.trace.journey_records import (
    AttentionStep,
    HeadFocus,
    LensLayer,
    LensStep,
    LensToken,
    LessonColumn,
    LessonToken,
    NoCacheRun,
    NoCacheStep,
    SamplingLesson,
)
from llmtrace.tracer.trace.records import (
    DECODE,
    PREFILL,
    CandidateRecord,
    EnvironmentInfo,
    ModelInfo,
    RopeRecord,
    RowToken,
    RunSettings,
    SamplingRecord,
    Route,
    RouteNotTaken,
    RunAhead,
    StagedDecode,
    StageRecord,
    StepRecord,
    StepTotals,
    TokenizationRecord,
)
from llmtrace.tracer.trace.routing import LayerRouting, RoutingStep
from llmtrace.tracer.trace.stage_table import StageTable, read_rows
from llmtrace.tracer.trace.tp_records import (
    CollectiveRecord,
    LinkMeasurement,
    RankStages,
    RankStep,
    TensorParallelRun,
)

SCHEMA_NAME = "llmtrace.trace"
SCHEMA_VERSION = 2
# 1: each stage record written whole (before the stage table of tracer/trace/stage_table.py); still read
READABLE_VERSIONS = (1, 2)
SCHEMA_PATH = Path(__file__).with_name("trace_schema.json")

# Why the generation stopped.
STOP_EOS = "eos"
STOP_MAX_NEW_TOKENS = "max_new_tokens"
STOP_CONTEXT_FULL = "context_full"
STOP_INTERRUPTED = "interrupted"
STOP_DRY_RUN = "dry_run"
STOP_RANK_FAILED = "rank_failed"  # a tensor-parallel rank died or hung: the steps every rank completed are kept


def new_token_limit(max_new_tokens: int, max_seq_len: int, prompt_tokens: int) -> int:
    """--max-new-tokens, or fewer when the model's context fills up first."""
    return min(max_new_tokens, max_seq_len - prompt_tokens)


@dataclass(frozen=True, slots=True)
class Trace:
    settings: RunSettings
    config: ModelConfig
    environment: EnvironmentInfo
    model: ModelInfo
    tokenization: TokenizationRecord | None
    rope: RopeRecord | None
    stages: tuple[StageRecord, ...]
    steps: tuple[StepRecord, ...]
    generated_ids: tuple[int, ...]
    generated_text: str
    stop_reason: str
    wall_ns: int  # from the origin to the end of the last step
    peak_rss_bytes: int
    peak_device_bytes: int | None  # cuda only
    # Steps whose stage records --trace-steps left out, each as its sums (prefill first, then by step).
    pruned_steps: tuple[StepTotals, ...] = ()
    # Instrumentation, recorded apart from the stages (tracer/trace/journey_records.py); absent in older traces.
    sampling_lesson: SamplingLesson | None = None
    no_kv_cache: NoCacheRun | None = None  # --no-kv-cache: the run again without a cache, step by step
    lens: tuple[LensStep, ...] = ()  # --lens: per step, what each layer would predict
    attention: tuple[AttentionStep, ...] = ()  # --attention: per step, where each head looks
    # A mixture of experts: per step, every layer's experts for each token row and their router weights
    # (tracer/trace/routing.py); empty for a dense model, absent from its JSON.
    routing: tuple[RoutingStep, ...] = ()
    # --batch N: every sequence's prompt, tokens and end (tracer/trace/batch_records.py). The top-level tokenization
    # and generated_ids/generated_text are then the first sequence's, so a reader that knows no batch still reads a run.
    batch: BatchRun | None = None
    # The kernels that ran, where they came from (the default table, tune's pick, options) and their numerics
    # (tracer/hardware/kernel_choice.py); None in an older trace.
    kernels: KernelChoice | None = None
    # --tp N (tracer/trace/tp_records.py): the set-up, every collective of every rank, the other ranks' records.
    tensor_parallel: TensorParallelRun | None = None
    collectives: tuple[CollectiveRecord, ...] = ()
    rank_stages: tuple[RankStages, ...] = ()
    # --staged: whether its one-token steps ran as the native step's stages apart (timed in C) or through the stage
    # modules, and why; None without --staged (and in traces written before it existed).
    staged_decode: StagedDecode | None = None
    # A greedy run whose decode steps ran several to a C call: how many calls and steps; None when every decode step
    # was its own call (and in traces written before it existed).
    run_ahead: RunAhead | None = None
    # The backend of the decode steps and the prefill, and why each other one did not run them (tracer/run/select.py);
    # None in a --tp run (its ranks step the stage modules) and in traces written before it existed.
    route: Route | None = None

    # ---- views ----------------------------------------------------------------------------------------

    def stages_of(self, phase: str) -> tuple[StageRecord, ...]:
        return tuple(s for s in self.stages if s.phase == phase)

    @property
    def prefill_step(self) -> StepRecord | None:
        return next((s for s in self.steps if s.phase == PREFILL), None)

    @property
    def decode_steps(self) -> tuple[StepRecord, ...]:
        return tuple(s for s in self.steps if s.phase == DECODE)

    @property
    def new_token_limit(self) -> int:
        """The most tokens this run could generate (new_token_limit of its settings, model and prompt)."""
        prefill = self.prefill_step
        prompt = prefill.input_tokens if prefill is not None else 0
        return new_token_limit(self.settings.max_new_tokens, self.config.max_seq_len, prompt)

    def traced_steps(self, phase: str) -> tuple[StepRecord, ...]:
        """The steps of `phase` whose stage records the trace holds (all of them unless --trace-steps pruned some)."""
        pruned = {t.step for t in self.pruned_steps if t.phase == phase}
        return tuple(s for s in self.steps if s.phase == phase and s.step not in pruned)

    # ---- JSON -----------------------------------------------------------------------------------------

    def to_dict(self, summary: Any = None, repeat: Any = None) -> dict[str, Any]:
        """`summary`: the run's SummaryBlock (tracer/trace/summary_block.py), written as the optional "summary"
        block; from_dict skips it (every figure in it follows from the records and the roofline comparison).
        `repeat`: `run --repeat K`'s RepeatSummary over this run and the K - 1 after it (tracer/trace/
        repeat_summary.py), the optional "repeat" block; from_dict skips it too (the other runs are not kept)."""
        out: dict[str, Any] = {"schema": SCHEMA_NAME, "schema_version": SCHEMA_VERSION}
        if summary is not None:
            out["summary"] = _plain(summary)  # first: the headline, before the records it sums
        if repeat is not None:
            out["repeat"] = _plain(repeat)
        table = StageTable()
        for f in fields(self):
            value = getattr(self, f.name)
            if (f.name in _OMITTED_WHEN_EMPTY and not value) or (f.name in _OMITTED_WHEN_NONE and value is None):
                continue  # optional (schema): absent reads as before
            if f.name == "stages":
                out["stage_work"] = table.work  # filled by these rows and the other ranks' below
                out["stages"] = table.rows(value)
            elif f.name == "rank_stages":
                out[f.name] = [{"rank": r.rank, "steps": _plain(r.steps), "stages": table.rows(r.stages),
                                "peak_rss_bytes": r.peak_rss_bytes} for r in value]
            else:
                out[f.name] = _plain(value)
        if self.batch is None:  # a one-sequence run's steps and settings read exactly as before --batch existed
            for step in out["steps"]:
                for name in _BATCH_STEP_FIELDS:
                    step.pop(name, None)
            for name in _BATCH_SETTINGS:
                out["settings"].pop(name, None)
        return out

    def to_json(self, indent: int | None = None, summary: Any = None, repeat: Any = None) -> str:
        """The trace as JSON. With `indent`, the stage rows and work entries (423 rows per step on the default
        model: hundreds of thousands in a long run) are written one compact line each, through json's C encoder,
        which indented output cannot use; everything else is indented."""
        data = self.to_dict(summary, repeat)
        if indent is None:
            return json.dumps(data, ensure_ascii=False)
        lists: dict[str, tuple[list[Any], int]] = {}  # placeholder: (items, depth), written one line an item

        def one_line_each(holder: dict[str, Any], key: str, depth: int) -> None:
            placeholder = f"list-{uuid.uuid4().hex}"  # unique: no prompt or text can hold it
            lists[placeholder] = (holder[key], depth)
            holder[key] = placeholder

        one_line_each(data, "stage_work", 1)
        one_line_each(data, "stages", 1)
        for rank in data.get("rank_stages", ()):
            one_line_each(rank, "stages", 3)
        text = json.dumps(data, ensure_ascii=False, indent=indent)
        for placeholder, (items, depth) in lists.items():
            pad = " " * indent * depth
            lines = ",\n".join(f"{pad}{' ' * indent}{json.dumps(i, ensure_ascii=False)}" for i in items)
            text = text.replace(f'"{placeholder}"', f"[\n{lines}\n{pad}]" if items else "[]", 1)
        return text

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Trace":
        if not isinstance(data, dict) or data.get("schema") != SCHEMA_NAME:
            raise FileFormatError(f"not an llmtrace trace (missing \"schema\": \"{SCHEMA_NAME}\")")
        version = data.get("schema_version")
        if version not in READABLE_VERSIONS or isinstance(version, bool):
            raise FileFormatError(
                f"trace schema version {version!r} is not one this llmtrace reads "
                f"({', '.join(map(str, READABLE_VERSIONS))}); re-record it with this llmtrace"
            )
        try:
            stages = _stage_reader(data, version)
            return _check_rows(cls(
                settings=_settings(data["settings"]),
                config=_config(data["config"]),
                environment=_build(EnvironmentInfo, data["environment"]),
                model=_build(ModelInfo, data["model"]),
                tokenization=_optional(_tokenization, data["tokenization"]),
                rope=_optional(_rope, data["rope"]),
                stages=stages(data["stages"]),
                steps=tuple(_step(s) for s in _list(data["steps"])),
                generated_ids=_typed(tuple, data["generated_ids"], "generated_ids", _TUPLES["tuple[int, ...]"]),
                generated_text=_typed(str, data["generated_text"], "generated_text", _SCALARS["str"]),
                stop_reason=_typed(str, data["stop_reason"], "stop_reason", _SCALARS["str"]),
                wall_ns=_typed(int, data["wall_ns"], "wall_ns", is_int),
                peak_rss_bytes=_typed(int, data["peak_rss_bytes"], "peak_rss_bytes", is_int),
                peak_device_bytes=None if data["peak_device_bytes"] is None else _typed(
                    int, data["peak_device_bytes"], "peak_device_bytes", is_int),
                pruned_steps=tuple(_build(StepTotals, t) for t in data.get("pruned_steps", ())),
                sampling_lesson=_optional(_sampling_lesson, data.get("sampling_lesson")),
                no_kv_cache=_optional(_no_cache, data.get("no_kv_cache")),
                lens=tuple(_lens_step(s) for s in data.get("lens", ())),
                attention=tuple(_attention_step(a) for a in data.get("attention", ())),
                routing=tuple(_routing_step(r) for r in _list(data.get("routing", []))),
                batch=_optional(_batch, data.get("batch")),
                kernels=_optional(_kernels, data.get("kernels")),
                tensor_parallel=_optional(_tensor_parallel, data.get("tensor_parallel")),
                collectives=tuple(read_collective(c) for c in _list(data.get("collectives", []))),
                rank_stages=tuple(_rank_stages(r, stages) for r in _list(data.get("rank_stages", []))),
                staged_decode=_optional(lambda d: _build(StagedDecode, d), data.get("staged_decode")),
                run_ahead=_optional(lambda d: _build(RunAhead, d), data.get("run_ahead")),
                route=_optional(_route, data.get("route")),
            ))
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise FileFormatError(f"trace JSON does not match the schema ({type(exc).__name__}: {exc})") from exc

    @classmethod
    def from_json(cls, text: str) -> "Trace":
        return cls.from_dict(parse_json(text, "trace", FileFormatError, "re-record it with `llmtrace run --json`"))



def _typed(kind: Callable[[Any], R], value: Any, name: str, check: Callable[[Any], bool]) -> R:
    if not check(value):
        raise TypeError(f"{name} has the wrong type or value ({short_repr(value)})")
    return kind(value)


def load_schema() -> dict[str, Any]:
    return json.loads(SCHEMA_PATH.read_text(encoding="utf-8"))


# ---- helpers ------------------------------------------------------------------------------------------

R = TypeVar("R")


_BATCH_STEP_FIELDS = ("batch", "rows", "compact_ns")  # StepRecord's fields of a batched run (optional in the schema)
_BATCH_SETTINGS = ("batch", "batch_prompts")
_OMITTED_WHEN_NONE = frozenset({"kernels", "staged_decode", "run_ahead", "route"})
_OMITTED_WHEN_EMPTY = frozenset({"pruned_steps", "batch", "tensor_parallel", "collectives", "rank_stages",
                                 "routing"})


def _plain(value: Any) -> Any:
    """asdict() for dataclasses, lists for tuples, recursively."""
    if hasattr(value, "__dataclass_fields__"):
        value = asdict(value)
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


# The field names of every record class a trace holds (a constant: read back once per stage record).
_FIELD_NAMES: dict[type, frozenset[str]] = {
    cls: frozenset(f.name for f in fields(cls))
    for cls in (RunSettings, ModelConfig, RopeScaling, MoeSpec, EnvironmentInfo, ModelInfo, TokenizationRecord,
                RopeRecord, StageRecord, StepRecord, StepTotals, CandidateRecord, SamplingRecord, SamplingLesson,
                LessonToken, LessonColumn, NoCacheRun, NoCacheStep, LensStep, LensLayer, LensToken, AttentionStep, HeadFocus,
                RowToken, SequenceRecord, BatchRun, KernelChoice, CandidateTiming, TypeKernel, StagedDecode, RunAhead,
                Route, RouteNotTaken, RoutingStep, LayerRouting,
                CollectiveRecord, RankStep, RankStages, LinkMeasurement, TensorParallelRun)
}


# The fields a record makes from its others (init=False: StagedDecode.native): written, and on reading checked
# against what the others make, never passed in.
_DERIVED: dict[type, frozenset[str]] = {
    cls: frozenset(f.name for f in fields(cls) if not f.init) for cls in _FIELD_NAMES
}


def _build(cls: Callable[..., R], data: dict[str, Any]) -> R:
    if not isinstance(data, dict):
        raise TypeError(f"{cls.__name__} must be a JSON object, got {type(data).__name__}")
    unknown = data.keys() - _FIELD_NAMES[cls]  # type: ignore[index]
    if unknown:
        raise ValueError(f"{cls.__name__} has no field(s) {sorted(unknown)}")
    checks = _FIELD_CHECKS[cls]  # type: ignore[index]
    for name, value in data.items():
        check = checks.get(name)
        if check is not None and not check(value):
            raise TypeError(f"{cls.__name__}.{name} has the wrong type or value ({short_repr(value)})")
    derived = _DERIVED[cls]  # type: ignore[index]
    if not derived:
        return cls(**data)
    record = cls(**{name: value for name, value in data.items() if name not in derived})
    for name in derived & data.keys():
        if data[name] != getattr(record, name):
            raise ValueError(f"{cls.__name__}.{name} is {short_repr(data[name])}, but the other fields make it "
                             f"{short_repr(getattr(record, name))}")
    return record


# ---- field types, checked on reading: a trace is outside data (hand edits, other tools), and a wrong type would
# otherwise crash a renderer halfway through `show`. Built once from the records' annotations.

def _is_float(v: Any) -> bool:
    return isinstance(v, float) or is_int(v)


_SCALARS: dict[str, Callable[[Any], bool]] = {
    "int": is_int, "float": _is_float, "str": lambda v: isinstance(v, str), "bool": lambda v: isinstance(v, bool),
}
_TUPLES: dict[str, Callable[[Any], bool]] = {
    "tuple[int, ...]": lambda v: isinstance(v, (list, tuple)) and all(is_int(x) for x in v),
    "tuple[str, ...]": lambda v: isinstance(v, (list, tuple)) and all(isinstance(x, str) for x in v),
    "tuple[tuple[int, ...], ...]": lambda v: isinstance(v, (list, tuple)) and all(
        isinstance(x, (list, tuple)) and all(is_int(d) for d in x) for x in v),
}


def _check_for(annotation: str) -> Callable[[Any], bool] | None:
    """A predicate for a field annotated `annotation` (as a string: the records use postponed annotations), or
    None for a record-typed field, which its own builder checks."""
    optional = annotation.endswith(" | None")
    base = annotation.removesuffix(" | None")
    check = _SCALARS.get(base) or _TUPLES.get(base)
    if check is None:
        return None
    return (lambda v: v is None or check(v)) if optional else check


_FIELD_CHECKS: dict[type, dict[str, Callable[[Any], bool]]] = {
    cls: {f.name: c for f in fields(cls) if (c := _check_for(str(f.type))) is not None} for cls in _FIELD_NAMES
}


def _optional(builder: Callable[[dict[str, Any]], R], data: dict[str, Any] | None) -> R | None:
    return None if data is None else builder(data)


def _floats(raw: Any, name: str) -> tuple[float, ...]:
    """A JSON array of numbers as a tuple of floats; any other element is a TypeError naming the field."""
    return tuple(_typed(float, value, name, _is_float) for value in _list(raw))


def _list(raw: Any) -> tuple[Any, ...]:
    """A JSON array as a tuple; anything else (a string would iterate into characters) is a TypeError."""
    if not isinstance(raw, list):
        raise TypeError(f"expected a JSON array, got {short_repr(raw)}")
    return tuple(raw)


def _shapes(raw: Any) -> tuple[tuple[int, ...], ...]:
    shapes = tuple(_list(shape) for shape in _list(raw))
    if not shapes:  # every stage takes and gives a tensor; the renderers read the first shape
        raise ValueError("a stage must list at least one shape")
    return shapes


def _stage(d: dict[str, Any]) -> StageRecord:
    return _build(StageRecord, {**d, "input_shapes": _shapes(d["input_shapes"]),
                                "output_shapes": _shapes(d["output_shapes"])})


def _step(d: dict[str, Any]) -> StepRecord:
    return _build(StepRecord, {**d, "filters": _list(d["filters"]),
                               "candidates": tuple(_build(CandidateRecord, c) for c in _list(d["candidates"])),
                               "sampling": _optional(lambda s: _build(SamplingRecord, s), d["sampling"]),
                               "rows": tuple(_build(RowToken, r) for r in _list(d.get("rows", [])))})


def _batch(d: dict[str, Any]) -> BatchRun:
    sequences = tuple(_build(SequenceRecord, {**q, "tokenization": _tokenization(q["tokenization"]),
                                              "generated_ids": _list(q["generated_ids"])})
                      for q in _list(d["sequences"]))
    if not sequences or any(not s.tokenization.ids for s in sequences):
        raise ValueError("a batch needs at least one sequence, each with its prompt's ids")
    return _build(BatchRun, {**d, "sequences": sequences})


def _check_rows(trace: "Trace") -> "Trace":
    """Every row of a batched step names one of the trace's sequences (the renderers index them by it)."""
    count = len(trace.batch.sequences) if trace.batch is not None else 0
    for step in trace.steps:
        for row in step.rows:
            if not 0 <= row.sequence < count:
                raise ValueError(f"step {step.step} has a row of sequence {row.sequence}, the trace has {count}")
    return trace


def _tokenization(d: dict[str, Any]) -> TokenizationRecord:
    return _build(TokenizationRecord, {**d, "pieces": _list(d["pieces"]), "ids": _list(d["ids"])})


def _rope(d: dict[str, Any]) -> RopeRecord:
    return _build(RopeRecord, {**d, "positions": _list(d["positions"])})


def _settings(d: dict[str, Any]) -> RunSettings:
    if "temperatures" in d:
        d = {**d, "temperatures": tuple(float(t) for t in d["temperatures"])}
    if "attention_steps" in d:
        d = {**d, "attention_steps": tuple(int(s) for s in d["attention_steps"])}
    if "batch_prompts" in d:
        d = {**d, "batch_prompts": _list(d["batch_prompts"])}
    return _build(RunSettings, d)


def _sampling_lesson(d: dict[str, Any]) -> SamplingLesson:
    columns = tuple(_build(LessonColumn, {**c, "probabilities": _floats(c["probabilities"], "probabilities"),
                                          "final_probabilities": _floats(c["final_probabilities"],
                                                                         "final_probabilities")})
                    for c in d["columns"])
    tokens = tuple(_build(LessonToken, t) for t in d["tokens"])
    for column in columns:  # one probability per lesson token: the panel reads them by the tokens' rows
        if len(column.probabilities) != len(tokens) or len(column.final_probabilities) != len(tokens):
            raise ValueError(f"sampling_lesson column T={column.temperature} has {len(column.probabilities)} "
                             f"probabilities for {len(tokens)} tokens")
    return _build(SamplingLesson, {**d, "tokens": tokens, "columns": columns})


def _no_cache(d: dict[str, Any]) -> NoCacheRun:
    return _build(NoCacheRun, {**d, "steps": tuple(_build(NoCacheStep, s) for s in d["steps"])})


def _lens_step(d: dict[str, Any]) -> LensStep:
    layers = tuple(_build(LensLayer, {**layer, "top": tuple(_build(LensToken, t) for t in layer["top"])})
                   for layer in d["layers"])
    return _build(LensStep, {**d, "layers": layers})


def _routing_step(d: dict[str, Any]) -> RoutingStep:
    layers = []
    for layer in _list(d["layers"]):
        experts = tuple(tuple(_typed(int, e, "experts", is_int) for e in _list(row)) for row in _list(layer["experts"]))
        weights = tuple(_floats(row, "weights") for row in _list(layer["weights"]))
        if [len(row) for row in experts] != [len(row) for row in weights]:
            raise ValueError("a layer's routing holds as many weights as experts for each token row")
        layers.append(_build(LayerRouting, {**layer, "experts": experts, "weights": weights}))
    return _build(RoutingStep, {**d, "layers": tuple(layers)})


def _attention_step(d: dict[str, Any]) -> AttentionStep:
    heads = tuple(_build(HeadFocus, {**h, "top_positions": tuple(h["top_positions"]),
                                     "top_weights": tuple(h["top_weights"])}) for h in d["heads"])
    full = d["weights"]
    return _build(AttentionStep, {
        **d, "pieces": tuple(d["pieces"]), "heads": heads,
        "mean_weights": tuple(tuple(row) for row in d["mean_weights"]),
        "weights": None if full is None else tuple(tuple(tuple(row) for row in layer) for layer in full),
    })


def _kernels(d: dict[str, Any]) -> KernelChoice:
    """The run's kernels. An older trace's measured choice (no `source`) reads as what ran, source "measured"."""
    if isinstance(d, dict) and "source" not in d and "from_store" in d:
        ran = d.get("ran") if d.get("overridden_by") else d.get("picked")
        ran = ran if isinstance(ran, str) and ran else str(d.get("picked", ""))
        return KernelChoice(picked=ran, dtype=str(d.get("dtype", "")), weights=str(d.get("weights", "")),
                            decode_kernel=ran if d.get("weights") == "stored" else str(d.get("decode_kernel", "")),
                            source="measured", rule=str(d.get("rule", "")), numerics="")
    return _build(KernelChoice, {**d, "candidates": tuple(_build(CandidateTiming, c) for c in _list(d["candidates"])),
                                 "by_type": tuple(_build(TypeKernel, t) for t in _list(d.get("by_type", [])))})


def _route(d: dict[str, Any]) -> Route:
    return _build(Route, {**d, "not_taken": tuple(_build(RouteNotTaken, r) for r in _list(d["not_taken"]))})


def read_collective(d: dict[str, Any]) -> CollectiveRecord:
    """A CollectiveRecord from its JSON object, checked as every record of a trace is."""
    return _build(CollectiveRecord, {**d, "ranks": _list(d["ranks"])})


def read_link(d: dict[str, Any]) -> LinkMeasurement:
    return _build(LinkMeasurement, d)


def _tensor_parallel(d: dict[str, Any]) -> TensorParallelRun:
    link = d.get("link")
    return _build(TensorParallelRun, {**d, "exit_codes": _list(d["exit_codes"]),
                                      "link": None if link is None else read_link(link)})


def _stage_reader(data: dict[str, Any], version: int) -> Callable[[Any], tuple[StageRecord, ...]]:
    """How this version's `stages` lists read: whole records (1) or rows of the stage table (2)."""
    if version == 1:
        return lambda raw: tuple(_stage(s) for s in _list(raw))
    work = data["stage_work"]
    if not isinstance(work, list):
        raise TypeError(f"stage_work must be a list, got {type(work).__name__}")
    return lambda raw: read_rows(raw, work, _stage)


def _rank_stages(d: dict[str, Any], stages: Callable[[Any], tuple[StageRecord, ...]]) -> RankStages:
    if not isinstance(d, dict):
        raise TypeError(f"RankStages must be a JSON object, got {type(d).__name__}")
    return _build(RankStages, {**d, "steps": tuple(_build(RankStep, s) for s in _list(d["steps"])),
                               "stages": stages(d["stages"])})


def _rope_scaling(d: dict[str, Any]) -> RopeScaling:
    """LongRoPE's and rope_freqs' factors as tuples of floats (a list would leave the frozen config unequal to the run's and
    unhashable). Traces written before the low and high frequency factors were llama3's alone hold 1.0 and 4.0 for
    the other kinds, which never read them: read back as the config a run makes now, without them."""
    factors = {key: _floats(d[key], key) for key in ("short_factor", "long_factor", "freq_factors") if key in d}
    if d.get("kind", "llama3") != "llama3":
        factors.update(low_freq_factor=None, high_freq_factor=None)
    return _build(RopeScaling, {**d, **factors})


def _config(d: dict[str, Any]) -> ModelConfig:
    scaling, moe = d.get("rope_scaling"), d.get("moe")
    extra = {"full_layers": tuple(_list(d["full_layers"]))} if "full_layers" in d else {}
    return _build(ModelConfig, {**d, "rope_scaling": None if scaling is None else _rope_scaling(scaling),
                                "moe": None if moe is None else _build(MoeSpec, moe), **extra})
