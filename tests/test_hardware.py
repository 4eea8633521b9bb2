"""Hardware profiles (datasheet figures), the measured-profile store, and the torch measurement of ceilings."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from llmtrace.tracer.core.dtypes import BF16, FP32, INT8, TF32
from llmtrace.tracer.core.errors import BadArgumentError, HardwareError
from llmtrace.tracer.hardware.profiles import PEAK_DTYPES, PROFILES, THIS_MACHINE, all_profiles, get_profile
from llmtrace.tracer.hardware.store import (
    load_measured_profiles,
    load_measurement_details,
    resolve_hardware,
    save_measured_profile,
    store_path,
)

REPO = Path(__file__).resolve().parent.parent
GiB = 2**30


# ---- datasheet profiles -------------------------------------------------------------------------------------


def test_every_issue_profile_is_present() -> None:
    wanted = {"a100-40gb", "a100-80gb", "h100-sxm", "h100-pcie", "h200", "l4", "l40s", "rtx-3090", "rtx-4090",
              "mi300x", "m2-max", "m3-max"}
    assert wanted <= set(PROFILES)


def test_a100_80gb_is_the_datasheet_dense_figures() -> None:
    a100 = get_profile("a100-80gb")
    assert a100.fp16 == 312e12 and a100.bf16 == 312e12  # dense; 624 is the sparsity figure
    assert a100.tf32 == 156e12 and a100.fp32 == 19.5e12 and a100.int8 == 624e12
    assert a100.fp8 is None  # Ampere has no fp8 tensor cores
    assert a100.memory_bandwidth == 2.039e12
    assert a100.memory_bytes == 80 * GiB
    assert a100.ridge_point("fp16") == pytest.approx(312 / 2.039, rel=1e-12)  # 153.0 FLOPs/byte
    assert a100.link_bandwidth_one_way == 300e9  # NVLink 600 GB/s is both directions together


def test_hopper_dense_is_half_the_sparsity_figure() -> None:
    # H100 SXM datasheet: BF16 1,979 TFLOPS*, FP8 3,958 TFLOPS* (* with sparsity); H200 has the same compute.
    for name in ("h100-sxm", "h200"):
        p = get_profile(name)
        assert p.bf16 == 1979e12 / 2 and p.fp8 == 3958e12 / 2
    assert get_profile("h200").memory_bandwidth == 4.8e12
    assert get_profile("h100-pcie").bf16 == 1513e12 / 2


def test_every_profile_is_consistent() -> None:
    for p in all_profiles():
        assert p.memory_bandwidth > 0 and p.memory_bytes > 0
        assert p.fp32 is not None and p.fp32 > 0
        peaks = [getattr(p, d) for d in PEAK_DTYPES if getattr(p, d) is not None]
        assert all(v > 0 for v in peaks)
        # 16-bit never slower than fp32, fp8 never slower than 16-bit
        assert p.fp16 >= p.fp32 and p.bf16 >= p.fp32
        if p.fp8 is not None:
            assert p.fp8 >= p.fp16
        assert (p.interconnect == "none") == (p.interconnect_bandwidth == 0)
        assert p.source


def test_missing_peak_is_one_clear_error() -> None:
    with pytest.raises(HardwareError, match=r"a100-80gb has no fp8 peak.*fp32, tf32, bf16, fp16, int8"):
        get_profile("a100-80gb").peak("fp8")
    with pytest.raises(HardwareError, match="no peak FLOP/s kind 'int4'"):
        get_profile("a100-80gb").peak("int4")


def test_names_are_normalised_and_aliased() -> None:
    assert get_profile("A100").name == "a100-80gb"
    assert get_profile("RTX 4090").name == "rtx-4090"
    assert get_profile("h100").name == "h100-sxm"


def test_unknown_hardware_suggests_the_nearest() -> None:
    with pytest.raises(HardwareError, match=r"unknown hardware 'h10'.*did you mean h100-sxm"):
        get_profile("h10")
    with pytest.raises(HardwareError, match=r"did you mean .*a100-80gb"):
        get_profile("a100-80")


def test_this_machine_before_measuring_says_how(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    with pytest.raises(HardwareError, match="llmtrace hardware --measure"):
        resolve_hardware(THIS_MACHINE)


# ---- the store ------------------------------------------------------------------------------------------------


def test_store_lives_in_xdg_config_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    assert store_path() == tmp_path / "llmtrace" / "hardware.json"
    monkeypatch.delenv("XDG_CONFIG_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert store_path() == tmp_path / "home" / ".config" / "llmtrace" / "hardware.json"


def test_store_round_trip(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    profile = replace(get_profile("l4"), name=THIS_MACHINE, measured=True, fp8=None)
    saved = save_measured_profile(profile, {"note": "test"})
    assert saved == tmp_path / "llmtrace" / "hardware.json"
    assert load_measured_profiles() == {THIS_MACHINE: profile}
    assert resolve_hardware("this-machine") == profile
    assert load_measurement_details(THIS_MACHINE) == {"note": "test"}
    # another profile is kept beside it
    save_measured_profile(replace(profile, name="other-box"), {})
    assert set(load_measured_profiles()) == {THIS_MACHINE, "other-box"}


@pytest.mark.parametrize("content", ["{not json", "[]", '{"profiles": {"this-machine": {"name": 1}}}',
                                     '{"profiles": {}, "measurements": []}'])
def test_broken_store_is_one_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, content: str) -> None:
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    store_path().parent.mkdir(parents=True)
    store_path().write_text(content)
    with pytest.raises(HardwareError, match="hardware.json.*--measure"):
        load_measured_profiles()


def test_hardware_modules_import_no_torch() -> None:
    code = ("import sys; import llmtrace.tracer.hardware.profiles, llmtrace.tracer.hardware.store, llmtrace.tracer.roofline.analysis, llmtrace.tracer.roofline.compare; "
            "print('torch' in sys.modules, 'numpy' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"]


# ---- measurement (tiny sizes: a fraction of a second) ---------------------------------------------------------


def test_measure_tiny_counts_flops_and_bytes_like_torch() -> None:
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    from llmtrace.tracer.hardware.measure import measure_machine, profile_from_measurement

    m = measure_machine(dtypes=(FP32, BF16), repeats=3, gemm_target_seconds=0.0, gemm_max_n=128,
                        copy_bytes=2**20)
    assert [g.dtype for g in m.gemms] == ["fp32", "bf16"]
    for g in m.gemms:
        assert g.n == 128 and len(g.seconds) == 3
        a = torch.zeros(g.n, g.n)
        with FlopCounterMode(display=False) as counter:
            a @ a
        assert g.flops_per_run == counter.get_total_flops()  # 2 n^3, as torch counts it
        assert g.median_seconds == sorted(g.seconds)[1]
        assert g.best_seconds == min(g.seconds)  # a ceiling: the fastest run, not the median
        assert g.flops_per_s == pytest.approx(g.flops_per_run / g.best_seconds)
    src = torch.empty(m.copy.buffer_bytes // 4, dtype=torch.float32)
    assert m.copy.bytes_per_run == 2 * src.nbytes  # read src + write dst
    assert m.copy.bytes_per_s == pytest.approx(m.copy.bytes_per_run / m.copy.best_seconds)
    assert m.memory_bytes > 2**30

    p = profile_from_measurement(m)
    assert p.name == THIS_MACHINE and p.measured
    assert p.fp32 == m.gemms[0].flops_per_s and p.bf16 == m.gemms[1].flops_per_s
    assert p.fp16 is None and p.fp8 is None and p.interconnect_bandwidth == 0
    assert p.memory_bandwidth == m.copy.bytes_per_s
    with pytest.raises(HardwareError, match="--measure --dtypes fp16"):
        p.peak("fp16")


def test_measure_rejects_bad_requests() -> None:
    from llmtrace.tracer.hardware.measure import measure_machine

    with pytest.raises(BadArgumentError, match="cannot measure 'int8'"):
        measure_machine(dtypes=(INT8,), gemm_max_n=128, copy_bytes=2**20)
    with pytest.raises(BadArgumentError, match="tf32 is a CUDA"):
        measure_machine(dtypes=(TF32,), gemm_max_n=128, copy_bytes=2**20)
    with pytest.raises(BadArgumentError, match="unknown device 'tpu'"):
        measure_machine(device="tpu")


def test_saved_measurement_json_is_plain(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from dataclasses import asdict

    from llmtrace.tracer.hardware.measure import measure_machine, profile_from_measurement

    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    m = measure_machine(dtypes=(FP32,), repeats=1, gemm_target_seconds=0.0, gemm_max_n=128, copy_bytes=2**20)
    save_measured_profile(profile_from_measurement(m), asdict(m))
    data = json.loads(store_path().read_text())
    assert data["measurements"][THIS_MACHINE]["gemms"][0]["n"] == 128
    assert resolve_hardware(THIS_MACHINE).fp32 == m.gemms[0].flops_per_s
