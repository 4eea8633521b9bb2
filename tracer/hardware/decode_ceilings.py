"""Decode ceilings measured at the shapes decode runs: what this machine's real kernels take for one decode step of
one model, per batch. Records and their store; pure Python (no torch), so the analytical roofline reads them.

Why they exist: the roofline's `this-machine` ceilings are a memory copy's bandwidth and a square GEMM's FLOP/s
(measure.py), and no decode kernel reaches either. On the AVX2 EPYC of BENCHMARKS.md "Batching", fp32 `mv` streams
weights at 0.38 of copy bandwidth, the skinny matrix products of batches 2-32 at 0.13-0.18 of it, and the ~1,600
small tensor operations of a step add tens of milliseconds that neither ceiling sees. So for each batch the
measurement (tracer/run/decode_measure.py, made by `llmtrace run --batch-sweep`) keeps:
- each weight product's time at (batch M, N, K), through the model's own product call (PackedWeight.__call__ /
  functional.project: whatever kernel the run uses, dense fp32/fp16/bf16 or a stored one), timed over every
  layer's matrix in turn so the weights stream from memory as in a real step;
- the step's other tensor operations: how many (counted on a real decode step by a dispatch counter) and the time
  of the step with its products taken out, so the time per operation is measured, not assumed.
The prediction built on them is llmtrace.tracer.roofline.kernel_decode.

Stored in `decode_kernels.json` beside hardware.json and kernels.json, one entry per (machine, model shapes, weights):
the machine is product_timing.machine_key (CPU model, torch version, CPU capability, threads), so a new torch or
another thread count measures again; the model shapes are `shapes_key` (every product's rows x cols and the layer
count). A damaged file or entry is one DecodeCeilingsProblem; the roofline then says so in one note and uses the
copy + GEMM ceilings, and the next sweep replaces the file (read and saved by tracer/core/json_store.py).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any

from llmtrace.tracer.core.config import ModelConfig
from llmtrace.tracer.core.errors import HardwareError
from llmtrace.tracer.core.json_store import StoreFormat, read_store, write_store
from llmtrace.tracer.hardware.product_shapes import product_shapes
from llmtrace.tracer.hardware.store import config_dir

STORE_VERSION = 1
DENSE_PREFIX = "dense "  # weights key of a dense run: "dense fp32"
STORED = "stored"  # weights key of a run multiplying a GGUF's matrices as stored (--weights stored)


class DecodeCeilingsProblem(HardwareError):
    """The saved decode ceilings could not be read back; the message names the file and what was wrong."""


# The caller (roofline/measured_decode.py) says what to do: measure again with `run --batch-sweep`.
STORE = StoreFormat("decode-ceilings store", STORE_VERSION, ("entries",), DecodeCeilingsProblem, HardwareError)


@dataclass(frozen=True, slots=True)
class ProductTime:
    """One weight product of a decode step at one batch."""

    role: str  # "attention.wqkv", "attention.wo", "feed_forward.w13", "feed_forward.w2", "output"
    rows: int  # N: output features
    cols: int  # K: input features
    per_layer: bool  # called once per layer (False: once per step, the LM head)
    seconds: float  # one call, (batch, K) @ (K, N): best pass over every layer's matrix, divided by the layers


@dataclass(frozen=True, slots=True)
class BatchCeilings:
    """Everything measured at one batch."""

    batch: int
    products: tuple[ProductTime, ...]
    ops: int  # tensor operations of one decode step other than the weight products (aten ops, views included)
    other_seconds: float  # median decode step with its weight products taken out: those ops' time
    context: int  # positions each sequence attended in the steps `other_seconds` timed (their median)

    @property
    def op_seconds(self) -> float:
        """Measured time per non-product operation at this batch."""
        return self.other_seconds / self.ops if self.ops else 0.0


@dataclass(frozen=True, slots=True)
class DecodeCeilings:
    """One model's decode kernels measured on one machine, at several batches."""

    machine: str  # product_timing.machine_key: device|CPU model|torch|capability|threads
    device_name: str  # CPU model or GPU name (what the analytical side matches without torch)
    shapes: str  # shapes_key(config)
    weights: str  # "dense fp32" (dense_key) or "stored"
    formats: str  # the product weights' formats as run: "fp32", "q4_1 (int4pack)+q8_0 (int4pack)"
    compute_dtype: str  # activations and KV cache dtype of the run ("fp32")
    n_layers: int
    memory_bandwidth: float  # bytes/s (the machine's copy figure): attention/KV bytes beyond the measured context
    measured_at: str  # ISO 8601 UTC
    batches: tuple[BatchCeilings, ...]  # increasing batch

    @property
    def batch_sizes(self) -> tuple[int, ...]:
        return tuple(b.batch for b in self.batches)


def dense_key(dtype: str) -> str:
    return DENSE_PREFIX + dtype


def shapes_key(config: ModelConfig) -> str:
    """The model shape measured ceilings are for: each product's rows x cols (per layer or per step), the layers."""
    products = ",".join(f"{s.role}:{s.rows}x{s.cols}{'/layer' if s.per_layer else ''}" for s in product_shapes(config))
    return f"{config.n_layers} layers|{products}"


def ceilings_path() -> Path:
    return config_dir() / "decode_kernels.json"


# Where the CPU's name is read (tests point it at a file of their own, tests/conftest.py: one reader for every
# place that shows or keys on the name, so that no test depends on the machine it runs on).
CPUINFO = "/proc/cpuinfo"


def this_cpu_name() -> str:
    """The CPU's model name from /proc/cpuinfo ("" when there is none to read), without torch."""
    try:
        with open(CPUINFO, encoding="utf-8", errors="replace") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


# ---- the store ----------------------------------------------------------------------------------------------


def entry_key(ceilings: DecodeCeilings) -> str:
    return f"{ceilings.machine}||{ceilings.shapes}||{ceilings.weights}"


def save_ceilings(ceilings: DecodeCeilings, path: Path | None = None) -> Path:
    """Add or replace the entry for this machine, model shape and weights; a damaged file is replaced, the other
    entries of a sound one kept. HardwareError when the folder cannot be written."""
    path = path or ceilings_path()
    try:
        data = read_store(path, STORE)
    except DecodeCeilingsProblem:
        data = STORE.empty()
    data["entries"][entry_key(ceilings)] = asdict(ceilings)
    return write_store(path, data, STORE, "the decode ceilings")


def load_ceilings(device_name: str, shapes: str, weights: str, path: Path | None = None) -> DecodeCeilings | None:
    """The latest entry measured on a device called `device_name` for these shapes and weights; None when there is
    none. Every entry of the file is checked, so a damaged one is a DecodeCeilingsProblem, not a wrong figure."""
    path = path or ceilings_path()
    found = [_ceilings_from(raw, f"{path}: entry {key!r}") for key, raw in read_store(path, STORE)["entries"].items()]
    matching = [c for c in found if c.device_name == device_name and c.shapes == shapes and c.weights == weights]
    return max(matching, key=lambda c: c.measured_at) if matching else None


def _ceilings_from(raw: Any, where: str) -> DecodeCeilings:
    expected = {f.name for f in fields(DecodeCeilings)}
    if not isinstance(raw, dict) or set(raw) != expected:
        raise DecodeCeilingsProblem(f"{where} is malformed (not an object with the ceilings' fields)")
    for name in ("machine", "device_name", "shapes", "weights", "formats", "compute_dtype", "measured_at"):
        if not isinstance(raw[name], str):
            raise DecodeCeilingsProblem(f"{where}: {name!r} is not text ({raw[name]!r})")
    if not _count(raw["n_layers"]):
        raise DecodeCeilingsProblem(f"{where}: 'n_layers' must be a positive integer, got {raw['n_layers']!r}")
    if not _positive(raw["memory_bandwidth"]):
        raise DecodeCeilingsProblem(f"{where}: 'memory_bandwidth' must be a positive number")
    if not isinstance(raw["batches"], list) or not raw["batches"]:
        raise DecodeCeilingsProblem(f"{where}: 'batches' must be a non-empty list")
    batches = tuple(_batch_from(b, where) for b in raw["batches"])
    sizes = [b.batch for b in batches]
    if sizes != sorted(set(sizes)):
        raise DecodeCeilingsProblem(f"{where}: batches are not increasing ({sizes})")
    values = {k: v for k, v in raw.items() if k != "batches"}
    return DecodeCeilings(batches=batches, **values)


def _batch_from(raw: Any, where: str) -> BatchCeilings:
    expected = {f.name for f in fields(BatchCeilings)}
    if not isinstance(raw, dict) or set(raw) != expected:
        raise DecodeCeilingsProblem(f"{where}: a batch is malformed")
    if not (_count(raw["batch"]) and _count(raw["context"]) and _count(raw["ops"], zero=True)):
        raise DecodeCeilingsProblem(f"{where}: a batch's 'batch', 'context' or 'ops' is not a count")
    if not _positive(raw["other_seconds"], zero=True):
        raise DecodeCeilingsProblem(f"{where}: batch {raw['batch']}'s 'other_seconds' is not a time")
    if not isinstance(raw["products"], list) or not raw["products"]:
        raise DecodeCeilingsProblem(f"{where}: batch {raw['batch']} has no products")
    products = []
    product_fields = {f.name for f in fields(ProductTime)}
    for p in raw["products"]:
        ok = (isinstance(p, dict) and set(p) == product_fields and isinstance(p["role"], str)
              and _count(p["rows"]) and _count(p["cols"]) and isinstance(p["per_layer"], bool)
              and _positive(p["seconds"]))
        if not ok:
            raise DecodeCeilingsProblem(f"{where}: batch {raw['batch']} has a malformed product")
        products.append(ProductTime(**p))
    return BatchCeilings(batch=raw["batch"], products=tuple(products), ops=raw["ops"],
                         other_seconds=float(raw["other_seconds"]), context=raw["context"])


def _count(value: Any, zero: bool = False) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and (value >= 0 if zero else value > 0)


def _positive(value: Any, zero: bool = False) -> bool:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    return ok and (value >= 0 if zero else value > 0)


def combine(measurements: list[DecodeCeilings]) -> DecodeCeilings:
    """Several measurements of one model on one machine (a sweep measures each batch once per round, between its
    generations, so machine noise lands on measurement and prediction alike) as one: per batch, each product's and
    the other operations' median time over the measurements of that batch; the latest's identity and date."""
    if not measurements:
        raise ValueError("nothing to combine")
    by_batch: dict[int, list[BatchCeilings]] = {}
    for m in measurements:
        for entry in m.batches:
            by_batch.setdefault(entry.batch, []).append(entry)
    batches = []
    for batch in sorted(by_batch):
        entries = by_batch[batch]
        first = entries[0]
        products = tuple(
            ProductTime(p.role, p.rows, p.cols, p.per_layer,
                        statistics.median(e.products[i].seconds for e in entries))
            for i, p in enumerate(first.products))
        batches.append(BatchCeilings(
            batch=batch, products=products, ops=first.ops,
            other_seconds=statistics.median(e.other_seconds for e in entries),
            context=round(statistics.median(e.context for e in entries))))
    latest = max(measurements, key=lambda m: m.measured_at)
    return replace(latest, batches=tuple(batches))
