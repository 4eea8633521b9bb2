"""Saved kernel picks: `kernels.json` next to hardware.json (tracer/hardware/store.py's config folder), written by
`llmtrace tune` and read for `run --weights tuned` only.

One entry per machine (product_timing.machine_key: device, its model, torch, CPU kernels, threads) and model shape
(`model_key`: the product shapes, the layer count and the matrices' stored formats), so a different CPU, torch,
thread count or model shape has no saved pick.

The file comes from outside (hand edits, another version, a torn copy): whatever fails to read back as the records
it should hold (bad JSON, a wrong version, a missing or mistyped field) is a `StoreProblem` the caller turns into
one line and the default kernels; never a traceback. What reads back well-formed is still judged again by the
accuracy rule before it runs (tracer/load/kernel_pick.py's saved_choice). The file itself is read and saved
(atomically) by tracer/core/json_store.py. Pure Python, no torch.
"""

from __future__ import annotations

import math
from dataclasses import asdict, fields
from pathlib import Path
from typing import Any, Iterable

from llmtrace.tracer.core.errors import HardwareError
from llmtrace.tracer.core.json_store import StoreFormat, read_store, write_store
from llmtrace.tracer.hardware.kernel_choice import CandidateTiming, KernelChoice, TypeKernel
from llmtrace.tracer.hardware.store import config_dir

# 5: written by `llmtrace tune` only (a run no longer measures); the record names its source and numerics. An older
#    file (a run's own measurement) is read as out of date: one line, the default kernels.
STORE_VERSION = 5
_CHOICE_FIELDS = {f.name: f for f in fields(KernelChoice)}
_TIMING_FIELDS = {f.name: f for f in fields(CandidateTiming)}
_TYPE_FIELDS = {f.name for f in fields(TypeKernel)}


class StoreProblem(HardwareError):
    """The saved choices could not be read back; the message names the file and what was wrong."""


# The caller (load/kernel_pick.py) says what happens next: the default kernels.
STORE = StoreFormat("kernel store", STORE_VERSION, ("machines",), StoreProblem, HardwareError,
                    older="by a run's own measurement, before `llmtrace tune`")


def kernels_path() -> Path:
    return config_dir() / "kernels.json"


def model_key(shapes: Iterable[Any], n_layers: int, stored_formats: Iterable[str],
              candidates: Iterable[str] = ()) -> str:
    """The model shape a choice is for: each product's (rows x cols), per layer or per step, the layer count, the
    matrices' stored formats (which candidates exist and are acceptable) and the candidates' names (a kernel added
    to llmtrace means measuring again)."""
    products = ",".join(f"{s.role}:{s.rows}x{s.cols}{'/layer' if s.per_layer else ''}" for s in shapes)
    key = f"{n_layers} layers|{products}|stored {'+'.join(sorted(set(stored_formats))) or 'none'}"
    names = ",".join(candidates)
    return f"{key}|candidates {names}" if names else key


def load_choice(machine: str, model: str, path: Path | None = None) -> KernelChoice | None:
    """The saved pick for this machine and model shape, None when there is none; StoreProblem when the file or the
    entry is damaged."""
    path = path or kernels_path()
    data = read_store(path, STORE)
    entry = data["machines"].get(machine, {})
    if not isinstance(entry, dict):
        raise StoreProblem(f"{path}: machine entry {machine!r} is not an object")
    raw = entry.get(model)
    if raw is None:
        return None
    return _choice_from(raw, f"{path}: saved choice for {machine!r}")


def save_choice(machine: str, model: str, choice: KernelChoice, path: Path | None = None) -> Path:
    """Add or replace the choice for this machine and model shape; a damaged file is replaced, other entries of a
    sound one kept. HardwareError when the folder cannot be written."""
    path = path or kernels_path()
    try:
        data = read_store(path, STORE)
    except StoreProblem:
        data = STORE.empty()
    machines = data["machines"]
    if not isinstance(machines.get(machine), dict):
        machines[machine] = {}
    record = asdict(choice)
    machines[machine][model] = record
    return write_store(path, data, STORE, "the kernel choice")


def _choice_from(raw: Any, where: str) -> KernelChoice:
    if not isinstance(raw, dict) or set(raw) != set(_CHOICE_FIELDS):
        raise StoreProblem(f"{where} is malformed (not an object with the choice's fields)")
    if not isinstance(raw["candidates"], list) or not isinstance(raw["by_type"], list):
        raise StoreProblem(f"{where}: 'candidates' or 'by_type' is not a list")
    candidates = tuple(_timing_from(c, where) for c in raw["candidates"])
    by_type = []
    for item in raw["by_type"]:
        if not isinstance(item, dict) or set(item) != _TYPE_FIELDS or not all(isinstance(v, str)
                                                                            for v in item.values()):
            raise StoreProblem(f"{where}: an entry of 'by_type' is malformed")
        by_type.append(TypeKernel(**item))
    values = {k: v for k, v in raw.items() if k not in ("candidates", "by_type")}
    for name, value in values.items():
        if name == "measured_seconds":
            ok = _number(value)
        elif name == "others_cpu":
            ok = value is None or (_number(value) and value <= 1)
        else:
            ok = isinstance(value, str)
        if not ok:
            raise StoreProblem(f"{where}: field {name!r} has a wrong value ({value!r})")
    return KernelChoice(candidates=candidates, by_type=tuple(by_type), **values)


def _timing_from(raw: Any, where: str) -> CandidateTiming:
    if not isinstance(raw, dict) or set(raw) != set(_TIMING_FIELDS):
        raise StoreProblem(f"{where}: a candidate is malformed")
    for name, value in raw.items():
        if name in ("decode_s", "prefill_s"):
            ok = _number(value) and value > 0
        elif name == "weight_bytes":
            ok = isinstance(value, int) and not isinstance(value, bool) and value > 0
        elif name == "safe":
            ok = isinstance(value, bool)
        elif name == "product_error":
            ok = value is None or _number(value)
        else:
            ok = isinstance(value, str)
        if not ok:
            raise StoreProblem(f"{where}: candidate field {name!r} has a wrong value ({value!r})")
    return CandidateTiming(**raw)


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value >= 0
