"""Number formatting for the renderers: FLOPs in SI units, bytes in both GB (1e9) and GiB (2^30), labelled."""

from __future__ import annotations

_SI = ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k"))


def si(value: float, unit: str = "") -> str:
    """13218912451 -> '13.22 G' + unit; values under 1000 are printed as they are."""
    for scale, prefix in _SI:
        if abs(value) >= scale:
            return f"{value / scale:.4g} {prefix}{unit}"
    return f"{value:g} {unit}"


def flops(value: int, kind: str, macs: bool) -> str:
    """A matmul figure in FLOPs, or in MACs (FLOPs / 2) when `macs`; elementwise work stays in FLOPs (no MACs)."""
    if macs and kind == "matmul":
        return si(value // 2, "MAC")
    return si(value, "FLOP")


def gb(value: int) -> str:
    return f"{value / 1e9:,.3f} GB"


def gib(value: int) -> str:
    return f"{value / 2**30:,.3f} GiB"


def bytes_both(value: int) -> str:
    """'1.049 GB (0.977 GiB)'; small sizes in MB/MiB or KB/KiB so they stay readable."""
    if value >= 1e9:
        return f"{gb(value)} ({gib(value)})"
    if value >= 1e6:
        return f"{value / 1e6:,.3f} MB ({value / 2**20:,.3f} MiB)"
    if value >= 1e3:
        return f"{value / 1e3:,.3f} KB ({value / 2**10:,.3f} KiB)"
    return f"{value} B"


def share(part: int, whole: int) -> str:
    """Percent with one decimal; '<0.1%' and '>99.9%' rather than a misleading 0.0% or 100.0%."""
    if not whole:
        return "-"
    pct = 100 * part / whole
    if 0 < pct < 0.05:
        return "<0.1%"
    if 99.95 <= pct < 100:
        return ">99.9%"
    return f"{pct:.1f}%"
