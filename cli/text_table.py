"""Column-aligned tables as rich Text, printed in one `console.print`.

rich.table lays out every cell through its measurement machinery: about 10 ms for a 20-row table, which the
analytical commands cannot afford (they must answer in about the time Python takes to import typer and rich).
Here the widths are measured once with rich's own cell_len, one column may fold to fit the console, and styles
apply to whole rows.
"""

from __future__ import annotations

import textwrap

from rich.cells import cell_len
from rich.console import Console
from rich.text import Text


class TextTable:
    """Headers with a justification each ("<" left, ">" right); rows of plain-text cells with an optional style."""

    def __init__(self, headers: list[str], justify: str, fold: int | None = None) -> None:
        self.headers = headers
        self.justify = justify  # one character per column
        self.fold = fold  # index of the column that may wrap when the table is wider than the console
        self.rows: list[tuple[list[str], str]] = []  # (cells, style); cells == [] is a separator

    def add_row(self, *cells: str, style: str = "") -> None:
        self.rows.append((list(cells), style))

    def add_separator(self) -> None:
        self.rows.append(([], ""))

    def render(self, max_width: int) -> Text:
        gap = 2
        data = [cells for cells, _ in self.rows if cells]
        widths = [max([cell_len(h)] + [cell_len(r[i]) for r in data]) for i, h in enumerate(self.headers)]
        if self.fold is not None:
            excess = sum(widths) + gap * (len(widths) - 1) + 2 - max_width
            if excess > 0:
                widths[self.fold] = max(16, widths[self.fold] - excess)
        rule = "  " + "─" * (sum(widths) + gap * (len(widths) - 1)) + "\n"
        parts: list[tuple[str, str]] = [("  " + self._line(self.headers, widths, gap) + "\n", "bold"), (rule, "")]
        for cells, style in self.rows:
            if not cells:
                parts.append((rule, ""))
                continue
            for text in self._wrapped(cells, widths, gap):
                parts.append(("  " + text + "\n", style))
        # One Text with style spans (not one Text per line): rich strips control codes from each Text it builds.
        out = Text("".join(line for line, _ in parts)[:-1])  # no newline after the last row
        start = 0
        for line, style in parts:
            if style:
                out.stylize(style, start, start + len(line) - 1)
            start += len(line)
        return out

    def _line(self, cells: list[str], widths: list[int], gap: int) -> str:
        out = []
        for text, width, how in zip(cells, widths, self.justify):
            pad = " " * max(0, width - cell_len(text))
            out.append(pad + text if how == ">" else text + pad)
        return (" " * gap).join(out).rstrip()

    def _wrapped(self, cells: list[str], widths: list[int], gap: int) -> list[str]:
        if self.fold is None or cell_len(cells[self.fold]) <= widths[self.fold]:
            return [self._line(cells, widths, gap)]
        pieces = textwrap.wrap(cells[self.fold], widths[self.fold]) or [""]
        first = list(cells)
        first[self.fold] = pieces[0]
        out = [self._line(first, widths, gap)]
        for piece in pieces[1:]:
            more = [""] * len(cells)
            more[self.fold] = piece
            out.append(self._line(more, widths, gap))
        return out


def print_table(console: Console, title: str, table: TextTable, blank_line: bool = True) -> None:
    """A blank line (unless the table opens the output), the title (rich markup allowed), then the table."""
    console.print(f"\n{title}" if blank_line else title, table.render(console.width), sep="\n", soft_wrap=True)
