"""The distribution works alone: an sdist built from the checkout, a wheel built from that sdist, installed into a
fresh virtual environment and run from a folder outside the repository.

The fresh environment gets the wheel and nothing of the checkout; torch and the other dependencies (hundreds of MB,
minutes to install on two cores) come from this environment's site-packages through a path file, which adds the
folder to sys.path without processing the editable install's own path files, so `llmtrace` can only come from the
wheel (the test checks where it was imported from).
"""

from __future__ import annotations

import json
import os
import site
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def _check(*args: str | Path, cwd: Path, env: dict[str, str] | None = None) -> str:
    done = subprocess.run([str(a) for a in args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"{args}\n{done.stdout}\n{done.stderr}"
    return done.stdout


@pytest.fixture(scope="module")
def dist(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("dist")
    sdist_name = _check(sys.executable, "-c", "import sys; from setuptools import build_meta as b; "
                        "print(b.build_sdist(sys.argv[1]))", out, cwd=REPO).strip().splitlines()[-1]
    sdist = out / sdist_name
    _check(sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "--no-index",
           "-w", out, sdist, cwd=out)
    (wheel,) = out.glob("llmtrace-*.whl")
    return {"sdist": sdist, "wheel": wheel}


def test_sdist_and_wheel_carry_the_package_data(dist: dict[str, Path]) -> None:
    with tarfile.open(dist["sdist"]) as sdist:
        in_sdist = {name.split("/", 1)[1] for name in sdist.getnames() if "/" in name}
    with zipfile.ZipFile(dist["wheel"]) as wheel:
        in_wheel = set(wheel.namelist())
        metadata = next(wheel.read(n).decode() for n in in_wheel if n.endswith(".dist-info/METADATA"))
    samples = sorted(p.name for p in (REPO / "sample_prompts").glob("*.txt"))
    assert len(samples) >= 5
    for name in samples:
        assert f"sample_prompts/{name}" in in_sdist and f"llmtrace/sample_prompts/{name}" in in_wheel
    assert "tracer/trace/trace_schema.json" in in_sdist
    assert "llmtrace/tracer/trace/trace_schema.json" in in_wheel and "llmtrace/__main__.py" in in_wheel
    from llmtrace.tracer.core.json_schemas import SCHEMA_FILES

    for file in SCHEMA_FILES.values():  # every --json output's schema
        assert f"tracer/{file}" in in_sdist and f"llmtrace/tracer/{file}" in in_wheel, file
    # the native library's sources: its units and their headers
    for source in ("gguf_matmul.c", "decode_step.c", "int8_dot.c", "blocks.h", "kernels.h"):
        assert f"tracer/model/native/{source}" in in_sdist and f"llmtrace/tracer/model/native/{source}" in in_wheel
    assert not any(n.startswith(("tracer/", "cli/", "tests/")) for n in in_wheel)  # no generic top-level names
    assert "License-Expression: Apache-2.0" in metadata
    assert "Requires-Dist: jinja2>=3.1" in metadata


def test_wheel_runs_alone_outside_the_checkout(dist: dict[str, Path], tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    _check(sys.executable, "-m", "venv", "--without-pip", venv, cwd=tmp_path)
    python = venv / "bin" / "python"
    _check(sys.executable, "-m", "pip", "--python", python, "install", "-q", "--no-deps", "--no-index",
           dist["wheel"], cwd=tmp_path)
    (purelib,) = (venv / "lib").glob("python*/site-packages")
    (purelib / "dependencies.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["XDG_CONFIG_HOME"] = str(tmp_path / "config")

    where = _check(python, "-c", "import llmtrace.cli, llmtrace.sample_prompts as s; print(llmtrace.cli.__file__); "
                   "print(s.__file__)", cwd=tmp_path, env=env)
    assert all(line.startswith(str(purelib)) for line in where.split()), where

    llmtrace = venv / "bin" / "llmtrace"
    assert _check(llmtrace, "--version", cwd=tmp_path, env=env).strip() == "llmtrace 0.1.0"
    trace = tmp_path / "t.json"
    out = _check(llmtrace, "run", "capital", "--dry-run", "--model", "smollm2-135m", "--detail", "summary",
                 "--json", trace, cwd=tmp_path, env=env)
    assert "prompt: sample prompt 'capital'" in out  # read from the wheel's package data, and said so
    assert json.loads(trace.read_text())["settings"]["prompt"] == "The capital of France is"
    # the native kernel compiles from the wheel's own copy of its source, into a folder of its own
    env["LLMTRACE_NATIVE_DIR"] = str(tmp_path / "native")
    built = _check(python, "-c", "from llmtrace.tracer.model import native_kernel as n; print(n.available()); "
                   "print(n.unavailable_reason()); print(n.SOURCES[0])", cwd=tmp_path, env=env).splitlines()
    assert built[2].startswith(str(purelib)), built
    if built[0] != "True":  # a machine without a C compiler: the one-line reason, not a failure
        assert built[1].startswith("no C compiler"), built
