"""A JSON Schema (draft 2020-12) written from a frozen record dataclass: what `asdict()` of it can hold, field by
field, each field's description taken from its trailing comment in the class body.

The schema files of the records that `--json` prints whole (roofline, diff, hardware, flops, kvmem, models) are
made by this and committed (tracer/core/json_schemas.py lists them); tests/test_json_schemas.py checks that each
file still equals what the records give, so a field added or retyped changes the file in the same commit.
Regenerate after an intended change and review the diff:

    LLMTRACE_UPDATE_SCHEMAS=1 .venv/bin/python -m pytest tests/test_json_schemas.py
"""

from __future__ import annotations

import dataclasses
import inspect
import re
import sys
import textwrap
import types
import typing
from typing import Any

_COMMENT = re.compile(r"^\s+(\w+)\s*:[^#]*#\s*(.+?)\s*$")
_SCALARS = {int: "integer", float: "number", str: "string", bool: "boolean", type(None): "null"}


def _hints(cls: type) -> dict[str, Any]:
    """The fields' types; names a module imports only for type checkers (`if TYPE_CHECKING:`) imported here."""
    try:
        return typing.get_type_hints(cls)
    except NameError:
        module = sys.modules[cls.__module__]
        namespace = dict(vars(module))
        source = inspect.getsource(module)
        block = re.search(r"^if TYPE_CHECKING:.*?\n((?:[ \t]+.*\n|\n)+)", source, re.M)
        if block:
            exec(textwrap.dedent(block.group(1)), namespace)  # noqa: S102 - the module's own import lines
        return typing.get_type_hints(cls, globalns=namespace)


def _comments(cls: type) -> dict[str, str]:
    """Each field's trailing comment in the class body ("" where it has none)."""
    try:
        source = inspect.getsource(cls)
    except (OSError, TypeError):
        return {}
    out = {}
    for line in source.splitlines():
        match = _COMMENT.match(line)
        if match:
            out.setdefault(match.group(1), match.group(2))
    return out


class _Writer:
    def __init__(self) -> None:
        self.defs: dict[str, Any] = {}

    def of(self, hint: Any) -> dict[str, Any]:
        if hint in _SCALARS:
            # an integer-valued figure may be written as an int; a float field holds any number
            return {"type": _SCALARS[hint]}
        if hint is Any:
            return {}
        origin = typing.get_origin(hint)
        args = typing.get_args(hint)
        if origin in (typing.Union, types.UnionType):
            members = [self.of(a) for a in args]
            plain = [m["type"] for m in members if set(m) == {"type"} and isinstance(m["type"], str)]
            if len(plain) == len(members):
                return {"type": plain}
            return {"anyOf": members}
        if origin is tuple:
            if len(args) == 2 and args[1] is Ellipsis:
                return {"type": "array", "items": self.of(args[0])}
            return {"type": "array", "prefixItems": [self.of(a) for a in args], "minItems": len(args),
                    "maxItems": len(args)}
        if origin in (list, typing.Sequence):
            return {"type": "array", "items": self.of(args[0]) if args else {}}
        if origin is dict:
            return {"type": "object", "additionalProperties": self.of(args[1]) if args else {}}
        if dataclasses.is_dataclass(hint):
            self.record(hint)
            return {"$ref": f"#/$defs/{hint.__name__}"}
        raise TypeError(f"no JSON Schema for {hint!r}")

    def record(self, cls: type) -> dict[str, Any]:
        if cls.__name__ in self.defs:
            return self.defs[cls.__name__]
        self.defs[cls.__name__] = {}  # a placeholder: a record may hold itself (not today)
        hints = _hints(cls)
        notes = _comments(cls)
        properties = {}
        for f in dataclasses.fields(cls):
            prop = self.of(hints[f.name])
            if notes.get(f.name):
                prop = {**prop, "description": notes[f.name]} if "$ref" not in prop else {
                    "allOf": [prop], "description": notes[f.name]}
            properties[f.name] = prop
        doc = (cls.__doc__ or "").strip()
        body: dict[str, Any] = {"type": "object"}
        if doc and not doc.startswith(f"{cls.__name__}("):  # not the dataclass's generated signature
            body["description"] = " ".join(doc.split())
        body.update({"additionalProperties": False, "required": [f.name for f in dataclasses.fields(cls)],
                     "properties": properties})
        self.defs[cls.__name__] = body
        return body


def record_schema(cls: type, schema: str, title: str, description: str, const_schema: bool = True) -> dict[str, Any]:
    """The schema of `asdict()` of `cls`, whose "schema" field is the constant `schema` (also the file's $id)."""
    writer = _Writer()
    top = dict(writer.record(cls))
    writer.defs.pop(cls.__name__)
    if const_schema and "schema" in top["properties"]:
        top["properties"] = {**top["properties"], "schema": {"const": schema, "description": "the schema's id"}}
    return {"$schema": "https://json-schema.org/draft/2020-12/schema", "$id": schema, "title": title,
            "description": description, **{k: v for k, v in top.items() if k != "description"},
            **({"$defs": dict(sorted(writer.defs.items()))} if writer.defs else {})}
