"""The trace file's stage records as a table (trace schema version 2): what a stage call did, each distinct once in
`stage_work`, and one short row per call in `stages`: `[work, step, layer, start_ns, duration_ns]`.

Why: a stage record is ~450 bytes of JSON, and most of it repeats. Every layer's `attention.wq` in every decode step
has the same shapes, dtype, FLOPs and bytes; only the step, the layer and the times differ (the attention stages'
KV bytes change with the position, so they get a new work entry per step, not per layer). Version 1 wrote each
record whole: 6.2 MB for a 32-token run of the 135M bundled model, ~100 MB for 256 tokens at 7B. The table keeps
every field of every record (reading gives back equal records) at ~35 bytes a call.

A work entry holds the record's fields but its row's four; its `stage` is the name within the layer
(`attention.wq`) when the row names a layer and the record's name is `layers.<layer>.<that>`, else the whole name
with `"whole_name": true`.
"""

from __future__ import annotations

from dataclasses import fields
from typing import Any, Callable, Iterable

from llmtrace.tracer.trace.records import StageRecord

ROW_FIELDS = ("step", "layer", "start_ns", "duration_ns")  # a row's own columns, after its work entry's index
WORK_FIELDS = tuple(f.name for f in fields(StageRecord) if f.name not in ROW_FIELDS)
_SHAPES = ("input_shapes", "output_shapes")


class StageTable:
    """Writes stage records as rows, collecting the distinct work entries they index (shared by the trace's own
    stages and every other rank's)."""

    def __init__(self) -> None:
        self.work: list[dict[str, Any]] = []
        self._index: dict[tuple[Any, ...], int] = {}

    def rows(self, stages: Iterable[StageRecord]) -> list[list[Any]]:
        return [[self._work_index(s), s.step, s.layer, s.start_ns, s.duration_ns] for s in stages]

    def _work_index(self, stage: StageRecord) -> int:
        prefix = f"layers.{stage.layer}."
        whole = stage.layer is None or not stage.stage.startswith(prefix)
        name = stage.stage if whole else stage.stage[len(prefix):]
        key = (name, whole, *(getattr(stage, f) for f in WORK_FIELDS if f != "stage"))
        index = self._index.get(key)
        if index is None:
            index = self._index[key] = len(self.work)
            self.work.append(_work_entry(stage, name, whole and stage.layer is not None))
        return index


def _work_entry(stage: StageRecord, name: str, whole_name: bool) -> dict[str, Any]:
    entry: dict[str, Any] = {f: getattr(stage, f) for f in WORK_FIELDS}
    entry["stage"] = name
    for f in _SHAPES:
        entry[f] = [list(shape) for shape in entry[f]]
    if entry["rank"] is None:  # one device: no rank, as the records read before --tp existed
        del entry["rank"]
    if whole_name:
        entry["whole_name"] = True
    return entry


def read_rows(rows: Any, work: list[dict[str, Any]], build: Callable[[dict[str, Any]], StageRecord]
              ) -> tuple[StageRecord, ...]:
    """The stage records of `rows` (a version-2 `stages` list), each built by `build` from its work entry and its
    row (build checks every field's type). A malformed row or index is a ValueError naming it."""
    if not isinstance(rows, list):
        raise TypeError(f"stages must be a list of rows, got {type(rows).__name__}")
    out = []
    for i, row in enumerate(rows):
        if not isinstance(row, list) or len(row) != 1 + len(ROW_FIELDS):
            raise ValueError(f"stage row {i} is not [work, step, layer, start_ns, duration_ns]")
        index, step, layer, start_ns, duration_ns = row
        if not isinstance(index, int) or isinstance(index, bool) or not 0 <= index < len(work):
            raise ValueError(f"stage row {i} names work entry {index!r}; stage_work holds {len(work)}")
        entry = dict(work[index])
        whole = entry.pop("whole_name", False)
        if whole is not True and whole is not False:
            raise ValueError(f"stage_work[{index}].whole_name must be true when present")
        name = entry.get("stage")
        if isinstance(name, str) and isinstance(layer, int) and not whole:
            entry["stage"] = f"layers.{layer}.{name}"
        out.append(build({**entry, "step": step, "layer": layer, "start_ns": start_ns, "duration_ns": duration_ns}))
    return tuple(out)
