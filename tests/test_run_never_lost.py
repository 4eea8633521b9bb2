"""A finished run is never thrown away (issue 10): whatever the optional roofline step meets (an unwritable home,
a malformed hardware.json), a signal, a closed pipe or a failing write, the trace files are written whole."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import pytest
from typer.testing import CliRunner

from llmtrace.cli.app import app
from llmtrace.tracer.hardware.profiles import THIS_MACHINE, HardwareProfile
from llmtrace.tracer.trace.run_trace import Trace

runner = CliRunner()
REPO = Path(__file__).resolve().parent.parent

GOOD_PROFILE = dict(
    name=THIS_MACHINE, label="test", memory_bandwidth=30e9, memory_bytes=2**34, fp32=120e9, tf32=None, bf16=None,
    fp16=None, fp8=None, int8=None, interconnect="none", interconnect_bandwidth=0.0, source="test", measured=True)


@pytest.fixture(autouse=True)
def _tiny_measurement(monkeypatch: pytest.MonkeyPatch) -> None:
    from llmtrace.tracer.hardware import measure as hardware_measure

    monkeypatch.setitem(hardware_measure.QUICK, "cpu",
                        dict(repeats=1, gemm_target_seconds=0.0, gemm_max_n=128, copy_bytes=2**20))


def _run_with_outputs(tiny_llama_dir: Path, tmp_path: Path, *extra: str) -> tuple[object, Path, Path]:
    out, chrome = tmp_path / "t.json", tmp_path / "c.json"
    result = runner.invoke(app, ["run", "sky", "--model", str(tiny_llama_dir), "--max-new-tokens", "2", "--dtype",
                                 "fp32", "--json", str(out), "--chrome-trace", str(chrome), *extra])
    return result, out, chrome


def _assert_kept(result: object, out: Path, chrome: Path) -> None:
    assert result.exit_code == 0, result.output  # type: ignore[attr-defined]
    assert "Traceback" not in result.output and "llmtrace: internal error" not in result.output  # type: ignore[attr-defined]
    assert len(Trace.from_json(out.read_text(encoding="utf-8")).generated_ids) == 2
    assert json.loads(chrome.read_text(encoding="utf-8"))["traceEvents"]
    assert "8 · Summary" in result.output  # type: ignore[attr-defined]


def test_unwritable_home_keeps_the_run_and_still_gives_the_bound(tiny_llama_dir: Path, tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    # Tests may run as root, where a chmod 555 folder stays writable: a HOME that is a file refuses for everyone.
    home = tmp_path / "home-is-a-file"
    home.write_text("")
    monkeypatch.delenv("XDG_CONFIG_HOME", raising=False)
    monkeypatch.setenv("HOME", str(home))
    result, out, chrome = _run_with_outputs(tiny_llama_dir, tmp_path)
    _assert_kept(result, out, chrome)
    warning = " ".join(result.stderr.split())  # on stderr, wrapped at the terminal's width
    assert warning.startswith("warning: roofline:") and "measured this machine" in warning and "not saved" in warning and "XDG_CONFIG_HOME" in warning
    assert "this-machine fp32 peak" in result.output  # the measurement still serves this run


def test_a_failing_save_is_a_warning(tiny_llama_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A full or read-only file system: the write itself raises (as EROFS / ENOSPC would)."""
    from llmtrace.tracer.core import json_store  # hardware.json is saved through it

    def refuse(path: object, text: str) -> None:
        raise OSError(30, "Read-only file system")

    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    monkeypatch.setattr(json_store, "write_atomic", refuse)
    result, out, chrome = _run_with_outputs(tiny_llama_dir, tmp_path)
    _assert_kept(result, out, chrome)
    warning = " ".join(result.stderr.split())  # on stderr, wrapped at the terminal's width
    assert "not saved: cannot save the profile" in warning and "Read-only file system" in warning


def _nested(depth: int) -> str:
    return "[" * depth + "]" * depth


@pytest.mark.parametrize("content, field", [
    (json.dumps({"profiles": {THIS_MACHINE: {**GOOD_PROFILE, "fp32": "fast"}}}), "'fp32' 'fast'"),
    (json.dumps({"profiles": {THIS_MACHINE: {**GOOD_PROFILE, "memory_bandwidth": 0}}}), "'memory_bandwidth' 0"),
    (json.dumps({"profiles": {THIS_MACHINE: {**GOOD_PROFILE, "memory_bytes": "16G"}}}), "'memory_bytes' '16G'"),
    (json.dumps({"profiles": {THIS_MACHINE: {**GOOD_PROFILE, "fp32": -1.0}}}), "'fp32' -1.0"),
    (json.dumps({"profiles": {THIS_MACHINE: {**GOOD_PROFILE, "memory_bandwidth": float("nan")}}}), "nan"),
    (json.dumps({"profiles": {THIS_MACHINE: {**GOOD_PROFILE, "label": ["x"]}}}), "non-text 'label'"),
    ('{"profiles": ' + _nested(100_000) + "}", "nested too deeply"),
    ("{not json", "not valid JSON"),
])
def test_malformed_hardware_json_is_a_note_not_a_lost_run(content: str, field: str, tiny_llama_dir: Path,
                                                          tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    (tmp_path / "config" / "llmtrace").mkdir(parents=True)
    (tmp_path / "config" / "llmtrace" / "hardware.json").write_text(content, encoding="utf-8")
    result, out, chrome = _run_with_outputs(tiny_llama_dir, tmp_path)
    _assert_kept(result, out, chrome)
    flat = re.sub(r"[\s│]+", " ", result.output)  # the note wraps inside the summary's panel
    assert "roofline: skipped:" in flat and field in flat


def test_malformed_hardware_json_is_one_line_for_the_commands_that_need_it(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    (tmp_path / "llmtrace").mkdir()
    (tmp_path / "llmtrace" / "hardware.json").write_text(
        json.dumps({"profiles": {THIS_MACHINE: {**GOOD_PROFILE, "memory_bandwidth": 0}}}))
    for args in (["hardware"], ["roofline", "--hardware", "this-machine"]):
        result = runner.invoke(app, args)
        assert result.exit_code == 2, result.output
        assert result.stderr.count("\n") == 1 and "'memory_bandwidth' 0" in result.stderr


def test_a_failure_in_the_optional_roofline_keeps_the_run(tiny_llama_dir: Path, tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    from llmtrace.tracer.run import roofline_check

    def broken(*args: object, **kwargs: object) -> None:
        raise ZeroDivisionError("float division by zero")

    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    monkeypatch.setattr(roofline_check, "compare_with_measured", broken)
    result, out, chrome = _run_with_outputs(tiny_llama_dir, tmp_path)
    _assert_kept(result, out, chrome)
    assert "roofline: skipped after an internal error (ZeroDivisionError" in result.output


# ---- outputs ---------------------------------------------------------------------------------------------------


def test_two_outputs_to_one_path_are_refused_before_the_run(tiny_llama_dir: Path, tmp_path: Path) -> None:
    same = tmp_path / "x.json"
    result = runner.invoke(app, ["run", "sky", "--model", str(tiny_llama_dir), "--json-file", str(same),
                                 "--chrome-trace", str(tmp_path / "." / "x.json")])
    assert result.exit_code == 2 and result.stderr.count("\n") == 1
    assert "would overwrite --json-file too" in result.stderr and "1 · Tokenization" not in result.output


def test_show_never_overwrites_the_trace_it_shows(tmp_path: Path) -> None:
    trace = tmp_path / "run.json"
    trace.write_text("{}")
    result = runner.invoke(app, ["show", str(trace), "--chrome-trace", str(trace)])
    assert result.exit_code == 2 and "would overwrite the input it reads" in result.stderr
    assert trace.read_text() == "{}"


def test_run_never_overwrites_its_prompt_file(tiny_llama_dir: Path, tmp_path: Path) -> None:
    prompt = tmp_path / "prompt.txt"
    prompt.write_text("sky")
    result = runner.invoke(app, ["run", "--file", str(prompt), "--model", str(tiny_llama_dir), "--json-file",
                                 str(prompt)])
    assert result.exit_code == 2 and "would overwrite the input it reads" in result.stderr
    assert prompt.read_text() == "sky"


def test_a_failing_write_keeps_the_previous_file_whole(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from llmtrace.cli.output_files import write_output
    from llmtrace.tracer.core.errors import BadArgumentError

    path = tmp_path / "t.json"
    path.write_text("previous")

    def fsync_fails(fd: int) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", fsync_fails)
    with pytest.raises(BadArgumentError, match="No space left on device.*previous file, if any, is kept"):
        write_output(path, "new " * 1000)
    assert path.read_text() == "previous"
    assert [p.name for p in tmp_path.iterdir()] == ["t.json"]  # no temporary file left behind


def test_an_output_keeps_the_mode_of_the_file_it_replaces(tmp_path: Path) -> None:
    from llmtrace.tracer.core.atomic_file import write_atomic

    path = tmp_path / "t.json"
    path.write_text("old")
    path.chmod(0o640)
    write_atomic(path, "new")
    assert path.read_text() == "new" and path.stat().st_mode & 0o777 == 0o640


def test_concurrent_profile_saves_never_tear_the_file(tmp_path: Path) -> None:
    """Writers used to share one temporary name: one's rename removed the other's file (FileNotFoundError)."""
    env = {**os.environ, "XDG_CONFIG_HOME": str(tmp_path)}
    code = ("import sys; from dataclasses import replace; from llmtrace.tracer.hardware.profiles import get_profile;"
            "from llmtrace.tracer.hardware.store import save_measured_profile, load_measured_profiles\n"
            "p = replace(get_profile('l4'), name='box' + sys.argv[1], measured=True)\n"
            "for _ in range(40):\n    save_measured_profile(p, {'n': 1}); load_measured_profiles()\n")
    procs = [subprocess.Popen([sys.executable, "-c", code, str(i)], env=env, stderr=subprocess.PIPE, text=True)
             for i in range(4)]
    errors = [p.communicate(timeout=120)[1] for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0, 0], errors
    saved = json.loads((tmp_path / "llmtrace" / "hardware.json").read_text())
    assert saved["profiles"]  # whole JSON; each writer's last save may have replaced another's (last rename wins)
    assert [p.name for p in (tmp_path / "llmtrace").iterdir()] == ["hardware.json"]


# ---- signals and pipes (real processes) ------------------------------------------------------------------------


def _env(tmp_path: Path) -> dict[str, str]:
    return {**os.environ, "XDG_CONFIG_HOME": str(tmp_path / "config"), "LLMTRACE_CACHE_DIR": str(tmp_path / "cache")}


def test_a_closed_pipe_still_writes_the_trace(tiny_llama_dir: Path, tmp_path: Path) -> None:
    """`llmtrace run ... --json f | head -1`: the reader leaves after one line; the run goes on and writes f."""
    out = tmp_path / "t.json"
    proc = subprocess.Popen([sys.executable, "-m", "llmtrace", "run", "sky", "--model", str(tiny_llama_dir),
                             "--max-new-tokens", "2", "--no-roofline", "--json", str(out)], cwd=REPO, env=_env(tmp_path),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.readline()
    proc.stdout.close()  # as `head -1` does
    stderr = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 0, stderr
    assert stderr == ""
    assert len(Trace.from_json(out.read_text(encoding="utf-8")).generated_ids) == 2


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP])
def test_sigterm_and_sighup_stop_like_ctrl_c_and_keep_the_trace(signum: int, make_tiny_llama: Callable[..., Path],
                                                                tmp_path: Path) -> None:
    # A context of 20k positions: the decode is still running (tens of seconds) when the signal comes.
    model = make_tiny_llama("long-context", max_pos=20_000)
    out = tmp_path / "t.json"
    proc = subprocess.Popen([sys.executable, "-m", "llmtrace", "run", "sky", "--model", str(model),
                             "--max-new-tokens", "19000", "--json", str(out), "--no-roofline", "--no-trace"],
                            cwd=REPO, env=_env(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    for line in proc.stdout:  # section 5 is printed after the prefill: the decode starts next
        if "5 · LM head" in line:
            break
    time.sleep(1.0)
    proc.send_signal(signum)
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signum, stderr
    trace = Trace.from_json(out.read_text(encoding="utf-8"))
    assert trace.stop_reason == "interrupted" and 1 < len(trace.generated_ids) < 19000
    # the summary names the signal (it said "interrupted (Ctrl-C)" for every one of them)
    assert f"stopped: interrupted ({signal.Signals(signum).name})" in stdout and "Ctrl-C" not in stdout
    assert "Traceback" not in stderr
