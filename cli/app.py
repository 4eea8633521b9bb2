"""The Typer application: one sub-module per command group, registered here."""

from __future__ import annotations

import os
import sys

import typer

app = typer.Typer(
    name="llmtrace",
    help="See, with real numbers, what a LLaMA-family model does to predict a token.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

# Command modules register themselves on `app` when imported.
from cli import cmd_flops, cmd_kvmem, cmd_models  # noqa: E402,F401
from cli import cmd_hardware, cmd_roofline  # noqa: E402,F401
from cli import cmd_run  # noqa: E402,F401

try:  # typer >= 0.20 vendors click
    from typer._click.exceptions import ClickException, NoArgsIsHelpError  # noqa: E402
except ImportError:  # pragma: no cover - older typer on top of click
    from click.exceptions import ClickException, NoArgsIsHelpError  # type: ignore[no-redef]  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    """Console-script entry. Usage errors (bad value, unknown option) become one line on stderr with exit code 2;
    unexpected errors one line with exit code 1. LLMTRACE_DEBUG=1 lets tracebacks through."""
    debug = os.environ.get("LLMTRACE_DEBUG") == "1"
    try:
        result = app(args=argv, prog_name="llmtrace", standalone_mode=False)
    except NoArgsIsHelpError as exc:
        exc.show()  # `llmtrace` alone: the help text, as click does
        result = exc.exit_code
    except ClickException as exc:
        if debug:
            raise
        ctx = getattr(exc, "ctx", None)
        hint = f" (see `{ctx.command_path} --help`)" if ctx is not None else ""
        message = " ".join(exc.format_message().split())
        print(f"llmtrace: error: {message}{hint}", file=sys.stderr)
        result = exc.exit_code
    except typer.Abort:
        print("llmtrace: aborted", file=sys.stderr)
        result = 130
    except Exception as exc:  # a bug, not bad input: one line unless debugging
        if debug:
            raise
        print(f"llmtrace: internal error: {type(exc).__name__}: {exc}; rerun with LLMTRACE_DEBUG=1 for the traceback",
              file=sys.stderr)
        result = 1
    sys.exit(result if isinstance(result, int) else 0)
