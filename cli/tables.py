"""The one table style of the CLI's reports: rich.table, a rule under the header and between sections, no frame.

rich lays the columns out (widths, wrapping at word boundaries, right-justified numbers) for the console's width;
the renderers choose what goes in the cells and, for narrow consoles, which columns to stack (render_flops.py).
"""

from __future__ import annotations

from rich.box import Box
from rich.console import Console, RenderableType
from rich.measure import Measurement
from rich.table import Table

# Eight rows of four characters: top, head, head row, mid, row, foot row, foot, bottom. Only the head row (under
# the header) and the row line (after a row added with end_section=True) are drawn.
RULES = Box(
    "    \n"
    "    \n"
    " ── \n"
    "    \n"
    " ── \n"
    " ── \n"
    "    \n"
    "    \n"
)


def report_table(show_header: bool = True, gap: int = 2) -> Table:
    """A table of figures: columns `gap` spaces apart (the box's blank divider + gap - 1 of padding), no frame. Its title is a line of its own, printed before
    it by the renderer (a rich table title would wrap at the table's width, however narrow the table)."""
    return Table(box=RULES, show_edge=False, pad_edge=False, padding=(0, gap - 1, 0, 0), show_header=show_header,
                 header_style="bold")


def natural_width(console: Console, renderable: RenderableType) -> int:
    """The width `renderable` takes when nothing limits it (rich's own measure stops at the console's width)."""
    return Measurement.get(console, console.options.update_width(10_000), renderable).maximum
