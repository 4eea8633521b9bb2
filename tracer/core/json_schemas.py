"""Every `--json` output's schema: the stable id its "schema" field names, and the JSON Schema file (draft 2020-12)
shipped with the package that describes it. Pure Python.

An id is `llmtrace.<output>/<version>`; within a version fields are only ever added (README, "`--json` schemas").
The trace names its schema as `"schema": "llmtrace.trace", "schema_version": N` (tracer/trace/run_trace.py: its
reader refuses another version), so its id here is the name alone. `run --summary-json`'s schema refers to the
trace schema's SummaryBlock (a `$ref` by the trace schema's `$id`): load both into one registry to resolve it
(`registry()`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

TRACER = Path(__file__).resolve().parents[1]  # llmtrace/tracer: the files below are relative to it

# id -> file (relative to llmtrace/tracer), in the order README lists them.
SCHEMA_FILES: dict[str, str] = {
    "llmtrace.flops/2": "analytic/flops_schema.json",
    "llmtrace.kvmem/1": "analytic/kvmem_schema.json",
    "llmtrace.models/1": "analytic/models_schema.json",
    "llmtrace.roofline/1": "roofline/roofline_schema.json",
    "llmtrace.hardware/1": "hardware/hardware_schema.json",
    "llmtrace.hardware-measure/1": "hardware/hardware_measure_schema.json",
    "llmtrace.trace": "trace/trace_schema.json",
    "llmtrace.run-summary/1": "trace/summary_schema.json",
    "llmtrace.diff/1": "trace/diff_schema.json",
    "llmtrace.batch-sweep/1": "run/batch_sweep_schema.json",
}


def schema_path(schema: str) -> Path:
    """The shipped file of schema id `schema`; KeyError for an id that has none."""
    return TRACER / SCHEMA_FILES[schema]


def load_schema(schema: str) -> dict[str, Any]:
    with open(schema_path(schema), encoding="utf-8") as fh:
        return json.load(fh)


def registry() -> Any:
    """A `referencing.Registry` of every shipped schema by its `$id` (jsonschema's resolver of `$ref`s across files;
    `referencing` comes with jsonschema, a test extra: only tests and consumers call this)."""
    from referencing import Registry, Resource

    return Registry().with_resources(
        (document["$id"], Resource.from_contents(document))
        for document in (load_schema(schema) for schema in SCHEMA_FILES))
