"""`llmtrace ...` with the native kernel built from another tree's C sources: a baseline for end-to-end comparisons.

    .venv/bin/python -m benchmarks.run_with_native_source OLD.c run capital --weights native --no-trace --summary-json
    .venv/bin/python -m benchmarks.run_with_native_source main -m benchmarks.bench_decode_step --child --weights native

SPEC is a git revision, whose tracer/model/native/*.c and *.h are taken (its whole source set: every unit, or before
the units were separate, decode_step.c and every file it #includes), or a file taken as gguf_matmul.c with the other sources beside it (bench_native_rows.baseline_source: an
edited copy of a tree's native/ folder); a file of today's set the spec lacks is today's. The sources and their build
go in a folder of their own ($LLMTRACE_NATIVE_DIR when set, else one in the temporary directory named by the sources'
hash, reused by later runs), so the current source's build is left alone. native_kernel loads the build only if its
ABI numbers are today's: a revision from before a change of them is refused, with that reason.
"""

from __future__ import annotations

import hashlib
import os
import runpy
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.bench_native_rows import REPO, baseline_source  # noqa: E402
from llmtrace.tracer.model import native_kernel  # noqa: E402

NATIVE = "tracer/model/native"


def tree_sources(spec: str) -> dict[str, str]:
    """{file name: text} of the C files a build of SPEC is made of: a revision's every tracer/model/native/*.c and *.h
    (a revision's set alone: today's units would not build with an older tree's), else (a file as gguf_matmul.c)
    today's set, each SPEC's text where it has one, else today's."""
    names = {path.name for path in native_kernel.SOURCES}
    if not Path(spec).is_file():
        names = set()
        listed = subprocess.run(["git", "-C", str(REPO), "ls-tree", "--name-only", spec, f"{NATIVE}/"],
                                capture_output=True, text=True)
        if listed.returncode:
            sys.exit(f"no source tree {spec}: {listed.stderr.strip()}")
        names |= {Path(line).name for line in listed.stdout.splitlines() if line.endswith((".c", ".h"))}
    texts = {name: baseline_source(spec, name) for name in sorted(names)}
    return {name: text if text is not None else (native_kernel.NATIVE_SOURCES / name).read_text()
            for name, text in texts.items()}


def use_sources(folder: Path, build: Path) -> None:
    """native_kernel compiles `folder`'s units, keys the build by every .c and .h file in `folder` and keeps it in
    `build`: called before anything loads the library. A tree from before the units were separate (decode_step.c
    #included the rest) compiles decode_step.c alone."""
    os.environ[native_kernel.DIR_ENV] = str(build)
    sources = sorted(folder.glob("*.[ch]"))
    if not (folder / "kernels.h").exists():  # the unity build: decode_step.c is the one unit (the folder's name
        sources = [folder / "decode_step.c"]  # is the digest of every file it #includes)
    native_kernel.SOURCES = tuple(sources)
    native_kernel.reset()
    native_kernel.sources_digest.cache_clear()  # saved kernel choices are keyed by the sources' digest


def main() -> None:
    spec, rest = sys.argv[1], sys.argv[2:]
    sources = tree_sources(spec)
    digest = hashlib.sha256(repr(sorted(sources.items())).encode()).hexdigest()[:16]
    folder = Path(os.environ.get(native_kernel.DIR_ENV) or Path(tempfile.gettempdir()) / f"llmtrace-native-{digest}")
    folder.mkdir(parents=True, exist_ok=True)
    for name, text in sources.items():
        (folder / name).write_text(text)
    use_sources(folder, folder)
    if rest[:1] == ["-m"]:  # another module's main, e.g. a benchmark's in-process measurement
        sys.argv = [rest[1], *rest[2:]]
        runpy.run_module(rest[1], run_name="__main__", alter_sys=True)
        return
    from llmtrace.cli.app import main as cli

    sys.argv = ["llmtrace", *rest]
    cli()


if __name__ == "__main__":
    main()
