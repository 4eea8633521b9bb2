"""Everything `llmtrace flops` shows, as one frozen record: `asdict()` of it is the --json output."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from llmtrace.tracer.analytic import estimate
from llmtrace.tracer.analytic.kernels import DESCRIPTIONS, Kernels, parse_kernels
from llmtrace.tracer.analytic.model_dims import ModelDims
from llmtrace.tracer.analytic.moe import MoeSummary
from llmtrace.tracer.analytic.params import ParamCount, count_params, weight_bytes_by_dtype
from llmtrace.tracer.checkpoint.resolve import ResolvedModel
from llmtrace.tracer.core.dtypes import FP16, DType
from llmtrace.tracer.core.errors import BadArgumentError

if TYPE_CHECKING:
    from llmtrace.tracer.checkpoint.weights_summary import WeightsSummary

# /2: `kernels` added; Totals.arithmetic_intensity is FLOPs / all bytes moved (was / weights + KV, now
# weights_kv_intensity), arithmetic_intensity_with_activations removed, peak_activation_bytes added.
FLOPS_SCHEMA = "llmtrace.flops/2"


# Output records, read field by field and through asdict(): eq=False and repr=False spare compiling __eq__,
# __hash__ and __repr__ for each at import, which the analytical commands (answering in a blink) feel.
@dataclass(frozen=True, slots=True, eq=False, repr=False)
class ModelShape(ModelDims):
    """The model's key dimensions (ModelDims), then where its config came from."""

    source: str


@dataclass(frozen=True, slots=True, eq=False, repr=False)
class FlopsReport:
    schema: str
    model: ModelShape
    params: ParamCount
    weight_bytes: dict[str, int]  # every dtype llmtrace knows -> bytes of all weights in it
    checkpoint: WeightsSummary | None  # what the file on disk holds (None for a preset)
    weights_dtype: str
    weights_dtype_from: str  # "option" (--dtype), "file" (a GGUF: each tensor's stored bytes, weights_dtype its main
    # type), "checkpoint" (its main dtype), or "default" (fp16)
    kv_dtype: str
    activation_dtype: str
    kernels: str  # "eager" | "fused": the kernel model the FLOPs and bytes are costed under
    kernels_description: str
    batch: int
    prompt_len: int
    prompt_tokenizer: str | None  # the tokenizer file that counted --prompt, None when --prompt-len was given
    new_tokens: int
    decode_context: int  # L: positions cached before the decode step shown
    prefill: estimate.PhaseEstimate
    decode: estimate.PhaseEstimate
    generation: estimate.GenerationEstimate
    # A mixture of experts' routing: the experts a decode step reads at several batch sizes; None for a dense FFN.
    moe: MoeSummary | None
    # The "2 x parameters FLOPs per token" rule of thumb against the exact count (per sequence of the batch), with
    # the active parameters of a mixture of experts (those a token's pass multiplies by).
    two_x_params: int
    decode_step_flops_per_token: float  # the decode step shown, divided by the batch
    decode_vs_rule: float  # decode_step_flops_per_token / two_x_params
    generation_flops_per_token: float  # the whole generation / tokens fed through the model (P + N - 1)
    generation_vs_rule: float


def default_weights_dtype(model: ResolvedModel) -> tuple[DType, str]:
    """The checkpoint's own dtype where llmtrace.tracer.core.dtypes has its exact layout, else fp16; and where it
    came from: "file" for a GGUF, whose every tensor is then costed at its stored size (weights_as_stored: a
    Q8_0 embedding, Q4_K_M's Q6_K layers), as `run --weights stored` reads them; else "checkpoint" or "default"."""
    exact = model.weights.llmtrace_dtype if model.weights is not None else None
    if exact is None:
        return FP16, "default"
    return exact, "file" if weights_as_stored(model) else "checkpoint"


def weights_as_stored(model: ResolvedModel) -> tuple[tuple[str, int, int], ...]:
    """A GGUF's tensors with their stored bytes, (contract name, bytes, values) each; () for other checkpoints."""
    return model.weights.stored if model.weights is not None else ()


def flops_report(
    model: ResolvedModel, prompt_len: int, new_tokens: int, weights: DType | None = None, kv: DType | None = None,
    batch: int = 1, decode_context: int | None = None, prompt_tokenizer: str | None = None,
    kernels: str | Kernels = Kernels.FUSED,
) -> FlopsReport:
    """weights None: the checkpoint's dtype (default_weights_dtype). kernels: "fused" (what inference engines run,
    the default without a hardware profile) or "eager" (what llmtrace's own model runs)."""
    kernels = parse_kernels(kernels)
    cfg = model.config
    weights, weights_from = (weights, "option") if weights is not None else default_weights_dtype(model)
    dtypes = estimate.Dtypes.for_weights(weights, kv, weights_as_stored(model) if weights_from == "file" else ())
    context = prompt_len if decode_context is None else decode_context
    if context < 0:
        raise BadArgumentError(f"decode context must be >= 0, got {context}")
    pre = estimate.prefill(cfg, prompt_len, dtypes, batch, kernels)
    step = estimate.decode_step(cfg, context, dtypes, batch, kernels)
    gen = estimate.generation(cfg, prompt_len, new_tokens, dtypes, batch, prefill_estimate=pre, kernels=kernels)
    params = count_params(cfg)
    two_x = 2 * params.active
    step_per_token = step.totals.total_flops / batch
    gen_per_token = gen.totals.total_flops / (batch * (prompt_len + new_tokens - 1))
    return FlopsReport(
        schema=FLOPS_SCHEMA, model=ModelShape.of(cfg, source=cfg.source), params=params, weight_bytes=weight_bytes_by_dtype(cfg),
        checkpoint=model.weights,
        weights_dtype=dtypes.weights.name, weights_dtype_from=weights_from, kv_dtype=dtypes.kv.name,
        activation_dtype=dtypes.activations.name, kernels=kernels.value, kernels_description=DESCRIPTIONS[kernels],
        batch=batch, prompt_len=prompt_len, prompt_tokenizer=prompt_tokenizer, new_tokens=new_tokens,
        decode_context=context, prefill=pre, decode=step, generation=gen,
        moe=estimate.moe_reads(cfg, context, dtypes, batch, kernels, step),
        two_x_params=two_x, decode_step_flops_per_token=step_per_token, decode_vs_rule=step_per_token / two_x,
        generation_flops_per_token=gen_per_token, generation_vs_rule=gen_per_token / two_x,
    )
