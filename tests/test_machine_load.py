"""A measurement taken on a busy machine (tracer/hardware/machine_load.py) is not served to later runs: the reading
itself, the kernel choice saved as provisional and measured again, `run --remeasure`, and the roofline's quick
profile left unsaved. The machine's load is injected (a Sampler, LLMTRACE_BUSY_SHARE), never made."""

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
from llmtrace.cli.render_kernels import choice_line
from llmtrace.tracer.core.dtypes import FP32
from llmtrace.tracer.core.errors import BadArgumentError
from llmtrace.tracer.hardware import machine_load
from llmtrace.tracer.hardware.machine_load import BUSY_SHARE_ENV, CpuSample, LoadWatch, others_share, read_sample
from llmtrace.tracer.load import kernel_pick
from llmtrace.tracer.load.kernel_pick import Reuse

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


# ---- the kernel choice -----------------------------------------------------------------------------------------


@pytest.fixture()
def q8_gguf(tiny_quantized: Any) -> Path:
    import gguf

    return tiny_quantized(gguf.GGMLQuantizationType.Q8_0)


def _pick(path: Path, store: Path, share: float | None, counted: list[int],
          reuse: Reuse = Reuse.SETTLED) -> kernel_pick.PickedKernels:
    import torch

    from llmtrace.tracer.checkpoint.resolve import resolve_model

    def timer(*args: Any, **kwargs: Any) -> Any:
        counted.append(1)
        return fixed_timings(*args, **kwargs)

    sampler = (lambda: None) if share is None else readings(share)
    return kernel_pick.pick(resolve_model(str(path), vocabulary=True), torch.device("cpu"), timer=timer,
                            store_path=store, reuse=reuse, sampler=sampler)


def test_a_busy_measurement_is_saved_provisional_and_measured_again(q8_gguf: Path, tmp_path: Path,
                                                                    default_share: None) -> None:
    store, calls = tmp_path / "kernels.json", []
    busy = _pick(q8_gguf, store, 0.48, calls)  # a build on both cores: others took 48%
    assert busy.choice.provisional and busy.choice.others_cpu == pytest.approx(0.48)
    assert busy.saved_to == str(store)
    (entry,) = [e for m in json.loads(store.read_text())["machines"].values() for e in m.values()]
    assert entry["provisional"] is True and entry["others_cpu"] == pytest.approx(0.48)
    again = _pick(q8_gguf, store, 0.02, calls)  # not served: measured again, on a quiet machine this time
    assert len(calls) == 2 and not again.choice.from_store
    assert not again.choice.provisional and again.choice.others_cpu == pytest.approx(0.02)
    served = _pick(q8_gguf, store, 0.02, calls)  # the quiet one replaced it and is served
    assert len(calls) == 2 and served.choice.from_store and not served.choice.provisional


def test_tensor_parallel_ranks_serve_a_provisional_choice(q8_gguf: Path, tmp_path: Path,
                                                         default_share: None) -> None:
    store, calls = tmp_path / "kernels.json", []
    _pick(q8_gguf, store, 0.48, calls)
    rank = _pick(q8_gguf, store, 0.9, calls, reuse=Reuse.ANY)
    assert len(calls) == 1 and rank.choice.from_store and rank.choice.provisional


def test_remeasure_replaces_a_quiet_choice(q8_gguf: Path, tmp_path: Path, default_share: None) -> None:
    store, calls = tmp_path / "kernels.json", []
    _pick(q8_gguf, store, 0.01, calls)
    assert _pick(q8_gguf, store, 0.01, calls).choice.from_store and len(calls) == 1
    fresh = _pick(q8_gguf, store, 0.03, calls, reuse=Reuse.NONE)
    assert len(calls) == 2 and not fresh.choice.from_store and fresh.choice.others_cpu == pytest.approx(0.03)
    assert _saved(q8_gguf, store).others_cpu == pytest.approx(0.03)  # replaced


def test_an_unknown_load_is_not_busy(q8_gguf: Path, tmp_path: Path, default_share: None) -> None:
    """No /proc/stat (another OS): the measurement is taken as it is, saved and served."""
    store, calls = tmp_path / "kernels.json", []
    first = _pick(q8_gguf, store, None, calls)
    assert first.choice.others_cpu is None and not first.choice.provisional
    assert _pick(q8_gguf, store, None, calls).choice.from_store and len(calls) == 1


def _saved(path: Path, store: Path) -> Any:
    import torch

    from llmtrace.tracer.checkpoint.resolve import resolve_model

    return kernel_pick.lookup(resolve_model(str(path), vocabulary=True), torch.device("cpu"), store)


def test_the_kernels_line_says_a_choice_is_provisional(q8_gguf: Path, tmp_path: Path, default_share: None) -> None:
    from dataclasses import replace

    choice = _pick(q8_gguf, tmp_path / "kernels.json", 0.48, []).choice
    line = choice_line(choice, choice.dtype).replace(f"{choice.measured_seconds * 1e3:.1f} ms", "T")
    assert line.startswith("kernels: auto, measured in T while others took 48% of the CPUs (provisional: next run "
                           "re-measures): blocks (stored, fp32 activations), fastest of ")
    served = choice_line(replace(choice, from_store=True), choice.dtype)
    assert served.startswith("kernels: auto, saved measurement while others took 48% of the CPUs (provisional: "
                             "`run --remeasure` replaces it): ")
    quiet = choice_line(replace(choice, provisional=False, others_cpu=0.02), choice.dtype)
    assert quiet.replace(f"{choice.measured_seconds * 1e3:.1f} ms", "T").startswith("kernels: auto, measured in T: "
                                                                                     "blocks")


# ---- `llmtrace run`: the seam through the CLI ----------------------------------------------------------------------


def test_run_measures_again_after_a_busy_first_run_and_on_remeasure(q8_gguf: Path, tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch,
                                                                   default_share: None) -> None:
    calls: list[int] = []

    def timer(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return fixed_timings(*args, **kwargs)

    monkeypatch.setattr(kernel_pick, "time_kernels", timer)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    args = ["run", "sky", "--model", str(q8_gguf), "--max-new-tokens", "2", "--no-roofline"]

    def run(*extra: str) -> str:
        result = runner.invoke(app, [*args, *extra])
        assert result.exit_code == 0, result.output
        return re.sub(r"measured in [0-9.]+ ms", "measured in T", " ".join(result.output.split()))

    monkeypatch.setattr(kernel_pick, "read_sample", readings(0.48))
    assert "measured in T while others took 48% of the CPUs (provisional: next run re-measures)" in run()
    monkeypatch.setattr(kernel_pick, "read_sample", readings(0.02))
    out = run()  # not served: measured again, quietly
    assert len(calls) == 2 and "kernels: auto, measured in T: " in out and "provisional" not in out
    assert "kernels: auto, saved measurement: " in run() and len(calls) == 2
    assert "kernels: auto, measured in T: " in run("--remeasure") and len(calls) == 3


def test_remeasure_refuses_a_dry_run() -> None:
    result = runner.invoke(app, ["run", "--model", "llama-7b", "--dry-run", "--remeasure"])
    assert result.exit_code == 2
    assert "--remeasure measures this machine for a real run on one device; drop --dry-run" in result.output


def test_run_help_names_remeasure() -> None:
    result = runner.invoke(app, ["run", "--help"])
    text = " ".join(result.output.split())
    assert result.exit_code == 0 and "--remeasure Measure this machine's products for this model again" in text
    assert "and replace the saved choice" in text


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
