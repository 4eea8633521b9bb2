"""Where measured hardware profiles live: `hardware.json` in the user's config folder.

$XDG_CONFIG_HOME/llmtrace/hardware.json, or ~/.config/llmtrace/hardware.json when XDG_CONFIG_HOME is unset.
Plain JSON, pure Python: every command reads it (to know `this-machine`) without importing torch.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, fields
from pathlib import Path
from typing import Any, Mapping

from llmtrace.tracer.core.errors import HardwareError
from llmtrace.tracer.hardware.profiles import HardwareProfile, get_profile

STORE_VERSION = 1
_FIELDS = {f.name for f in fields(HardwareProfile)}


def config_dir() -> Path:
    base = os.environ.get("XDG_CONFIG_HOME")
    root = Path(base).expanduser() if base else Path.home() / ".config"
    return root / "llmtrace"


def store_path() -> Path:
    return config_dir() / "hardware.json"


def _read(path: Path) -> dict[str, Any]:
    if not path.exists():
        return {"version": STORE_VERSION, "profiles": {}, "measurements": {}}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise HardwareError(f"{path}: not readable as JSON ({exc}); delete it and run `llmtrace hardware --measure`")
    if not isinstance(data, dict) or not isinstance(data.get("profiles"), dict):
        raise HardwareError(f"{path}: no 'profiles' object; delete it and run `llmtrace hardware --measure`")
    if not isinstance(data.setdefault("measurements", {}), dict):
        raise HardwareError(f"{path}: 'measurements' is not an object; delete it and run `llmtrace hardware --measure`")
    return data


def _profile_from_dict(name: str, raw: Any, path: Path) -> HardwareProfile:
    if not isinstance(raw, dict) or set(raw) != _FIELDS:
        raise HardwareError(f"{path}: profile {name!r} is malformed; run `llmtrace hardware --measure` again")
    try:
        return HardwareProfile(**raw)
    except TypeError as exc:
        raise HardwareError(f"{path}: profile {name!r} is malformed ({exc}); run `llmtrace hardware --measure` again")


def load_measured_profiles(path: Path | None = None) -> dict[str, HardwareProfile]:
    """Saved profiles by name; empty when nothing was measured yet."""
    path = path or store_path()
    data = _read(path)
    return {name: _profile_from_dict(name, raw, path) for name, raw in data["profiles"].items()}


def load_measurement_details(name: str, path: Path | None = None) -> dict[str, Any] | None:
    """The raw measurement record saved with profile `name` (sizes, repeats, every timing), or None."""
    details = _read(path or store_path())["measurements"].get(name)
    return details if isinstance(details, dict) else None


def save_measured_profile(profile: HardwareProfile, details: Mapping[str, Any], path: Path | None = None) -> Path:
    """Add or replace `profile` (and the measurement details behind it); other saved profiles are kept."""
    path = path or store_path()
    data = _read(path)
    data["version"] = STORE_VERSION
    data["profiles"][profile.name] = asdict(profile)
    data["measurements"][profile.name] = dict(details)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    tmp.replace(path)  # atomic: a reader never sees half a file
    return path


def resolve_hardware(name: str, path: Path | None = None) -> HardwareProfile:
    """A datasheet profile or a measured one saved in the config folder (`this-machine`), by name."""
    return get_profile(name, load_measured_profiles(path))
