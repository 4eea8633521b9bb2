"""Parse JSON that comes from outside (config.json, safetensors headers, traces, hardware.json) into one-line errors.

json.loads raises RecursionError, not JSONDecodeError, on deeply nested input (`[[[[...` a few thousand deep),
which would escape every reader's `except JSONDecodeError`. Every reader of outside JSON calls `parse_json`, so
malformed, non-UTF-8 and too-deeply-nested text all end in the caller's typed error naming the file.
"""

from __future__ import annotations

import json
from numbers import Integral
from typing import Any

from llmtrace.tracer.core.errors import LlmtraceError


def is_int(value: object) -> bool:
    """A whole number as a reader of outside values takes one: an int (numpy's integers too: they register as
    numbers.Integral), not a bool."""
    return isinstance(value, Integral) and not isinstance(value, bool)


def parse_json(text: str | bytes, source: str, error: type[LlmtraceError], fix: str) -> Any:
    """`json.loads(text)`; any failure is `error("{source}: not valid JSON (why); {fix}")` ("; {fix}" left out when
    `fix` is empty: the caller says what happens next)."""
    try:
        if isinstance(text, bytes):
            text = text.decode("utf-8")
        return json.loads(text)
    except UnicodeDecodeError as exc:
        why = f"not UTF-8 at byte {exc.start}"
    except json.JSONDecodeError as exc:
        why = str(exc)
    except RecursionError:
        why = "nested too deeply"
    raise error(f"{source}: not valid JSON ({why})" + (f"; {fix}" if fix else ""))
