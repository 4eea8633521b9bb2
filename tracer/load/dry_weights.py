"""A dry run's matrices counted as `run` would hold them: a GGUF's stored bytes under the run's kernels.

`run --dry-run` builds the model on the meta device in the compute dtype, so every matrix would count as a dense
tensor of that dtype (a 7B Q4_0 file: 26.7 GB of fp32 read per pass, where the run reads the 3.87 GB stored). The
matrices the run's kernel plan holds as stored (gguf_loader.stored_matrices: the same split the real load makes)
are marked with their stored bytes and format label (Linear.held_as / Embedding.held_as), which the trace's byte
counts take (tracer/trace/stage_cost.py); the others stay dense in the compute dtype, as the run dequantizes them.
"""

from __future__ import annotations

from llmtrace.tracer.checkpoint.gguf_header import GGUFHeader
from llmtrace.tracer.core.config import ModelConfig
from llmtrace.tracer.load.gguf_loader import KernelPlan, held_kernel, kernel_of, matrix_infos, stored_matrices
from llmtrace.tracer.model.transformer import Transformer
from llmtrace.tracer.model.weight_formats import gguf_format


def held_as_stored(header: GGUFHeader, config: ModelConfig, plan: KernelPlan) -> dict[str, tuple[int, str]]:
    """{Meta name: (stored bytes, format label)} of the matrices `plan` runs as stored."""
    infos = matrix_infos(header, config)
    packable, _ = stored_matrices(header, config, plan)
    out = {}
    for name in packable:
        info = infos[name]
        kernel = kernel_of(plan, info)
        assert kernel is not None  # stored_matrices keeps only matrices with a kernel
        out[name] = (info.n_bytes, gguf_format(info.ggml_type, held_kernel(name, config, kernel)).label)
    return out


def hold_as_stored(model: Transformer, header: GGUFHeader, plan: KernelPlan) -> None:
    """Mark `model`'s (a meta model of the file's config) matrices that `plan` holds as stored."""
    for name, held in held_as_stored(header, model.config, plan).items():
        model.get_submodule(name.removesuffix(".weight")).held_as = held  # type: ignore[union-attr]
    if model.config.tie_embeddings:
        model.output.held_as = model.tok_embeddings.held_as
