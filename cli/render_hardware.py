"""Rich rendering of hardware profiles and of a `--measure` run. Reads records only."""

from __future__ import annotations

from rich import box
from rich.console import Console
from rich.table import Table

from llmtrace.tracer.hardware.profiles import PEAK_DTYPES, HardwareProfile

GiB = 2**30


def _tflops(value: float | None) -> str:
    """TFLOP/s with three significant figures (0.300 for a CPU, 1,307 for an MI300X)."""
    if value is None:
        return "—"
    tf = value / 1e12
    return f"{tf:.0f}" if tf >= 100 else f"{tf:.3g}"


def _ridge(profile: HardwareProfile) -> str:
    """Ridge point of the 16-bit peak (bf16, else fp16, else fp32), the dtype LLM inference usually runs in."""
    for dtype in ("bf16", "fp16", "fp32"):
        if profile.has_peak(dtype):
            return f"{profile.ridge_point(dtype):.0f}"
    return "—"


def profiles_table(profiles: list[HardwareProfile], title: str = "Hardware profiles (dense peaks)") -> Table:
    table = Table(title=title, title_justify="left", box=box.SIMPLE_HEAD, padding=0)
    table.add_column("name", style="bold", no_wrap=True)
    for dtype in PEAK_DTYPES:
        table.add_column(dtype, justify="right", no_wrap=True)
    table.add_column("TB/s", justify="right", no_wrap=True)
    table.add_column("GiB", justify="right", no_wrap=True)
    table.add_column("ridge", justify="right", no_wrap=True)
    table.add_column("link GB/s", justify="left", no_wrap=True)
    for p in profiles:
        link = "none" if p.interconnect_bandwidth == 0 else f"{p.interconnect} {p.interconnect_bandwidth / 1e9:,.0f}"
        table.add_row(
            p.name,
            *(_tflops(getattr(p, d)) for d in PEAK_DTYPES),
            f"{p.memory_bandwidth / 1e12:.3g}" if p.memory_bandwidth >= 1e11 else f"{p.memory_bandwidth / 1e12:.4f}",
            f"{p.memory_bytes / GiB:,.0f}",
            _ridge(p),
            link,
        )
    return table


def sources_table(profiles: list[HardwareProfile]) -> Table:
    table = Table(box=box.SIMPLE_HEAD, pad_edge=False, title_justify="left")
    table.add_column("name", style="bold", no_wrap=True)
    table.add_column("device")
    table.add_column("source")
    for p in profiles:
        table.add_row(p.name, p.label, p.source)
    return table


def render_profiles(console: Console, profiles: list[HardwareProfile], store: str, has_measured: bool) -> None:
    console.print(profiles_table(profiles))
    console.print(
        "Peaks in TFLOP/s (int8: TOP/s), the vendors' dense figures: 2:4 sparsity doubles them on paper and "
        "inference kernels do not use it. Memory bandwidth in TB/s (10¹² bytes/s), capacity in GiB (2³⁰ bytes). "
        "ridge = 16-bit peak FLOP/s (bf16, else fp16, else fp32) ÷ bandwidth, in FLOPs per byte: a phase doing fewer FLOPs per byte it moves "
        "is memory-bound. Interconnect: per device, both directions together, as datasheets print it."
    )
    console.print(sources_table(profiles))
    if not has_measured:
        console.print(f"No measured profile yet: `llmtrace hardware --measure` adds 'this-machine' ({store}).")
    else:
        console.print(f"Measured profiles are read from {store}.")


def render_measurement(console: Console, measurement: dict, profile: HardwareProfile, saved_to: str) -> None:
    """`measurement` is asdict(MachineMeasurement) (plain data, so this module needs no torch)."""
    table = Table(title=f"Measured on {measurement['device_name']}", title_justify="left")
    table.add_column("ceiling")
    table.add_column("how", justify="left")
    table.add_column("runs", justify="right")
    table.add_column("best run", justify="right")
    table.add_column("min … max seconds", justify="right")
    for g in measurement["gemms"]:
        table.add_row(
            f"{g['dtype']} GEMM",
            f"{g['n']}×{g['n']} @ {g['n']}×{g['n']} ({g['flops_per_run'] / 1e9:,.2f} GFLOP)",
            str(len(g["seconds"])),
            f"{g['flops_per_s'] / 1e9:,.1f} GFLOP/s",
            f"{min(g['seconds']):.4f} … {max(g['seconds']):.4f}",
        )
    c = measurement["copy"]
    table.add_row(
        "memory bandwidth",
        f"copy {c['buffer_bytes'] / 2**20:,.0f} MiB (read + write = {c['bytes_per_run'] / 2**20:,.0f} MiB)",
        str(len(c["seconds"])),
        f"{c['bytes_per_s'] / 1e9:,.1f} GB/s",
        f"{min(c['seconds']):.4f} … {max(c['seconds']):.4f}",
    )
    console.print(table)
    ridges = ", ".join(
        f"{d} {profile.ridge_point(d):,.1f}" for d in PEAK_DTYPES if profile.has_peak(d)
    )
    console.print(f"Ridge point (FLOP/byte): {ridges}. Memory: {profile.memory_bytes / GiB:,.1f} GiB.")
    console.print(f"Saved as profile '{profile.name}' in {saved_to}; use it with --hardware {profile.name}.")
