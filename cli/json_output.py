"""--json output: a record's `asdict()`, on stdout alone, its "schema" field first (tracer/core/json_schemas.py)."""

from __future__ import annotations

import json
import sys
from dataclasses import asdict
from typing import Any, Callable


def json_document(record: Any) -> dict[str, Any]:
    """`asdict(record)` (or a dict as it is) with its "schema" field moved first, where a reader looks."""
    data = asdict(record) if not isinstance(record, dict) else record
    if "schema" in data:
        data = {"schema": data["schema"], **{k: v for k, v in data.items() if k != "schema"}}
    return data


def json_text(record: Any, indent: int | None = 2) -> str:
    return json.dumps(json_document(record), indent=indent, ensure_ascii=False)


def print_json(record: Any) -> None:
    sys.stdout.write(json_text(record) + "\n")


def print_record(record: Any, json_out: bool, render: Callable[..., None], *args: Any) -> None:
    """A command's record: its JSON on stdout with --json, else `render(console, record, *args)` on the terminal."""
    if json_out:
        print_json(record)
        return
    from llmtrace.cli.console import stdout_console

    render(stdout_console(), record, *args)
