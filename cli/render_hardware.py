"""Rich rendering of hardware profiles and of a `--measure` run. Reads records only."""

from __future__ import annotations

from typing import TYPE_CHECKING

from rich.console import Console, Group
from rich.table import Table
from rich.text import Text

from llmtrace.cli import formatting as fmt
from llmtrace.cli.tables import report_table
from llmtrace.tracer.hardware.machine_load import is_busy
from llmtrace.tracer.hardware.profiles import PEAK_DTYPES, HardwareProfile

if TYPE_CHECKING:  # measure.py imports torch; listing the profiles must not
    from llmtrace.tracer.hardware.measure import MachineMeasurement


def _tflops(value: float | None) -> str:
    """A peak in TFLOP/s, three significant figures (0.300 for a CPU, 1,307 for an MI300X)."""
    return "—" if value is None else fmt.number_in(value, "T")


def _ridge(profile: HardwareProfile) -> str:
    ridge = profile.inference_ridge()
    return "—" if ridge is None else fmt.figures(ridge[1])


def profiles_table(profiles: list[HardwareProfile]) -> Table:
    table = report_table(gap=1)  # twelve columns in 80
    table.add_column("name", style="bold", no_wrap=True)
    for dtype in PEAK_DTYPES:
        table.add_column(dtype, justify="right", no_wrap=True)
    table.add_column("TB/s", justify="right", no_wrap=True)
    table.add_column("GiB", justify="right", no_wrap=True)
    table.add_column("ridge", justify="right", no_wrap=True)
    table.add_column("link GB/s", justify="left", no_wrap=True)
    for p in profiles:
        link = "none" if p.interconnect_bandwidth == 0 else f"{p.interconnect} {fmt.number_in(p.interconnect_bandwidth, 'G')}"
        table.add_row(
            p.name,
            *(_tflops(getattr(p, d)) for d in PEAK_DTYPES),
            fmt.number_in(p.memory_bandwidth, "T"),
            fmt.number_in(p.memory_bytes, "GiB"),
            _ridge(p),
            link,
        )
    return table


def sources_table(profiles: list[HardwareProfile]) -> Table:
    table = report_table()
    table.add_column("name", style="bold", no_wrap=True)
    table.add_column("device")
    table.add_column("source")
    for p in profiles:
        table.add_row(p.name, p.label, p.source)
    return table


def render_profiles(console: Console, profiles: list[HardwareProfile], store: str, has_measured: bool) -> None:
    where = (f"Measured profiles are read from {store}." if has_measured else
             f"No measured profile yet: `llmtrace hardware --measure` adds 'this-machine' ({store}).")
    console.print(Group(
        Text("Hardware profiles (dense peaks)", style="bold"),
        profiles_table(profiles),
        Text(
            "Peaks in TFLOP/s (int8: TOP/s), the vendors' dense figures: 2:4 sparsity doubles them on paper and "
            "inference kernels do not use it. Memory bandwidth in TB/s (10¹² bytes/s), capacity in GiB (2³⁰ bytes). "
            "ridge = 16-bit peak FLOP/s (bf16, else fp16, else fp32) ÷ bandwidth, in FLOPs per byte: a phase doing "
            "fewer FLOPs per byte it moves is memory-bound. Interconnect: per device, both directions together, as "
            "datasheets print it.\n"
        ),
        sources_table(profiles),
        Text("\n" + where),
    ))


def render_measurement(console: Console, m: "MachineMeasurement", profile: HardwareProfile, saved_to: str | None,
                       not_saved: str = "") -> None:
    """`not_saved`: why the measurement was not saved (a busy machine), when it was not."""
    table = report_table()
    table.add_column("ceiling")
    table.add_column("how")
    table.add_column("runs", justify="right", no_wrap=True)
    table.add_column("best run", justify="right", no_wrap=True)
    table.add_column("fastest … slowest", justify="right")
    for g in m.gemms:
        table.add_row(
            f"{g.dtype} GEMM", f"{g.n}×{g.n} @ {g.n}×{g.n} ({fmt.flops(g.flops_per_run)})", str(len(g.seconds)),
            fmt.flops_per_s(g.flops_per_s),
            f"{fmt.duration_s(g.best_seconds)} … {fmt.duration_s(max(g.seconds))}",
        )
    c = m.copy
    table.add_row(
        "memory bandwidth",
        f"copy {fmt.bytes_both(c.buffer_bytes)} (read + write = {fmt.nbytes(c.bytes_per_run)})",
        str(len(c.seconds)),
        fmt.bytes_per_s(c.bytes_per_s),
        f"{fmt.duration_s(c.best_seconds)} … {fmt.duration_s(max(c.seconds))}",
    )
    ridges = ", ".join(f"{d} {fmt.intensity(profile.ridge_point(d))}" for d in PEAK_DTYPES if profile.has_peak(d))
    kept = (f"Saved as profile '{profile.name}' in {saved_to}; use it with --hardware {profile.name}."
            if saved_to is not None else f"Not saved: {not_saved}.")
    lines = [Text(f"Measured on {m.device_name}", style="bold"), table,
             Text(f"Ridge point: {ridges}. Memory: {fmt.gib(profile.memory_bytes)}.\n{kept}")]
    if saved_to is not None and is_busy(m.others_cpu):  # kept by LLMTRACE_BUSY_SHARE: say what it may be worth
        lines.append(Text(f"Warning: other processes took {m.others_cpu:.0%} of the CPUs meanwhile, so these ceilings "
                          "are likely low; measure again when the machine is quiet.", style="yellow"))
    console.print(Group(*lines))
