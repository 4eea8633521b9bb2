"""A measurement taken on a busy machine (tracer/hardware/machine_load.py) is said or not served to later runs: the
reading itself, tune's note, and the roofline's quick profile left unsaved. The machine's load is injected (a
Sampler, LLMTRACE_BUSY_SHARE), never made."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any, Callable

import pytest
from conftest import fixed_timings
from typer.testing import CliRunner

from llmtrace.cli.app import app
from llmtrace.tracer.core.dtypes import FP32
from llmtrace.tracer.core.errors import BadArgumentError
from llmtrace.tracer.hardware import machine_load
from llmtrace.tracer.hardware.machine_load import BUSY_SHARE_ENV, CpuSample, LoadWatch, others_share, read_sample
from llmtrace.tracer.load import kernel_pick

runner = CliRunner()


def readings(share: float) -> Callable[[], CpuSample]:
    """A sampler whose readings, taken in pairs around a measurement, say other processes took `share` of two CPUs
    over one second (100 ticks a second: 200 ticks in all) while this process used one CPU-second."""
    pair = [CpuSample(busy_ticks=5000, total_ticks=9000, own_seconds=3.0, ticks_per_second=100.0, cpus=2),
            CpuSample(busy_ticks=5000 + 100 + round(share * 200), total_ticks=9200, own_seconds=4.0,
                      ticks_per_second=100.0, cpus=2)]
    taken = [0]

    def sample() -> CpuSample:
        taken[0] += 1
        return pair[(taken[0] - 1) % 2]

    return sample


@pytest.fixture()
def default_share(monkeypatch: pytest.MonkeyPatch) -> None:
    """The suite says nothing is busy (conftest's LLMTRACE_BUSY_SHARE=1); these tests judge with the default."""
    monkeypatch.delenv(BUSY_SHARE_ENV)


# ---- the reading -----------------------------------------------------------------------------------------------


def test_others_share_is_the_busy_ticks_this_process_did_not_use() -> None:
    before = CpuSample(busy_ticks=1000, total_ticks=4000, own_seconds=2.0, ticks_per_second=100.0, cpus=2)
    after = CpuSample(busy_ticks=1290, total_ticks=4300, own_seconds=3.45, ticks_per_second=100.0, cpus=2)
    # 290 busy ticks of 300, 145 of them this process's: the others took 145 / 300
    assert others_share(before, after) == pytest.approx(145 / 300)
    quiet = CpuSample(busy_ticks=1295, total_ticks=4300, own_seconds=5.0, ticks_per_second=100.0, cpus=2)
    assert others_share(before, quiet) == 0.0  # this process alone (its time rounds above the ticks): never below 0
    assert others_share(before, None) is None and others_share(None, after) is None
    short = CpuSample(busy_ticks=1030, total_ticks=4030, own_seconds=2.0, ticks_per_second=100.0, cpus=2)
    assert others_share(before, short) is None  # 15 ticks a CPU: too short to say


def test_read_sample_sums_the_cpus_this_process_may_use(tmp_path: Path) -> None:
    allowed = sorted(os.sched_getaffinity(0))
    lines = ["cpu  1 1 1 1 1 1 1 1 0 0"]  # the aggregate line: ignored
    # user nice system idle iowait irq softirq steal guest guest_nice: busy 10+0+5+2+1+4 = 22, idle 60+3 = 63
    lines += [f"cpu{n} 10 0 5 60 3 2 1 4 7 0" for n in allowed]
    lines += ["cpu9999 500 0 0 0 0 0 0 0 0 0", "intr 12345 0 0", "ctxt 99"]  # a CPU outside the mask: ignored
    stat = tmp_path / "stat"
    stat.write_text("\n".join(lines) + "\n")
    sample = read_sample(str(stat))
    assert sample is not None
    assert (sample.busy_ticks, sample.total_ticks, sample.cpus) == (22 * len(allowed), 85 * len(allowed), len(allowed))
    assert sample.ticks_per_second == os.sysconf("SC_CLK_TCK") and sample.own_seconds > 0
    assert read_sample(str(tmp_path / "absent")) is None


def test_the_busy_share_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(BUSY_SHARE_ENV)
    assert machine_load.busy_share() == 0.10
    assert machine_load.is_busy(0.11) and not machine_load.is_busy(0.10) and not machine_load.is_busy(None)
    monkeypatch.setenv(BUSY_SHARE_ENV, "0.5")
    assert not machine_load.is_busy(0.48) and machine_load.is_busy(0.51)
    monkeypatch.setenv(BUSY_SHARE_ENV, "lots")
    with pytest.raises(BadArgumentError, match=f"{BUSY_SHARE_ENV}='lots'.*from 0 to 1"):
        machine_load.busy_share()


def test_load_watch_reads_before_and_after() -> None:
    with LoadWatch(readings(0.48)) as watch:
        pass
    assert watch.share == pytest.approx(0.48)


# ---- tune ------------------------------------------------------------------------------------------------------


@pytest.fixture()
def q8_gguf(tiny_quantized: Any) -> Path:
    import gguf

    return tiny_quantized(gguf.GGMLQuantizationType.Q8_0)


def test_tune_on_a_busy_machine_saves_its_pick_with_a_note(q8_gguf: Path, tmp_path: Path,
                                                           default_share: None) -> None:
    """tune is asked for by the user, who reads its note: a busy measurement is saved (the user may tune again),
    with the share it was taken under; a quiet or unknown one without a note."""
    import torch

    from llmtrace.tracer.checkpoint.resolve import resolve_model

    resolved = resolve_model(str(q8_gguf), vocabulary=True)
    store = tmp_path / "kernels.json"
    busy = kernel_pick.tune(resolved, torch.device("cpu"), timer=fixed_timings, store_path=store,
                            sampler=readings(0.48))
    assert busy.choice.others_cpu == pytest.approx(0.48) and busy.saved_to == str(store)
    assert busy.note == ("other processes took 48% of the CPUs while tune measured: the figures may be off; tune "
                         "again on a quieter machine")
    quiet = kernel_pick.tune(resolved, torch.device("cpu"), timer=fixed_timings, store_path=store,
                             sampler=readings(0.02))
    assert quiet.note == "" and quiet.choice.others_cpu == pytest.approx(0.02)
    unknown = kernel_pick.tune(resolved, torch.device("cpu"), timer=fixed_timings, store_path=store,
                               sampler=lambda: None)
    assert unknown.note == "" and unknown.choice.others_cpu is None


def test_run_help_names_tune_and_no_remeasure() -> None:
    result = runner.invoke(app, ["run", "--help"], terminal_width=200)
    text = " ".join(re.sub(r"\x1b\[[0-9;]*m", "", result.output).split())
    assert "--tune" in text and "--remeasure" not in text
    tune = runner.invoke(app, ["tune", "--help"], terminal_width=200)
    assert tune.exit_code == 0 and "--weights tuned" in " ".join(tune.output.split())


# ---- the roofline's quick profile ------------------------------------------------------------------------------


@pytest.fixture()
def tiny_quick(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    from llmtrace.tracer.hardware import measure as hardware_measure

    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    monkeypatch.setitem(hardware_measure.QUICK, "cpu",
                        dict(repeats=1, gemm_target_seconds=0.0, gemm_max_n=128, copy_bytes=2**20))
    return tmp_path / "llmtrace" / "hardware.json"


def test_a_busy_quick_profile_judges_nothing_and_is_not_saved(tiny_quick: Path, default_share: None) -> None:
    """Issue 28: a run judged by ceilings measured on a busy machine reached "129% of the bound"; such a measurement
    now gives no bound at all (it used to serve the run that made it), and the note says how to measure."""
    from llmtrace.tracer.run.roofline_check import NoProfileForDevice, this_machine_profile

    with pytest.raises(NoProfileForDevice) as busy:
        this_machine_profile("cpu", FP32, sampler=readings(0.48))
    assert str(busy.value) == ("no saved profile, and other processes took 48% of the CPUs while this run measured "
                               "the machine, so no bound to judge it by; run `llmtrace hardware --measure` when the "
                               "machine is quiet")
    assert not tiny_quick.exists()
    quiet = this_machine_profile("cpu", FP32, sampler=readings(0.02))
    assert quiet.saved_to == str(tiny_quick) and quiet.not_saved == ""
    saved = json.loads(tiny_quick.read_text())["measurements"]["this-machine"]
    assert saved["others_cpu"] == pytest.approx(0.02)
    assert this_machine_profile("cpu", FP32, sampler=readings(0.9)).measured is None  # served from the file


def test_hardware_measure_does_not_save_a_busy_measurement(default_share: None, tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 28: saved, a busy measurement would judge every later run (roofline, run's summary); it is shown, not
    saved (it used to be saved with a warning), and a saved one from before that is refused as a judge."""
    from rich.console import Console

    from llmtrace.cli.render_hardware import render_measurement
    from llmtrace.tracer.hardware import measure as hardware_measure
    from llmtrace.tracer.hardware.measure import busy_note, measure_machine, profile_from_measurement
    from llmtrace.tracer.hardware.store import save_measured_profile

    busy = measure_machine(repeats=1, gemm_target_seconds=0.0, gemm_max_n=128, copy_bytes=2**20,
                           sampler=readings(0.48))
    assert busy.others_cpu == pytest.approx(0.48)
    note = busy_note(busy)
    assert note.startswith("other processes took 48% of the CPUs meanwhile, so these ceilings are likely low")
    console = Console(record=True, width=100)
    render_measurement(console, busy, profile_from_measurement(busy), None, note)
    text = " ".join(console.export_text().split())
    assert f"Not saved: {note}." in text and "Saved as" not in text
    quiet = measure_machine(repeats=1, gemm_target_seconds=0.0, gemm_max_n=128, copy_bytes=2**20,
                            sampler=readings(0.02))
    assert busy_note(quiet) == ""
    console = Console(record=True, width=100)
    render_measurement(console, quiet, profile_from_measurement(quiet), "/tmp/hardware.json")
    text = console.export_text()
    assert "Warning" not in text and "Saved as profile 'this-machine'" in text

    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))  # the CLI: not saved, one line why
    real = hardware_measure.measure_machine
    monkeypatch.setattr(hardware_measure, "measure_machine",
                        lambda **kwargs: real(**{**kwargs, "sampler": readings(0.48)}))
    result = runner.invoke(app, ["hardware", "--measure", "--dtypes", "fp32", "--repeats", "1", "--max-n", "128",
                                 "--copy-mib", "1", "--json"])
    assert result.exit_code == 0, result.output
    document = json.loads(result.stdout)
    assert document["saved_to"] is None and document["not_saved"] == note
    assert not (tmp_path / "llmtrace" / "hardware.json").exists()
    save_measured_profile(profile_from_measurement(busy), {"device": "cpu", "others_cpu": 0.48})  # an older save
    refused = runner.invoke(app, ["roofline", "--hardware", "this-machine", "--model", "llama-7b"])
    assert refused.exit_code == 2 and len(refused.stderr.strip().splitlines()) == 1
    assert "the saved 'this-machine' profile was measured while other processes took 48% of the CPUs" in \
        refused.stderr
