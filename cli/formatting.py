"""How the CLI writes numbers: one convention per unit, for every command (the only module that formats a figure).

- Significant figures: counts that are exact (FLOPs, MACs, bytes) keep 4 (`13.22 GFLOP`, `524.3 kB`); times, rates,
  ratios and other measured or predicted figures keep 3 (`12.3 ms`, `25.3 GB/s`, `27.3 tok/s`). A value of 1000 or
  more is written whole, with thousands separators (`1,234 s`, `2,328 GiB`).
- Prefixes are decimal SI ones: k = 10^3 (lower case), M = 10^6, G = 10^9, T = 10^12, P = 10^15, E = 10^18.
- FLOPs: 2 per multiply-add, everywhere; a MAC is one multiply-add (`--macs` shows matmuls in MACs).
- Bytes: decimal, B / kB / MB / GB / TB. Binary units (KiB, MiB, GiB = 2^30 bytes) appear only where a figure is
  also, or traditionally, given in binary: `bytes_both` ("1.049 GB (0.9766 GiB)") and `gib`.
- Times: the function's name says the unit it takes (`duration_ns`, `duration_s`); it writes s, ms, µs or ns.
- Shares: a percentage with one decimal, `<0.1%` and `>99.9%` rather than a misleading 0.0% or 100.0%.
- Column cells whose unit is in the column's header are plain numbers: `number_in(value, unit)`.

Also here, because every renderer needs them the same way: tensor shapes, token pieces made visible, bars.
"""

from __future__ import annotations

from typing import Any, Sequence

from rich.text import Text

EXACT = 4  # significant figures of an exact count
MEASURED = 3  # significant figures of a time, a rate, a ratio

_PREFIXES = ((1e18, "E"), (1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k"))
_SCALES = {"": 1.0, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "KiB": 2.0**10, "MiB": 2.0**20, "GiB": 2.0**30,
           "ms": 1e-3, "µs": 1e-6}


def figures(value: float, digits: int = MEASURED) -> str:
    """`value` to `digits` significant figures, trailing zeros kept, no exponent: 0.0120, 12.0, 123, 1,234."""
    if value == 0:
        return "0"
    rounded = float(f"{value:.{digits}g}")
    if abs(rounded) >= 1000:
        return f"{value:,.0f}"
    if abs(rounded) >= 10 ** (digits - 1):  # every figure before the point: 123, not 1.23e+02
        return f"{rounded:.0f}"
    return f"{value:#.{digits}g}".rstrip(".")


def si(value: float, unit: str, digits: int = EXACT) -> str:
    """`value` with a decimal prefix on `unit`: si(13218912451, "FLOP") == '13.22 GFLOP'; under 1000 as it is."""
    rounded = float(f"{value:.{digits}g}")  # 999.97e9 is '1 T...', not '1000 G...'
    for scale, prefix in _PREFIXES:
        if abs(rounded) >= scale:
            return f"{figures(value / scale, digits)} {prefix}{unit}"
    if value == int(value):
        return f"{value:.0f} {unit}"  # a whole number of FLOPs or bytes: no decimals
    return f"{figures(value, digits)} {unit}"


def number_in(value: float, unit: str, digits: int = MEASURED) -> str:
    """A table cell whose unit the header gives: number_in(2.5e10, "G") == '25'; number_in(0.0123, "ms") == '12.3'."""
    return figures(value / _SCALES[unit], digits)


def count(value: int) -> str:
    """An exact integer, every digit: 6,738,415,616."""
    return f"{value:,}"


# ---- FLOPs ----------------------------------------------------------------------------------------------------


def flops(value: float, matmul_as_macs: bool = False) -> str:
    """'13.22 GFLOP'; with `matmul_as_macs` (a matmul figure under --macs) the multiply-adds: '6.609 GMAC'."""
    if matmul_as_macs:
        return si(value / 2, "MAC")
    return si(value, "FLOP")


def flops_per_s(value: float) -> str:
    """'312 TFLOP/s'."""
    return si(value, "FLOP/s", MEASURED)


def intensity(flops_per_byte: float) -> str:
    """Arithmetic intensity: '1.02 FLOP/B', '153 FLOP/B'."""
    return f"{figures(flops_per_byte)} FLOP/B"


# ---- bytes ----------------------------------------------------------------------------------------------------


def nbytes(value: float) -> str:
    """Decimal: '524.3 kB', '13.48 GB'; under 1000 in bytes."""
    return si(value, "B")


def bytes_both(value: float) -> str:
    """Decimal, then binary at the same step: '1.049 GB (0.9766 GiB)', '524.3 kB (512 KiB)'; under 1000 in bytes."""
    if abs(value) < 1000:
        return f"{value:,.0f} B"
    text = nbytes(value)
    binary = {"kB": ("KiB", 2.0**10), "MB": ("MiB", 2.0**20)}.get(text.split()[-1], ("GiB", 2.0**30))
    return f"{text} ({figures(value / binary[1], EXACT)} {binary[0]})"


def gib(value: float) -> str:
    """Binary gibibytes, for memory capacities: '12.55 GiB', '80 GiB'."""
    return f"{figures(value / 2**30, EXACT)} GiB"


def bytes_per_s(value: float) -> str:
    """'25.3 GB/s'."""
    return si(value, "B/s", MEASURED)


# ---- time and speed -------------------------------------------------------------------------------------------


def duration_s(seconds: float) -> str:
    """'1.23 s', '12.3 ms', '456 µs', '789 ns', '1,234 s'."""
    magnitude = abs(float(f"{seconds:.{MEASURED}g}"))
    for scale, unit in ((1.0, "s"), (1e-3, "ms"), (1e-6, "µs")):
        if magnitude >= scale:
            return f"{figures(seconds / scale)} {unit}"
    return f"{figures(seconds / 1e-9)} ns"


def duration_ns(nanoseconds: float) -> str:
    """A duration given in nanoseconds, written as `duration_s` writes it."""
    return duration_s(nanoseconds / 1e9)


def tokens_per_s(value: float) -> str:
    """'27.3 tok/s'."""
    return f"{figures(value)} tok/s"


def times(ratio: float, digits: int = MEASURED) -> str:
    """A ratio: '153×', '1.08×'."""
    return f"{figures(ratio, digits)}×"


def share(part: float, whole: float) -> str:
    """Percent with one decimal; '<0.1%' and '>99.9%' rather than a misleading 0.0% or 100.0%; '-' of nothing."""
    if not whole:
        return "-"
    pct = 100 * part / whole
    if 0 < pct < 0.05:
        return "<0.1%"
    if 99.95 <= pct < 100:
        return ">99.9%"
    return f"{pct:.1f}%"


def probability(p: float) -> str:
    """A probability as a percentage: '87.3%'."""
    return f"{100 * p:.1f}%"


# ---- shapes, pieces, bars -------------------------------------------------------------------------------------


def shape(dims: Sequence[int]) -> str:
    return "[" + ", ".join(str(d) for d in dims) + "]"


def piece(text: str) -> str:
    """A token piece made visible: spaces as ·, newlines as ⏎, tabs as ⇥."""
    return text.replace(" ", "·").replace("\n", "⏎").replace("\t", "⇥")


def bar(fraction: float, width: int = 20, style: str = "cyan") -> Text:
    """A small horizontal bar of `fraction` (0..1) of `width` cells, eighths for the last cell."""
    fraction = min(max(fraction, 0.0), 1.0)
    eighths = round(fraction * width * 8)
    full, rest = divmod(eighths, 8)
    partial = " ▏▎▍▌▋▊▉"[rest] if rest else ""
    return Text("█" * full + partial, style=style)


def flow(phrases: Sequence[str], width: int, indent: str = "  ") -> str:
    """Markup `phrases` on as few lines as `width` columns allow, broken only between phrases (a continuation line
    starts with `indent`): a header line that would otherwise wrap mid-phrase at 80 columns ("vocab" at one line's
    end, "32,000" at the next's start)."""
    lines: list[str] = []
    for phrase in phrases:
        if lines and Text.from_markup(f"{lines[-1]} {phrase}").cell_len <= width:
            lines[-1] += f" {phrase}"
        else:
            lines.append(phrase if not lines else indent + phrase)
    return "\n".join(lines)


def phrases(sentence: str) -> list[str]:
    """A sentence's comma-separated parts, each keeping its comma: what `flow` breaks a line between."""
    parts = sentence.split(", ")
    return [part + "," for part in parts[:-1]] + parts[-1:]


def window_label(config: Any) -> str:
    """A header's word on a ModelConfig's sliding window: none, on every layer, or on all but the global layers
    (Gemma 3's interleaving)."""
    if config.sliding_window is None:
        return ""
    if config.mixed_windows:
        return (f"· sliding window {config.sliding_window:,} on {config.windowed_layers} layers, "
                f"{len(config.full_layers)} global")
    return f"· sliding window {config.sliding_window:,}"
