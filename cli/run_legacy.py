"""`run --json PATH`, the old spelling of `run --json-file PATH`, still read.

`--json` was a path option of `run` alone; every other command's `--json` is a flag that prints to stdout, and now
`run`'s is too. A script's `--json trace.json` must not become "trace the prompt 'trace.json'", so a value that can
only be the old path is read as one: `--json=PATH`, `--json -` (stdout, as `--json` now), or `--json X` where X
ends in .json or .gz (a prompt is text, these are file names). Anything else after `--json` is the prompt or
another option, as after any flag.
"""

from __future__ import annotations

from typing import Sequence

STDOUT = "-"
PATH_ENDINGS = (".json", ".gz")


def legacy_json_path(args: Sequence[str]) -> list[str]:
    """`args` with the old `--json PATH` spellings rewritten (up to `--`)."""
    out: list[str] = []
    i = 0
    while i < len(args):
        arg = args[i]
        if arg == "--":
            return [*out, *args[i:]]
        if arg.startswith("--json="):
            path = arg.removeprefix("--json=")
            out += ["--json"] if path == STDOUT else ["--json-file", path]
        elif arg == "--json" and i + 1 < len(args) and _is_old_path(args[i + 1]):
            path = args[i + 1]
            out += ["--json"] if path == STDOUT else ["--json-file", path]
            i += 1
        else:
            out.append(arg)
        i += 1
    return out


def _is_old_path(value: str) -> bool:
    return value == STDOUT or value.lower().endswith(PATH_ENDINGS)
