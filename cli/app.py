"""The Typer application: one sub-module per command group, registered here.

Typer builds every registered command (signatures, annotations) on each call, and each command module imports its
renderers, so `main` imports only the module of the command being run (click's "lazily loading subcommands"):
`llmtrace kvmem` never imports what `llmtrace run` needs. No command, `--help` or an unknown name load them all, and
so does importing `app` from here (tests, CliRunner), through the module `__getattr__` below.
"""

from __future__ import annotations

import gc
import importlib
import os
import sys
from typing import Annotated, Any

import typer

try:  # typer >= 0.26 vendors click
    from typer._click.exceptions import ClickException, NoArgsIsHelpError
except ImportError:  # pragma: no cover - older typer on top of click
    from click.exceptions import ClickException, NoArgsIsHelpError  # type: ignore[no-redef]

_app = typer.Typer(
    name="llmtrace",
    help="See, with real numbers, what a LLaMA-family model does to predict a token.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},  # every command inherits -h
    # click's plain help, not Typer's rich panels: its two columns wrap each option's help under it at any width,
    # where the panels' four columns leave an 80-column terminal a 23-column help text and cut long words.
    rich_markup_mode=None,
)


def _print_version(value: bool) -> None:
    if value:
        from llmtrace.tracer.core.version import llmtrace_version

        print(f"llmtrace {llmtrace_version()}")
        raise typer.Exit()


@_app.callback()
def _root(
    version: Annotated[bool, typer.Option("--version", callback=_print_version, is_eager=True,
                                          help="Print llmtrace's version (from the installed metadata) and exit.")] = False,
) -> None:
    """A group callback, so that Typer keeps `llmtrace COMMAND` even when main() has loaded a single command."""


# Command name -> the module that registers it on `app` when imported (`from llmtrace.cli.app import app`), in help order.
COMMAND_MODULES: dict[str, str] = {
    "run": "llmtrace.cli.cmd_run",
    "show": "llmtrace.cli.cmd_show",
    "diff": "llmtrace.cli.cmd_diff",
    "flops": "llmtrace.cli.cmd_flops",
    "kvmem": "llmtrace.cli.cmd_kvmem",
    "models": "llmtrace.cli.cmd_models",
    "roofline": "llmtrace.cli.cmd_roofline",
    "hardware": "llmtrace.cli.cmd_hardware",
    "tune": "llmtrace.cli.cmd_tune",
}
_loading = False  # True while command modules import: they get the bare app, not a recursive load


def load_commands(names: list[str] | None = None) -> typer.Typer:
    """Import the command modules of `names` (all when None) so that they register on the app; return the app."""
    global _loading
    was_loading, _loading = _loading, True
    try:
        for name in COMMAND_MODULES if names is None else names:
            importlib.import_module(COMMAND_MODULES[name])
    finally:
        _loading = was_loading
    return _app


def __getattr__(name: str) -> Any:
    if name == "app":  # `from llmtrace.cli.app import app`: the app with every command registered
        return _app if _loading else load_commands()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _command_in(args: list[str]) -> list[str] | None:
    """The command named first on the command line, or None (load all) for none, --help or an unknown name."""
    first = next((a for a in args if not a.startswith("-")), None)
    return [first] if first in COMMAND_MODULES else None


def main(argv: list[str] | None = None) -> None:
    """Console-script entry. Usage errors (bad value, unknown option) become one line on stderr with exit code 2;
    unexpected errors one line with exit code 1. LLMTRACE_DEBUG=1 lets tracebacks through."""
    if argv is None:  # the console script (not a caller in a longer-lived process, such as a test)
        # Everything imported so far (typer, click, rich) lives as long as the process: freezing it keeps the cyclic
        # GC from re-scanning it during the imports and work below, ~10 ms of an analytical command's ~90 ms.
        gc.freeze()
        # `llmtrace ... | head`: once the reader has gone, the rest of the report is dropped, not a traceback; a run
        # still writes its --json / --chrome-trace files.
        from llmtrace.cli.pipes import PipeGuard

        sys.stdout = PipeGuard(sys.stdout)  # type: ignore[assignment]
    debug = os.environ.get("LLMTRACE_DEBUG") == "1"
    args = sys.argv[1:] if argv is None else list(argv)
    try:
        result = load_commands(_command_in(args))(args=args, prog_name="llmtrace", standalone_mode=False)
    except NoArgsIsHelpError as exc:
        exc.show()  # `llmtrace` alone: the help text, as click does
        result = exc.exit_code
    except ClickException as exc:
        if debug:
            raise
        ctx = getattr(exc, "ctx", None)
        hint = f" (see `{ctx.command_path} --help`)" if ctx is not None else ""
        message = " ".join(exc.format_message().split())
        from llmtrace.cli.console import visible_controls  # the message may quote an argument

        print(f"llmtrace: error: {visible_controls(message)}{hint}", file=sys.stderr)
        result = exc.exit_code
    except typer.Abort:
        print("llmtrace: aborted", file=sys.stderr)
        result = 130
    except Exception as exc:  # a bug, not bad input: one line unless debugging
        if debug:
            raise
        from llmtrace.cli.console import visible_controls

        if _out_of_memory(exc):  # the machine's limit, not a bug: one line naming what to do, as bad input gets
            print(f"llmtrace: error: out of memory ({_said(exc) or 'an allocation failed'}); free memory, raise the "
                  "limit (ulimit -v, the container's memory) or use a smaller model", file=sys.stderr)
            result = 2
        else:
            print(f"llmtrace: internal error: {type(exc).__name__}: {visible_controls(str(exc))}; rerun with "
                  "LLMTRACE_DEBUG=1 for the traceback", file=sys.stderr)
            result = 1
    sys.exit(result if isinstance(result, int) else 0)


def _out_of_memory(exc: BaseException) -> bool:
    """MemoryError, an OSError of ENOMEM (mmap of a file past `ulimit -v`, a failed allocation in C), or torch's
    allocator failing."""
    import errno

    if isinstance(exc, MemoryError) or (isinstance(exc, OSError) and exc.errno == errno.ENOMEM):
        return True
    # torch: "DefaultCPUAllocator: can't allocate memory", and its OutOfMemoryError (a RuntimeError) on a GPU
    return isinstance(exc, RuntimeError) and (type(exc).__name__ == "OutOfMemoryError"
                                              or "can't allocate memory" in str(exc))


def _said(exc: BaseException) -> str:
    from llmtrace.cli.console import visible_controls

    return visible_controls(" ".join(str(exc).split()))[:160]
