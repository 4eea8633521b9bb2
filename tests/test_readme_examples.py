"""README.md's example outputs are what the commands print now (benchmarks/readme_examples.py; `make examples`
re-generates them)."""

from __future__ import annotations

from benchmarks.readme_examples import README, example_commands, refreshed


def test_readme_has_one_example_per_command() -> None:
    commands = example_commands(README.read_text(encoding="utf-8"))
    named = {c.split()[1] for c in commands}
    assert named == {"run", "show", "flops", "kvmem", "models", "roofline", "hardware"}, commands


def test_readme_examples_are_current() -> None:
    _, stale = refreshed(README.read_text(encoding="utf-8"))
    assert stale == [], (f"README.md examples differ from the commands' output: {stale}; run `make examples` "
                         "(or .venv/bin/python -m benchmarks.readme_examples --write)")
