"""README.md's example outputs, re-generated from the commands themselves, so that they cannot go stale.

Each example in README.md is a marker line followed by a fenced block:

    <!-- example: llmtrace kvmem --model llama-7b --seq 4096 -->
    ```text
    ...the command's output...
    ```

`--write` runs every marked command (in-process, at EXAMPLE_COLUMNS columns, with a config folder that holds no
saved measurement of this machine) and replaces its block; `--check` (tests/test_readme_examples.py
runs it) fails on any block that differs from what the command prints now. Only commands whose output is the same
on every machine and every run are examples here: analytical ones, dry runs, and `show` of the trace committed in
tests/data/ (a real run of the bundled model, rendered from its saved records).

    .venv/bin/python -m benchmarks.readme_examples --write      # `make examples`
    .venv/bin/python -m benchmarks.readme_examples --check

The committed trace was recorded with (then `make examples`):

    .venv/bin/llmtrace run 今天天气真 --max-new-tokens 32 --trace-steps first,last --no-roofline \
        --json tests/data/readme_run.trace.json.gz
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
README = REPO / "README.md"
EXAMPLE_COLUMNS = 100
# A config folder that holds no measured profile (the examples never write one); its path shows in `hardware`.
EXAMPLE_CONFIG = "/home/you/.config"
_BLOCK = re.compile(r"(<!-- example: (?P<command>[^\n]*?) -->\n```text\n)(?P<output>.*?)(```)", re.S)


def command_output(command: str) -> str:
    """What `command` (starting with `llmtrace`) prints on stdout, run in-process at EXAMPLE_COLUMNS columns."""
    from typer.testing import CliRunner

    from llmtrace.cli.app import app

    args = shlex.split(command)
    assert args[0] == "llmtrace", command
    env = {"COLUMNS": str(EXAMPLE_COLUMNS), "XDG_CONFIG_HOME": EXAMPLE_CONFIG, "NO_COLOR": "1", "TERM": "dumb"}
    cwd = os.getcwd()
    os.chdir(REPO)  # paths in the examples are relative to the repository
    try:
        result = CliRunner().invoke(app, args[1:], env=env)
    finally:
        os.chdir(cwd)
    if result.exit_code != 0:
        raise RuntimeError(f"{command!r} exited {result.exit_code}: {result.stderr or result.output}")
    return "\n".join(line.rstrip() for line in result.stdout.splitlines()) + "\n"


def refreshed(text: str) -> tuple[str, list[str]]:
    """README `text` with every example block re-generated, and the commands whose block changed."""
    changed: list[str] = []

    def replace(match: re.Match[str]) -> str:
        output = command_output(match["command"])
        if output != match["output"]:
            changed.append(match["command"])
        return f"{match[1]}{output}{match[4]}"

    return _BLOCK.sub(replace, text), changed


def example_commands(text: str) -> list[str]:
    return [m["command"] for m in _BLOCK.finditer(text)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--write", action="store_true", help="re-generate README.md's example blocks")
    mode.add_argument("--check", action="store_true", help="exit 1 when a block differs from its command's output")
    args = parser.parse_args()
    text = README.read_text(encoding="utf-8")
    new, changed = refreshed(text)
    if args.write:
        README.write_text(new, encoding="utf-8")
        print(f"{len(example_commands(text))} examples, {len(changed)} re-generated: {changed}")
        return 0
    for command in changed:
        print(f"README.md: the example of `{command}` is stale; run `make examples` "
              "(or .venv/bin/python -m benchmarks.readme_examples --write)", file=sys.stderr)
    return 1 if changed else 0


if __name__ == "__main__":
    sys.exit(main())
