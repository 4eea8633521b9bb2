"""A cache or config folder another user can write never runs their code as you (issue 27, item 3), and a build
killed or disturbed midway leaves nothing behind and blames the right thing (item 8).

The planted library is a real shared object whose constructor writes a marker file: dlopen runs constructors before
anything can check the library, so "never loaded" is "the marker never appears". A control test loads the same kind
of plant from a folder that is the user's own, and sees the marker: the plant would run if it were loaded."""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

import pytest
from typer.testing import CliRunner

from llmtrace.cli.app import app
from llmtrace.tracer.core.cache_dirs import UntrustedPathError, private_folder
from llmtrace.tracer.hardware import store
from llmtrace.tracer.model import native_kernel

runner = CliRunner()
REPO = Path(__file__).resolve().parent.parent
NOBODY = 65534

# A compiler that answers --version and fails every compile at once: the build key is the plant's, and no test here
# waits for a real build.
FAKE_CC = '#!/bin/sh\nif [ "$1" = --version ]; then echo "fakecc 1.0"; exit 0; fi\necho "error: fake" >&2\nexit 1\n'

PLANT_C = """#include <stdio.h>
__attribute__((constructor)) static void planted(void) {
    FILE *f = fopen("%s", "w");
    if (f) { fputs("ran", f); fclose(f); }
}
int llmt_abi(void) { return -1; }
int llmt_step_abi(void) { return -1; }
int llmt_features(void) { return 0; }
"""


@pytest.fixture
def fake_cc(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    cc = tmp_path / "bin" / "fakecc"
    cc.parent.mkdir()
    cc.write_text(FAKE_CC)
    cc.chmod(0o755)
    monkeypatch.setenv("CC", str(cc))
    native_kernel.reset()
    yield [str(cc)]
    native_kernel.reset()


def _plant(folder: Path, compiler: list[str], marker: Path, tmp_path: Path) -> Path:
    """A library that writes `marker` when loaded, under the name and pointer a build of `compiler` would have."""
    source = tmp_path / "plant.c"
    source.write_text(PLANT_C % marker)
    built = tmp_path / "plant.so"
    subprocess.run(["cc", "-shared", "-fPIC", "-o", str(built), str(source)], check=True)
    data = built.read_bytes()
    key = native_kernel._key(compiler, "fakecc 1.0")
    name = f"gguf_matmul-{key}-{hashlib.sha256(data).hexdigest()}.so"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / name).write_bytes(data)
    (folder / f"gguf_matmul-{key}.txt").write_text(f"{name}\n-O3\n")
    return folder / name


def test_the_plant_runs_when_its_folder_is_trusted(fake_cc: list[str], tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """The control: a private folder of the user's own, the plant's files the user's, mode 0644: loaded (its
    constructor ran), then refused for its ABI, then rebuilt (the fake compiler fails: one line)."""
    folder, marker = tmp_path / "native", tmp_path / "marker"
    folder.mkdir(mode=0o700)
    _plant(folder, fake_cc, marker, tmp_path)
    monkeypatch.setenv(native_kernel.DIR_ENV, str(folder))
    assert not native_kernel.available()
    assert marker.read_text() == "ran"


def test_a_world_writable_kernel_folder_is_refused_and_nothing_in_it_is_loaded(
        fake_cc: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    folder, marker = tmp_path / "native", tmp_path / "marker"
    _plant(folder, fake_cc, marker, tmp_path)
    folder.chmod(0o777)
    monkeypatch.setenv(native_kernel.DIR_ENV, str(folder))
    with pytest.raises(UntrustedPathError) as refused:
        native_kernel.available()
    message = str(refused.value)
    assert f"the kernel folder {folder} can be written by its group and others (mode 0777)" in message
    assert "LLMTRACE_NATIVE_DIR" in message and "\n" not in message
    assert not marker.exists()


def test_a_world_writable_cache_folder_is_refused(fake_cc: list[str], tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """$LLMTRACE_CACHE_DIR made world-writable (no sticky bit), a plant in its native/: refused, never loaded; the
    weights cache under it is refused too."""
    cache, marker = tmp_path / "cache", tmp_path / "marker"
    _plant(cache / "native", fake_cc, marker, tmp_path)
    cache.chmod(0o777)
    monkeypatch.delenv(native_kernel.DIR_ENV)
    monkeypatch.setenv("LLMTRACE_CACHE_DIR", str(cache))
    with pytest.raises(UntrustedPathError, match=r"the cache folder .* can be written by .*LLMTRACE_CACHE_DIR"):
        native_kernel.available()
    from llmtrace.tracer.load.weights_cache import weights_dir

    with pytest.raises(UntrustedPathError, match="the cache folder"):
        weights_dir()
    assert not marker.exists()


def test_a_folder_inside_a_world_writable_folder_without_sticky_bit_is_refused(tmp_path: Path) -> None:
    """Others could rename the user's folder away and put theirs in its place; with the sticky bit (/tmp) they
    cannot."""
    shared = tmp_path / "shared"
    (shared / "cache").mkdir(parents=True, mode=0o700)
    shared.chmod(0o777)
    with pytest.raises(UntrustedPathError, match=rf"inside {shared}, which its group and others can write "
                                                 r"\(mode 0777, no sticky bit\)"):
        private_folder(shared / "cache", "cache folder", "LLMTRACE_CACHE_DIR")
    shared.chmod(0o1777)
    assert private_folder(shared / "cache", "cache folder", "LLMTRACE_CACHE_DIR") == shared / "cache"


def test_a_folder_created_for_the_cache_is_private(tmp_path: Path) -> None:
    made = private_folder(tmp_path / "a" / "cache", "cache folder", "LLMTRACE_CACHE_DIR", create=True)
    assert made.is_dir() and made.stat().st_mode & 0o777 == 0o700


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a file to another user takes root")
def test_a_kernel_folder_of_another_user_is_refused(fake_cc: list[str], tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    folder, marker = tmp_path / "native", tmp_path / "marker"
    _plant(folder, fake_cc, marker, tmp_path)
    folder.chmod(0o755)
    os.chown(folder, NOBODY, NOBODY)
    monkeypatch.setenv(native_kernel.DIR_ENV, str(folder))
    with pytest.raises(UntrustedPathError, match=rf"belongs to uid {NOBODY}, not to you \(uid 0\)"):
        native_kernel.available()
    assert not marker.exists()


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a file to another user takes root")
@pytest.mark.parametrize("which", ["library", "pointer"])
def test_a_planted_file_of_another_user_in_a_private_folder_is_never_loaded(
        which: str, fake_cc: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    folder, marker = tmp_path / "native", tmp_path / "marker"
    library = _plant(folder, fake_cc, marker, tmp_path)
    folder.chmod(0o700)
    target = library if which == "library" else next(folder.glob("*.txt"))
    os.chown(target, NOBODY, NOBODY)
    monkeypatch.setenv(native_kernel.DIR_ENV, str(folder))
    with pytest.raises(UntrustedPathError, match=rf"{target} belongs to uid {NOBODY}"):
        native_kernel.available()
    assert not marker.exists()


def test_a_group_writable_library_is_never_loaded(fake_cc: list[str], tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    folder, marker = tmp_path / "native", tmp_path / "marker"
    library = _plant(folder, fake_cc, marker, tmp_path)
    folder.chmod(0o700)
    library.chmod(0o664)
    monkeypatch.setenv(native_kernel.DIR_ENV, str(folder))
    with pytest.raises(UntrustedPathError, match=r"can be written by its group \(mode 0664\)"):
        native_kernel.available()
    assert not marker.exists()


def test_a_world_writable_config_folder_is_refused_in_one_line(tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """The saved kernel choices and profiles live there: `llmtrace hardware` reads them, and refuses the folder."""
    config = tmp_path / "config" / "llmtrace"
    config.mkdir(parents=True)
    config.chmod(0o777)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    with pytest.raises(UntrustedPathError):
        store.config_dir()
    result = runner.invoke(app, ["hardware"])
    assert result.exit_code == 2 and result.stderr.count("\n") == 1, result.output
    assert f"the config folder {config} can be written by its group and others" in result.stderr
    assert "XDG_CONFIG_HOME" in result.stderr


def test_a_world_writable_cache_folder_is_one_line_exit_2_from_run(tmp_path: Path, tiny_quantized: object) -> None:
    """As a user meets it: `llmtrace run` on a GGUF with the native kernel, $LLMTRACE_CACHE_DIR world-writable."""
    from gguf import GGMLQuantizationType as Q

    cache = tmp_path / "cache"
    cache.mkdir()
    cache.chmod(0o777)
    env = {k: v for k, v in os.environ.items() if k != native_kernel.DIR_ENV}
    env.update(LLMTRACE_CACHE_DIR=str(cache), XDG_CONFIG_HOME=str(tmp_path / "config"))
    done = subprocess.run([sys.executable, "-m", "llmtrace", "run", "sky", "--model", str(tiny_quantized(Q.Q4_0)),
                           "--weights", "native", "--max-new-tokens", "1", "--no-roofline"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stderr.count("\n") == 1 and f"the cache folder {cache} can be written by" in done.stderr
    assert not (cache / "native").exists()


# ---- builds cut short (item 8) -------------------------------------------------------------------------------------


def test_a_build_killed_midway_leaves_a_partial_the_next_build_removes(tmp_path: Path) -> None:
    """SIGKILL while the compiler runs: its `.partial` file and probe folder stay (nothing can clean up after
    SIGKILL); the next build, holding the folder's lock, removes them."""
    folder = tmp_path / "native"
    slow = tmp_path / "slowcc"
    slow.write_text(f'#!/bin/sh\nif [ "$1" = --version ]; then echo "slowcc 1.0"; exit 0; fi\n'
                    f'case "$*" in *probe.c*) exec cc "$@";; esac\ntouch {tmp_path}/compiling\nexec sleep 300\n')
    slow.chmod(0o755)
    env = {**os.environ, native_kernel.DIR_ENV: str(folder), "CC": str(slow)}
    code = "from llmtrace.tracer.model import native_kernel as n; print(n.available())"
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=REPO, env=env, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while not (tmp_path / "compiling").exists():
            assert time.monotonic() < deadline and proc.poll() is None
            time.sleep(0.05)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # the process and its compiler
        proc.wait(timeout=60)
    assert len(list(folder.glob(".gguf_matmul-*.so.partial"))) == 1, list(folder.iterdir())
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300,
                          env={**os.environ, native_kernel.DIR_ENV: str(folder)})
    assert done.stdout.strip() == "True", done.stdout + done.stderr
    assert not list(folder.glob("*.partial")) and not list(folder.glob(".probe-*"))


def test_the_kernel_folder_removed_during_the_build_is_said_so(tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """Was: "`cc` could not compile decode_step.c: /usr/bin/ld: cannot open output file ...", blaming the compiler."""
    import shutil

    folder = tmp_path / "native"
    monkeypatch.setenv(native_kernel.DIR_ENV, str(folder))
    real_compile = native_kernel._compile

    def compile_after_removal(compiler: list[str], flags: tuple[str, ...], units: list[Path], out: str) -> str:
        if not out.endswith("probe.so"):  # the library's own compile, after the flag probe
            shutil.rmtree(folder)  # `rm -rf native/` from another terminal, mid-build
        return real_compile(compiler, flags, units, out)

    monkeypatch.setattr(native_kernel, "_compile", compile_after_removal)
    native_kernel.reset()
    try:
        assert not native_kernel.available()
        reason = native_kernel.unavailable_reason()
    finally:
        native_kernel.reset()
    assert reason == f"the kernel folder {folder} was removed during the build; run again", reason
    assert "output file" not in reason and "\n" not in reason

