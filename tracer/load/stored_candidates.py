"""A GGUF's stored-precision kernels as `llmtrace tune`'s candidates (tracer/load/kernel_pick.py; the rule:
tracer/hardware/kernel_choice.py).

- `kernels_for`: the stored kernels that run EVERY matrix of the file as stored (weight_formats.stored_kernels of
  each matrix's ggml type, in that function's order); a kernel that runs only some would leave a mixed model, part
  dense, which is neither the file's bytes nor the dense baseline, so it is no candidate (`--weights <kernel>` still
  runs it, the rest dequantized). Any kernel weight_formats lists is measured with no change here.
- `StoredKernel`: product_timing's ProductKernel over the model's OWN blocks: layer 0's matrices (packed roles
  concatenated, as the fused path multiplies them) and the LM head, packed from the file once; the layer is copied
  (a memcpy of the packed tensors) as often as the dense candidates copy their random layers, so a decode pass
  streams the same amount instead of sitting in the CPU's caches. Products go through `PackedWeight.__call__`, the
  call the model makes. `release()` drops every packed copy once timed: nothing stays resident beside the model.
- `probe_errors`: the accuracy probe of kernel_choice's rule: each candidate short of the bits a block format needs
  multiplies PROBE_ROWS seeded standard-normal rows by the model's own matrices of that format (the first
  PROBE_MATRICES of it in the file's order; of each, its first PROBE_OUTPUTS output rows), against the same rows
  times the exactly dequantized values in fp64.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch

from llmtrace.tracer.checkpoint.gguf_header import GGUFHeader
from llmtrace.tracer.core import contract
from llmtrace.tracer.core.config import ModelConfig
from llmtrace.tracer.hardware import kernel_choice as rule
from llmtrace.tracer.hardware.product_timing import ProductShape
from llmtrace.tracer.load.gguf_loader import exact_rows, matrix_infos, pack_matrices
from llmtrace.tracer.load.stored_weights import kernel_plan
from llmtrace.tracer.model.weight_formats import PackedWeight, concat_rows, stored_kernels

PROBE_MATRICES = 2  # matrices of each format a probe multiplies (the LM head is often the only Q8_0 one)
PROBE_OUTPUTS = 4096  # each probed matrix's first output rows compared (a 7B head's 32,000 in fp64 would be 1 GB)
PROBE_SEED = 0


def kernels_for(header: GGUFHeader, config: ModelConfig, device_type: str = "cpu") -> tuple[str, ...]:
    """The stored kernels that run every matrix of the file as stored on a `device_type` device, in stored_kernels'
    order."""
    infos = matrix_infos(header, config)
    if not infos:
        return ()
    each = [stored_kernels(info.ggml_type, device_type) for info in infos.values()]
    return tuple(k for k in each[0] if all(k in kernels for kernels in each[1:]))


def head_name(config: ModelConfig) -> str:
    """The LM head's matrix as the loader names it (the embedding's when tied)."""
    return "tok_embeddings.weight" if config.tie_embeddings else "output.weight"


def role_names(config: ModelConfig) -> dict[str, tuple[str, ...]]:
    """{product role (product_timing.ProductShape.role): the Meta names of its matrices}: layer 0's for the
    per-layer roles (packed roles list their members), the LM head's for the step's."""
    roles = {}
    for spec in contract.fused_stages(config):
        if spec.kind == "lm_head":
            roles[spec.role] = (head_name(config),)
        elif spec.kind == "linear":
            roles[spec.role] = tuple(f"layers.0.{m.tensors[0].name}" for m in spec.members)
    return roles


class StoredKernel:
    """`kernel` over the model's own stored blocks (see the module docstring); activations in fp32."""

    weights = rule.STORED
    dtype = rule.STORED_ACTIVATIONS

    def __init__(self, header: GGUFHeader, config: ModelConfig, kernel: str) -> None:
        """`kernel`: a stored kernel's name, or a kernel per type ("Q4_1:int4pack,Q8_0:blocks")."""
        self.name = kernel
        self.decode_variants = (kernel,)
        self._header, self._config = header, config
        self._roles = role_names(config)
        self._members: dict[str, list[PackedWeight]] | None = None  # {role: its matrices, packed from the file}
        self._handed: set[str] = set()

    def _weights(self) -> dict[str, list[PackedWeight]]:
        if self._members is None:
            names = sorted({n for members in self._roles.values() for n in members})
            packed = pack_matrices(self._header, self._config, names, kernel_plan(self.name))
            self._members = {role: [packed[n] for n in names_]  # type: ignore[misc]
                             for role, names_ in self._roles.items()}
        return self._members

    def prepare(self, shape: ProductShape, generator: torch.Generator, device: str) -> Any:
        members = self._weights()[shape.role]
        if shape.role in self._handed:  # the first request of a role gets the sample itself, later ones copies
            members = [_copy(w) for w in members]
        self._handed.add(shape.role)
        members = [w.to(device) for w in members]  # packed on the CPU; the products run where they are timed
        weight = _combined(members)
        for w in weight if isinstance(weight, tuple) else (weight,):
            _make_layout(w)
        return weight

    def nbytes(self, weight: Any) -> int:
        """The bytes a product reads as stored (the GGUF's bytes for the matrix)."""
        return sum(w.stored_bytes for w in weight) if isinstance(weight, tuple) else weight.stored_bytes

    def matvec(self, variant: str, weight: Any, x: torch.Tensor) -> torch.Tensor:
        return self.matmul(weight, x)

    def matmul(self, weight: Any, x: torch.Tensor) -> torch.Tensor:
        if isinstance(weight, tuple):  # a packed role whose members differ in format: one product each
            return torch.cat([w(x) for w in weight], dim=-1)
        return weight(x)

    def release(self) -> None:
        self._members, self._handed = None, set()


def _make_layout(weight: PackedWeight) -> None:
    """Build the kernel's own layout now (int4pack repacks on first use), so the set-up is not timed as a product:
    a first pass that slow would otherwise be taken as the figure itself (product_timing._best's SLOW_WARMUP)."""
    weight(torch.zeros(1, weight.in_features, device=weight.device))


def _combined(members: list[PackedWeight]) -> PackedWeight | tuple[PackedWeight, ...]:
    """A packed role's matrices as the fused path multiplies them: one concat_rows product where the kernel can
    stack them, else one product each."""
    if len(members) == 1:
        return members[0]
    try:
        return concat_rows(members)
    except ValueError:  # formats differ and the kernel cannot stack them
        return tuple(members)


def _copy(weight: PackedWeight) -> PackedWeight:
    """A second copy of the stored tensors (its kernel layout made again on first use)."""
    return PackedWeight(weight.format, weight.shape, {k: t.clone() for k, t in weight.tensors.items()},
                        weight.stored_bytes)


ProductFn = Callable[[str, torch.Tensor], torch.Tensor]  # (matrix name, x fp32 (R, K)) -> (R, N)


def probe_errors(header: GGUFHeader, config: ModelConfig, wanted: dict[str, Sequence[str]], device: str = "cpu"
                 ) -> dict[str, dict[str, float]]:
    """{candidate: {format: relative product error}} for `wanted` {candidate: formats to probe}; a candidate is a
    dense dtype name ("bf16") or a stored kernel's name. The error of a format is the worst over its probed
    matrices (see the module docstring and kernel_choice's rule). The candidates' products run on `device` (a
    kernel's rounding is its device's: CUDA's int4 kernel dequantizes in bf16), the fp64 reference on the CPU."""
    infos = matrix_infos(header, config)
    by_format: dict[str, list[str]] = {}
    for name, info in infos.items():
        by_format.setdefault(info.type_name, []).append(name)
    formats = sorted({f for fs in wanted.values() for f in fs})
    out: dict[str, dict[str, float]] = {c: {} for c in wanted}
    generator = torch.Generator().manual_seed(PROBE_SEED)
    for fmt in formats:
        names = by_format.get(fmt, [])[:PROBE_MATRICES]
        if not names:
            continue
        exact = {n: exact_rows(header, config, n, PROBE_OUTPUTS) for n in names}  # fp32, the file's values
        rows = {n: torch.randn(rule.PROBE_ROWS, exact[n].shape[1], generator=generator, dtype=torch.float64)
                for n in names}
        reference = {n: rows[n] @ exact[n].double().t() for n in names}
        for candidate, probed_formats in wanted.items():
            if fmt not in probed_formats:
                continue
            if candidate in rule.COMPUTE_BITS:  # a dense dtype: values and activations rounded to it
                values = torch.float32 if candidate == "fp32" else getattr(torch, _TORCH[candidate])
                product: ProductFn = (  # type: ignore[misc]
                    lambda n, x, v=values: (x.to(device, v)
                                            @ exact[n].to(device, v).t()).cpu().double())  # type: ignore[union-attr]
            else:
                packed = pack_matrices(header, config, names, candidate)
                product = lambda n, x, p=packed: (  # type: ignore[misc]  # the probed outputs of all
                    p[n].to(device)(x.to(device))[:, :PROBE_OUTPUTS].cpu().double())  # type: ignore[union-attr]
            worst = 0.0
            for n in names:
                err = float(torch.linalg.vector_norm(product(n, rows[n].float()) - reference[n])
                            / torch.linalg.vector_norm(reference[n]))
                worst = max(worst, err) if err == err else float("nan")
            out[candidate][fmt] = worst
    return out


_TORCH = {"fp16": "float16", "bf16": "bfloat16"}

