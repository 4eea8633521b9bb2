"""`llmtrace ...` with the native kernel built from another gguf_matmul.c: a baseline for end-to-end comparisons.

    .venv/bin/python -m benchmarks.run_with_native_source OLD.c run capital --weights native --no-trace --summary-json
    .venv/bin/python -m benchmarks.run_with_native_source main -m benchmarks.bench_decode_step --child --weights native

OLD.c is a file, or a git revision whose tracer/model/native/gguf_matmul.c is taken. The build goes in its own
folder ($LLMTRACE_NATIVE_DIR when set, else one in the temporary directory named by the source's hash, reused by
later runs), so the current source's build is left alone.
"""

from __future__ import annotations

import hashlib
import os
import runpy
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.bench_native_rows import baseline_source  # noqa: E402
from llmtrace.tracer.model import native_kernel  # noqa: E402


def main() -> None:
    spec, rest = sys.argv[1], sys.argv[2:]
    text = baseline_source(spec)
    digest = hashlib.sha256(text.encode()).hexdigest()[:16]
    folder = Path(os.environ.get(native_kernel.DIR_ENV) or Path(tempfile.gettempdir()) / f"llmtrace-native-{digest}")
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "gguf_matmul.c").write_text(text)  # included by decode_step.c: the baseline must have today's ABI
    (folder / "decode_step.c").write_text(native_kernel.SOURCE.read_text())
    os.environ[native_kernel.DIR_ENV] = str(folder)
    native_kernel.SOURCE = folder / "decode_step.c"  # read when the kernel is built and keyed
    native_kernel.SOURCES = (native_kernel.SOURCE, folder / "gguf_matmul.c")
    if rest[:1] == ["-m"]:  # another module's main, e.g. a benchmark's in-process measurement
        sys.argv = [rest[1], *rest[2:]]
        runpy.run_module(rest[1], run_name="__main__", alter_sys=True)
        return
    from llmtrace.cli.app import main as cli

    sys.argv = ["llmtrace", *rest]
    cli()


if __name__ == "__main__":
    main()
