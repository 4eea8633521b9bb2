"""Number formatting for the `run` renderers: FLOPs, bytes (decimal: kB = 1e3, MB = 1e6, GB = 1e9), times, shapes."""

from __future__ import annotations

from typing import Sequence

from rich.text import Text


def flops(value: float) -> str:
    """1.23 GFLOP; FLOPs are 2 per multiply-add everywhere in llmtrace."""
    for unit, scale in (("TFLOP", 1e12), ("GFLOP", 1e9), ("MFLOP", 1e6), ("kFLOP", 1e3)):
        if abs(value) >= scale:
            return f"{value / scale:.2f} {unit}"
    return f"{value:.0f} FLOP"


def flops_per_second(value: float) -> str:
    return flops(value).replace("FLOP", "FLOP/s")


def nbytes(value: float) -> str:
    """Decimal units, labelled: 1 MB = 1e6 bytes, 1 GB = 1e9 bytes."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(value) >= scale:
            return f"{value / scale:.2f} {unit}"
    return f"{value:.0f} B"


def bytes_per_second(value: float) -> str:
    return nbytes(value) + "/s"


def ms(ns: float) -> str:
    """Milliseconds from nanoseconds, three significant-ish digits."""
    value = ns / 1e6
    if value >= 100:
        return f"{value:.0f} ms"
    if value >= 10:
        return f"{value:.1f} ms"
    if value >= 0.1:
        return f"{value:.2f} ms"
    return f"{ns / 1e3:.1f} µs"


def shape(dims: Sequence[int]) -> str:
    return "[" + ", ".join(str(d) for d in dims) + "]"


def percent(part: float, whole: float) -> str:
    return f"{100 * part / whole:.1f}%" if whole else "-"


def bar(fraction: float, width: int = 20, style: str = "cyan") -> Text:
    """A small horizontal bar of `fraction` (0..1) of `width` cells, eighths for the last cell."""
    fraction = min(max(fraction, 0.0), 1.0)
    eighths = round(fraction * width * 8)
    full, rest = divmod(eighths, 8)
    partial = " ▏▎▍▌▋▊▉"[rest] if rest else ""
    return Text("█" * full + partial, style=style)


def piece(text: str) -> str:
    """A token piece made visible: spaces as ·, newlines as ⏎, tabs as ⇥."""
    return text.replace(" ", "·").replace("\n", "⏎").replace("\t", "⇥")
