"""The native library built with other flags than native_kernel's own, for a block of a test: in the block every
product runs on that build (the portable C loops, a build without AVX-512 VNNI), built into a folder of its own so
the session's build is left alone and found again afterwards."""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import pytest

from llmtrace.tracer.model import native_kernel

# without -march=native: no AVX2, so the portable C loops (OpenMP where the compiler has it)
PORTABLE_FLAGS = (("-O3", "-fopenmp"), ("-O3",))


@contextmanager
def built_with(flag_sets: tuple[tuple[str, ...], ...], folder: Path) -> Iterator[None]:
    """native_kernel's FLAG_SETS replaced by `flag_sets` and its builds put in `folder` for the block. Weights packed
    inside it call that build; pack them again outside it for the usual one."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(native_kernel.DIR_ENV, str(folder))
        patch.setattr(native_kernel, "FLAG_SETS", flag_sets)
        native_kernel.reset()
        try:
            yield
        finally:
            native_kernel.reset()
