"""README.md's example outputs, tables and quoted figures are what the program says now
(benchmarks/readme_examples.py and readme_facts.py; `make examples` re-generates them), and every command README
shows runs."""

from __future__ import annotations

import re
import shlex

import pytest
from typer.testing import CliRunner

from benchmarks.readme_examples import README, example_commands, fact_names, refreshed
from benchmarks.readme_facts import FACTS
from llmtrace.cli.app import app

TEXT = README.read_text(encoding="utf-8")


def test_readme_has_one_example_per_command() -> None:
    commands = example_commands(TEXT)
    named = {c.split()[1] for c in commands}
    assert named == {"run", "show", "flops", "kvmem", "models", "roofline", "hardware"}, commands


def test_readme_examples_and_facts_are_current() -> None:
    _, stale = refreshed(TEXT, checking=True)
    assert stale == [], (f"README.md differs from what the program says: {stale}; run `make examples` "
                         "(or .venv/bin/python -m benchmarks.readme_examples --write)")


def test_every_example_fits_80_columns() -> None:
    """README shows each view as a user's 80-column terminal does."""
    from rich.cells import cell_len

    from benchmarks.readme_examples import EXAMPLE_COLUMNS, example_outputs

    assert EXAMPLE_COLUMNS == 80
    wide = [line for output in example_outputs(TEXT) for line in output.splitlines() if cell_len(line) > 80]
    assert wide == [], wide[:3]


def test_every_fact_is_used_and_known() -> None:
    used = fact_names(TEXT)
    assert set(used) == set(FACTS), (set(FACTS) - set(used), set(used) - set(FACTS))


def test_the_walkthrough_quotes_no_figure_by_hand() -> None:
    """The walkthrough of `llmtrace run` (up to its example) quotes the run's figures through facts only: a size, a
    time or a rate typed into the prose would go stale with the next recording."""
    start = TEXT.index("## `llmtrace run`")
    end = TEXT.index("<!-- example: llmtrace show tests/data/readme_run.trace.json.gz -->")
    prose = re.sub(r"<!-- fact: [\w.]+ -->.*?<!-- /fact -->", "", TEXT[start:end], flags=re.S)
    prose = re.sub(r"BENCHMARKS\.md[^)]*\)|\([^()]*BENCHMARKS\.md[^()]*\)", "", prose)  # cited measurements
    prose = re.sub(r'"[^"\n]*"', "", prose)  # the seed article's own words, quoted
    prose = re.sub(r"`[^`]*`", "", prose)  # the program's own words (options, messages), quoted
    units = re.findall(r"\b\d[\d.,]*\s?(?:kB|MB|GB|ms|µs|FLOP/B|FLOP per byte|tok/s|%)", prose)
    assert units == [], units


# Commands README shows outside its examples that need what a reader of README may not have: the bundled model run
# (slow, and measured elsewhere), a file of their own, GPUs, or a machine measurement that would write a profile.
_NOT_RUN = ("llmtrace run", "llmtrace show", "llmtrace diff", "llmtrace hardware --measure", "path/to/")


def _shown_commands() -> list[str]:
    """Every `llmtrace ...` line of README's code blocks but the examples' outputs (```text), comments stripped."""
    commands, fence = [], None
    for line in TEXT.splitlines():
        if line.startswith("```"):
            fence = None if fence is not None else (line[3:].strip() or "plain")
            continue
        command = line.split("  #")[0].strip()
        if fence in ("plain", "bash") and command.startswith("llmtrace ") and not any(s in command for s in _NOT_RUN):
            commands.append(command)
    return commands


@pytest.mark.parametrize("command", _shown_commands())
def test_every_analytical_command_readme_shows_runs(command: str, tmp_path: object,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    result = CliRunner().invoke(app, shlex.split(command)[1:])
    assert result.exit_code == 0, (command, result.output)
