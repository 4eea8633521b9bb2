"""A roofline report of this machine with its decode predicted from kernels measured at decode shapes, where this
machine has them for the model (tracer/hardware/decode_ceilings.py, saved by `llmtrace run --batch-sweep`). Pure
Python: the analytical `roofline` only reads the saved figures.

The entry must be for this CPU (its model name; the entry also records the torch version and thread count it was
measured with), the model's product shapes, and the weights as costed: a GGUF costed as stored takes a "stored"
entry, an explicit --dtype fp32/fp16/bf16 a "dense" one. A damaged store is one note, and the report keeps the copy
+ GEMM figures.
"""

from __future__ import annotations

from dataclasses import replace

from llmtrace.tracer.core.config import ModelConfig
from llmtrace.tracer.core.dtypes import COMPUTE_DTYPES, DType
from llmtrace.tracer.hardware.decode_ceilings import (
    STORED,
    DecodeCeilings,
    DecodeCeilingsProblem,
    dense_key,
    load_ceilings,
    shapes_key,
    this_cpu_name,
)
from llmtrace.tracer.hardware.profiles import HardwareProfile
from llmtrace.tracer.roofline.analysis import RooflineReport
from llmtrace.tracer.roofline.kernel_decode import MEASURED_KERNELS, kernel_decode

SWEEP_HINT = "`llmtrace run --batch-sweep 1,2,4,8,16,32,64` measures them"


def weights_key(weights: DType, weights_from: str) -> str | None:
    """The decode-ceilings entry a roofline's weights correspond to; None when none can (int8/int4 as a dtype)."""
    if weights_from == "file":
        return STORED
    return dense_key(weights.name) if weights in COMPUTE_DTYPES else None


def find_ceilings(config: ModelConfig, hardware: HardwareProfile, weights: DType,
                  weights_from: str) -> tuple[DecodeCeilings | None, str]:
    """The saved ceilings for this report, or None and (when something is wrong with the store) a note."""
    key = weights_key(weights, weights_from)
    if not hardware.measured or key is None:
        return None, ""
    try:
        return load_ceilings(this_cpu_name(), shapes_key(config), key), ""
    except DecodeCeilingsProblem as exc:
        return None, f"decode ceilings not used: {exc}; {SWEEP_HINT} again"


def with_measured_kernels(report: RooflineReport, config: ModelConfig, ceilings: DecodeCeilings | None,
                          note: str = "") -> RooflineReport:
    """`report` with `kernel_decode` from `ceilings` (None: unchanged but for `note`)."""
    if ceilings is None:
        return replace(report, notes=report.notes + (note,)) if note else report
    g = report.generation
    decode = kernel_decode(ceilings, config, g.batch, g.prompt_len, g.new_tokens,
                           [row.batch for row in report.batch_table], report.table_kv_len)
    if decode is None:
        return report
    return replace(report, decode_ceilings=MEASURED_KERNELS, kernel_decode=decode)


def measured_roofline(report: RooflineReport, config: ModelConfig, hardware: HardwareProfile, weights: DType,
                      weights_from: str) -> RooflineReport:
    """find_ceilings then with_measured_kernels: what `llmtrace roofline` shows for a measured profile."""
    ceilings, note = find_ceilings(config, hardware, weights, weights_from)
    return with_measured_kernels(report, config, ceilings, note)
