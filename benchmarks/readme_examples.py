"""README.md's example outputs, tables and quoted figures, re-generated from the program itself, so that they cannot go
stale.

Each example in README.md is a marker line followed by a fenced block:

    <!-- example: llmtrace kvmem --model llama-7b --seq 4096 -->
    ```text
    ...the command's output...
    ```

and each table or figure the prose quotes sits between two markers naming a fact of benchmarks/readme_facts.py:

    five characters become <!-- fact: run.tokens -->12<!-- /fact --> tokens

`--write` runs every marked command (in-process, at EXAMPLE_COLUMNS columns, with a config folder that holds no
saved measurement of this machine) and works out every fact, and replaces each block; `--check`
(tests/test_readme_examples.py runs it) fails on any that differs from what the program says now. Only commands
whose output is the same on every machine and every run are examples here: analytical ones, dry runs, and `show` of
the traces committed in tests/data/ (real runs of the bundled model, rendered from their saved records).

    .venv/bin/python -m benchmarks.readme_examples --write      # `make examples`
    .venv/bin/python -m benchmarks.readme_examples --check
    .venv/bin/python -m benchmarks.readme_examples --record     # record the committed traces again, then --write

`--record` runs the bundled model (readme_facts.RUN_COMMAND and LENS_COMMAND): its figures are this machine's.
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
EXAMPLE_COLUMNS = 80  # every view must read well at 80 columns: README shows them so
# A config folder that holds no measured profile (the examples never write one); its path shows in `hardware`.
EXAMPLE_CONFIG = "/home/you/.config"
_BLOCK = re.compile(r"(<!-- example: (?P<command>[^\n]*?) -->\n```text\n)(?P<output>.*?)(```)", re.S)
_FACT = re.compile(r"(<!-- fact: (?P<name>[\w.]+) -->\n?)(?P<output>.*?)(<!-- /fact -->)", re.S)


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


def refreshed(text: str, checking: bool = False) -> tuple[str, list[str]]:
    """README `text` with every example block and fact re-generated, and the commands and facts that changed.
    `checking`: leave out a fact README wrote under other installed packages (readme_facts.SAME_ENVIRONMENT)."""
    from benchmarks.readme_facts import FACTS, SAME_ENVIRONMENT

    changed: list[str] = []

    def replace(match: re.Match[str]) -> str:
        output = command_output(match["command"])
        if output != match["output"]:
            changed.append(match["command"])
        return f"{match[1]}{output}{match[4]}"

    def fact(match: re.Match[str]) -> str:
        name = match["name"]
        if name not in FACTS:
            raise KeyError(f"README.md names fact {name!r}, which benchmarks/readme_facts.py does not define")
        same = SAME_ENVIRONMENT.get(name, lambda written: True)(match["output"])
        if checking and not same:
            return match[0]
        output = FACTS[name]()
        if output != match["output"]:
            changed.append(f"fact {name}")
        return f"{match[1]}{output}{match[4]}"

    return _FACT.sub(fact, _BLOCK.sub(replace, text)), changed


def fact_names(text: str) -> list[str]:
    return [m["name"] for m in _FACT.finditer(text)]


def record() -> None:
    """Run the bundled model for the committed traces (readme_facts.RUN_COMMAND, LENS_COMMAND)."""
    import subprocess

    from benchmarks.readme_facts import LENS_COMMAND, RUN_COMMAND

    for args in (RUN_COMMAND, LENS_COMMAND):
        subprocess.run([sys.executable, "-m", "llmtrace", *args], cwd=REPO, check=True,
                       stdout=subprocess.DEVNULL)


def example_commands(text: str) -> list[str]:
    return [m["command"] for m in _BLOCK.finditer(text)]


def example_outputs(text: str) -> list[str]:
    return [m["output"] for m in _BLOCK.finditer(text)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--write", action="store_true", help="re-generate README.md's example blocks")
    mode.add_argument("--check", action="store_true", help="exit 1 when a block differs from its command's output")
    mode.add_argument("--record", action="store_true", help="record the committed traces again, then --write")
    args = parser.parse_args()
    if args.record:
        record()
    text = README.read_text(encoding="utf-8")
    new, changed = refreshed(text, checking=args.check)
    if args.write or args.record:
        README.write_text(new, encoding="utf-8")
        print(f"{len(example_commands(text))} examples and {len(fact_names(text))} facts, {len(changed)} "
              f"re-generated: {changed}")
        return 0
    for command in changed:
        print(f"README.md: `{command}` is stale; run `make examples` "
              "(or .venv/bin/python -m benchmarks.readme_examples --write)", file=sys.stderr)
    return 1 if changed else 0


if __name__ == "__main__":
    sys.exit(main())
