"""Where measured hardware profiles live: `hardware.json` in the user's config folder.

$XDG_CONFIG_HOME/llmtrace/hardware.json, or ~/.config/llmtrace/hardware.json when XDG_CONFIG_HOME is unset.
Plain JSON, pure Python: every command reads it (to know `this-machine`) without importing torch.

The file comes from outside (hand edits, another version, a torn copy), so every profile is checked field by field
on reading (types, finite and positive ceilings): a bad one is one HardwareError naming the file and the field,
never a TypeError or a division by zero in the roofline. The file is read and saved by tracer/core/json_store.py:
saving is atomic with a temporary name per writer, so concurrent saves never tear the file or remove each other's
temporary file; a folder that cannot be written is a HardwareError, so `run` can report it as a warning and keep
the run.
"""

from __future__ import annotations

import math
import os
from dataclasses import asdict, fields
from pathlib import Path
from typing import Any, Mapping

from llmtrace.tracer.core.cache_dirs import private_folder
from llmtrace.tracer.core.errors import HardwareError
from llmtrace.tracer.core.json_input import is_int
from llmtrace.tracer.core.json_store import StoreFormat, read_store, write_store
from llmtrace.tracer.hardware.machine_load import is_busy
from llmtrace.tracer.hardware.profiles import PEAK_DTYPES, THIS_MACHINE, HardwareProfile, get_profile, normalize_name

STORE_VERSION = 1
_FIELDS = {f.name for f in fields(HardwareProfile)}


def config_dir() -> Path:
    """$XDG_CONFIG_HOME/llmtrace (or ~/.config/llmtrace); UntrustedPathError when another user could write it (the
    saved choices there pick the kernels a run executes: tracer/core/cache_dirs.py)."""
    base = os.environ.get("XDG_CONFIG_HOME")
    root = Path(base).expanduser() if base else Path.home() / ".config"
    return private_folder(root / "llmtrace", "config folder", "XDG_CONFIG_HOME")


def store_path() -> Path:
    return config_dir() / "hardware.json"


# Files written by hand (or by the first llmtrace) may lack "version" and "measurements".
STORE = StoreFormat("hardware store", STORE_VERSION, ("profiles", "measurements"), HardwareError, HardwareError,
                    fix="delete it and run `llmtrace hardware --measure`", added=("measurements",), unversioned=True)


_STRING_FIELDS = ("name", "label", "interconnect", "source")


def _profile_from_dict(name: str, raw: Any, path: Path) -> HardwareProfile:
    def bad(why: str) -> HardwareError:
        return HardwareError(f"{path}: profile {name!r} {why}; run `llmtrace hardware --measure` again")

    if not isinstance(raw, dict) or set(raw) != _FIELDS:
        raise bad("is malformed (not an object with the profile's fields)")
    for key in _STRING_FIELDS:
        if not isinstance(raw[key], str):
            raise bad(f"has a non-text {key!r} ({raw[key]!r})")
    if not isinstance(raw["measured"], bool):
        raise bad(f"has a non-boolean 'measured' ({raw['measured']!r})")
    if not is_int(raw["memory_bytes"]) or raw["memory_bytes"] <= 0:
        raise bad(f"has 'memory_bytes' {raw['memory_bytes']!r}; it must be a positive integer")
    for key in ("memory_bandwidth", *PEAK_DTYPES):
        value = raw[key]
        if key in PEAK_DTYPES and value is None:
            continue
        if not _is_positive_number(value):
            raise bad(f"has {key!r} {value!r}; it must be a positive, finite number")
    if not (_is_positive_number(raw["interconnect_bandwidth"]) or raw["interconnect_bandwidth"] == 0):
        raise bad(f"has 'interconnect_bandwidth' {raw['interconnect_bandwidth']!r}; it must be a finite number >= 0")
    if raw["name"] != name:
        raise bad(f"is saved under another name ({raw['name']!r})")
    return HardwareProfile(**raw)


def _is_positive_number(value: Any) -> bool:
    return (is_int(value) or isinstance(value, float)) and math.isfinite(value) and value > 0


def load_measured_profiles(path: Path | None = None) -> dict[str, HardwareProfile]:
    """Saved profiles by name; empty when nothing was measured yet."""
    path = path or store_path()
    data = read_store(path, STORE)
    return {name: _profile_from_dict(name, raw, path) for name, raw in data["profiles"].items()}


def load_measurement_details(name: str, path: Path | None = None) -> dict[str, Any] | None:
    """The raw measurement record saved with profile `name` (sizes, repeats, every timing), or None."""
    details = read_store(path or store_path(), STORE)["measurements"].get(name)
    return details if isinstance(details, dict) else None


def save_measured_profile(profile: HardwareProfile, details: Mapping[str, Any], path: Path | None = None) -> Path:
    """Add or replace `profile` (and the measurement details behind it); other saved profiles are kept."""
    path = path or store_path()
    data = read_store(path, STORE)
    data["profiles"][profile.name] = asdict(profile)
    data["measurements"][profile.name] = dict(details)
    return write_store(path, data, STORE, "the profile")


class UnusableProfile(HardwareError):
    """The saved 'this-machine' profile cannot judge a run here (another device, a busy machine)."""


def saved_this_machine(device: str | None = None, path: Path | None = None) -> HardwareProfile | None:
    """The saved 'this-machine' profile, the one `roofline --hardware this-machine` and `run`'s summary both judge
    by; None when nothing is saved. UnusableProfile when it cannot judge: measured on another device than `device`,
    or while other processes kept the CPUs busy (its ceilings are then likely low, and a run judged by them would
    reach more than 100% of its bound; tracer/hardware/machine_load.py)."""
    profiles = load_measured_profiles(path)
    if THIS_MACHINE not in profiles:
        return None
    details = load_measurement_details(THIS_MACHINE, path) or {}
    if device is not None and details.get("device", device) != device:
        raise UnusableProfile(f"'this-machine' was measured on {details['device']}, this run used {device}; "
                            f"run `llmtrace hardware --measure --device {device}`")
    others = details.get("others_cpu")
    if isinstance(others, (int, float)) and is_busy(float(others)):
        raise UnusableProfile(f"the saved 'this-machine' profile was measured while other processes took {others:.0%} "
                            "of the CPUs, so its ceilings are likely low; run `llmtrace hardware --measure` when the "
                            "machine is quiet")
    return profiles[THIS_MACHINE]


def resolve_hardware(name: str, path: Path | None = None) -> HardwareProfile:
    """A datasheet profile or a measured one saved in the config folder (`this-machine`: saved_this_machine), by
    name."""
    if normalize_name(name) == THIS_MACHINE:
        saved = saved_this_machine(path=path)
        if saved is not None:
            return saved
    return get_profile(name, load_measured_profiles(path))
