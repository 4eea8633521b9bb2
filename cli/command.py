"""The command class every llmtrace command uses: options shown in their groups, old spellings still read.

Groups: an option declared with typer's `rich_help_panel="Sampling"` is listed under a "Sampling:" heading of the
plain help (the app keeps click's two-column help, readable at 80 columns; typer itself draws panels only in its
rich mode), in the order the groups first appear, options without a group last under "Options:".

Old spellings: `renamed` maps an option's former name to its name now (`--new-tokens` -> `--max-new-tokens`), so
scripts written for the old name keep working without a second, visible option in the help.
"""

from __future__ import annotations

from typing import Any, Callable, ClassVar, Sequence

from typer.core import TyperCommand

try:  # typer >= 0.26 vendors click
    from typer._click import Context, HelpFormatter
except ImportError:  # pragma: no cover - older typer on top of click
    from click import Context, HelpFormatter  # type: ignore[no-redef, assignment]

COLUMN_MAX = 30  # click's: a longer option is written on a line of its own, its help below
OTHER = "Options"
RANGE_METAVARS = {"int range": "<int>", "float range": "<float>"}  # the heading of options declared without a group (-h/--help among them)

# A function that rewrites a command line before click reads it (one command's old spellings that are more than a
# rename, such as `run --json PATH`); it returns the arguments to parse.
Rewrite = Callable[[list[str]], list[str]]


class GroupedCommand(TyperCommand):
    """A typer command whose help lists options by `rich_help_panel` and whose parser reads `renamed` old names."""

    renamed: ClassVar[dict[str, str]] = {}
    rewrite: ClassVar[Rewrite | None] = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        for param in self.params:  # typer writes `min=1` as "<int range>": one placeholder style, <int>
            if param.metavar is None and getattr(param.type, "name", "") in RANGE_METAVARS:
                param.metavar = RANGE_METAVARS[param.type.name]

    def parse_args(self, ctx: Context, args: list[str]) -> list[str]:
        args = renamed_args(args, self.renamed)
        if self.rewrite is not None:
            args = self.rewrite(args)
        return super().parse_args(ctx, args)

    def format_options(self, ctx: Context, formatter: HelpFormatter) -> None:
        arguments: list[tuple[str, str]] = []
        groups: dict[str, list[tuple[str, str]]] = {}
        for param in self.get_params(ctx):
            record = param.get_help_record(ctx)
            if record is None:
                continue
            if param.param_type_name == "argument":
                arguments.append(record)
            else:
                groups.setdefault(getattr(param, "rich_help_panel", None) or OTHER, []).append(record)
        # One first column for every group (click sizes each list alone), so the groups' help texts line up.
        terms = [term for rows in groups.values() for term, _ in rows]
        width = min(max(map(len, terms), default=0), COLUMN_MAX)
        if arguments:
            with formatter.section("Arguments"):
                formatter.write_dl(arguments)
        for title in sorted(groups, key=lambda name: name == OTHER):  # stable: first-seen order, OTHER last
            with formatter.section(title):
                formatter.write_dl([(term.ljust(width), text) for term, text in groups[title]], col_max=COLUMN_MAX)


def command_class(renamed: dict[str, str] | None = None, rewrite: Rewrite | None = None) -> type[GroupedCommand]:
    """A GroupedCommand subclass for one command (typer's `app.command(cls=...)` takes a class)."""
    held = staticmethod(rewrite) if rewrite is not None else None  # a function kept on a class, not a method
    return type("Command", (GroupedCommand,), {"renamed": dict(renamed or {}), "rewrite": held})


def renamed_args(args: Sequence[str], renamed: dict[str, str]) -> list[str]:
    """`args` with every old option name (alone or as `--old=value`) replaced by its new name, up to `--`."""
    out: list[str] = []
    for i, arg in enumerate(args):
        if arg == "--":
            return [*out, *args[i:]]
        name, eq, value = arg.partition("=")
        out.append(f"{renamed[name]}{eq}{value}" if name in renamed else arg)
    return out


def panel_of(param: Any) -> str:
    """The group an option is listed under in the help."""
    return getattr(param, "rich_help_panel", None) or OTHER
