"""The Typer application: one sub-module per command group, registered here."""

from __future__ import annotations

import typer

app = typer.Typer(
    name="llmtrace",
    help="See, with real numbers, what a LLaMA-family model does to predict a token.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

# Command modules register themselves on `app` when imported.
from cli import commands_analytical  # noqa: E402,F401
from cli import cmd_hardware, cmd_roofline  # noqa: E402,F401
from cli import cmd_run  # noqa: E402,F401


def main() -> None:
    app()
