"""`llmtrace hardware`: list the hardware profiles; `--measure` measures this machine (the only torch path here)."""

from __future__ import annotations

from dataclasses import asdict
from enum import Enum
from typing import TYPE_CHECKING, Annotated

import typer

from llmtrace.cli.app import app
from llmtrace.cli.command import command_class
from llmtrace.cli.errors import run_guarded
from llmtrace.cli.options import JsonOption

if TYPE_CHECKING:
    from llmtrace.tracer.core.dtypes import DType

# Library and rich imports live inside the command bodies: importing llmtrace.cli.app (every command) stays cheap.


class DeviceChoice(str, Enum):
    cpu = "cpu"
    cuda = "cuda"


def _parse_dtypes(text: str) -> tuple[DType, ...]:
    """Parsed before torch is imported, so a typo fails in a blink."""
    from llmtrace.tracer.core.dtypes import get_dtype
    from llmtrace.tracer.core.errors import BadArgumentError
    from llmtrace.tracer.hardware.profiles import MEASURABLE_DTYPES

    names = [part for part in text.split(",") if part.strip()]
    if not names:
        raise BadArgumentError("--dtypes is empty; give a comma-separated list such as fp32,bf16")
    return tuple(get_dtype(name, MEASURABLE_DTYPES, refusal="cannot measure") for name in names)


@app.command("hardware", cls=command_class())
def hardware(
    measure: Annotated[bool, typer.Option("--measure", help="Measure this machine's GEMM FLOP/s and memory "
                                          "bandwidth with torch and save them as the profile 'this-machine' (not "
                                          "when other processes kept the CPUs busy meanwhile).")] = False,
    device: Annotated[DeviceChoice, typer.Option(help="With --measure: the device to measure.")] = DeviceChoice.cpu,
    dtypes: Annotated[str, typer.Option(metavar="<d,d,...>", help="With --measure: GEMM dtypes to measure, comma-separated "
                                        "(fp32, bf16, fp16; tf32 on cuda).")] = "fp32,bf16",
    repeats: Annotated[int, typer.Option(help="With --measure: timed runs per figure (the fastest sets the ceiling).")] = 5,
    max_n: Annotated[int, typer.Option("--max-n", help="With --measure: largest GEMM size n to try "
                                       "(0 = 4096 on cpu, 16384 on cuda).")] = 0,
    copy_mib: Annotated[int, typer.Option("--copy-mib", help="With --measure: copy buffer size in MiB "
                                          "(0 = 256 on cpu, 2048 on cuda).")] = 0,
    json_out: JsonOption = False,
) -> None:
    """List hardware profiles (peak FLOP/s per dtype, bandwidth, memory, ridge point, interconnect).

    \b
    Examples:
      llmtrace hardware
      llmtrace hardware --measure   # adds 'this-machine' (takes a few seconds)
      llmtrace hardware --json
    """

    def body() -> None:
        from llmtrace.cli.console import stdout_console
        from llmtrace.cli.render_hardware import render_profiles
        from llmtrace.tracer.hardware.profiles import all_profiles
        from llmtrace.tracer.hardware.store import load_measured_profiles, store_path

        if measure:
            _measure(device.value, _parse_dtypes(dtypes), repeats, max_n, copy_mib, json_out)
            return
        measured = load_measured_profiles()
        profiles = all_profiles(measured)
        if json_out:
            from llmtrace.cli.json_output import print_json
            from llmtrace.tracer.hardware.listing import hardware_listing

            print_json(hardware_listing(profiles, str(store_path())))
            return
        render_profiles(stdout_console(), profiles, str(store_path()), has_measured=bool(measured))

    run_guarded(body)


def _measure(device: str, dtypes: tuple[DType, ...], repeats: int, max_n: int, copy_mib: int, json_out: bool) -> None:
    from llmtrace.cli.console import stdout_console
    from llmtrace.cli.render_hardware import render_measurement
    from llmtrace.tracer.core.errors import BadArgumentError
    from llmtrace.tracer.hardware.profiles import THIS_MACHINE
    from llmtrace.tracer.hardware.store import save_measured_profile

    if max_n < 0 or copy_mib < 0:
        raise BadArgumentError("--max-n and --copy-mib must be >= 0 (0 = the default size)")
    # torch only here: listing profiles and every analytical command stay torch-free.
    from llmtrace.tracer.hardware.listing import ProfileRow
    from llmtrace.tracer.hardware.measure import (
        MEASURE_SCHEMA,
        MeasureReport,
        busy_note,
        measure_machine,
        profile_from_measurement,
    )

    err = stdout_console(stderr=True)
    with err.status("measuring…") as status:
        result = measure_machine(
            dtypes=dtypes,
            device=device,
            repeats=repeats,
            gemm_max_n=max_n or None,
            copy_bytes=copy_mib * 2**20 if copy_mib else None,
            progress=lambda what: status.update(f"measuring {what}…"),
        )
    profile = profile_from_measurement(result, THIS_MACHINE)
    # a measurement of a busy machine is not kept: saved, it would judge every later run (roofline, run's summary)
    not_saved = busy_note(result)
    saved = None if not_saved else str(save_measured_profile(profile, asdict(result)))
    if json_out:
        from llmtrace.cli.json_output import print_json

        print_json(MeasureReport(MEASURE_SCHEMA, ProfileRow.of(profile), result, saved, not_saved))
        return
    render_measurement(stdout_console(), result, profile, saved, not_saved)
