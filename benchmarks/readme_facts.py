"""README.md's tables and the figures its prose quotes, made by the program itself (benchmarks/readme_examples.py
writes them into README.md between markers and checks them there).

A figure in README's prose sits between two comments that name it:

    five characters become <!-- fact: run.tokens -->12<!-- /fact --> tokens

and a generated table between `<!-- fact: table.loads -->` and `<!-- /fact -->` on lines of their own. Every fact is
a function below, computed from:
- the traces committed in tests/data/ (a real run of the bundled model, recorded by `--record`: the same on every
  machine once recorded, so the check is too);
- the program's own registries and functions (the architectures the config readers accept, the tensor types the
  GGUF reader decodes, the analytical estimates), each claim of a table tried on the readers themselves.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any, Callable

REPO = Path(__file__).resolve().parent.parent
RUN_TRACE = REPO / "tests" / "data" / "readme_run.trace.json.gz"
LENS_TRACE = REPO / "tests" / "data" / "readme_lens.trace.json.gz"
# How the committed traces are recorded (`python -m benchmarks.readme_examples --record`): the run the README walks
# through, and a run of the 'capital' sample prompt with the logit lens and attention.
RUN_COMMAND = ["run", "今天天气真", "--max-new-tokens", "32", "--trace-steps", "first,last", "--no-roofline",
               "--json-file", str(RUN_TRACE.relative_to(REPO))]
LENS_COMMAND = ["run", "capital", "--lens", "--attention", "--max-new-tokens", "1", "--temperatures", "",
                "--no-roofline", "--json-file", str(LENS_TRACE.relative_to(REPO))]


@functools.cache
def _trace(path: Path) -> Any:
    from llmtrace.cli.cmd_show import read_trace

    return read_trace(path)


@functools.cache
def _report(path: Path) -> Any:
    from llmtrace.tracer.trace.report import run_report

    return run_report(_trace(path))


def _run() -> Any:
    return _trace(RUN_TRACE)


def _lens() -> Any:
    return _trace(LENS_TRACE)


# ---- the walkthrough's run (tests/data/readme_run.trace.json.gz) -------------------------------------------------


def run_kernels() -> str:
    """The run's kernels: its stored kernels, or its dense dtype (a trace recorded before the default kernel table
    reads as no choice: it ran dense in its dtype)."""
    choice = _run().kernels
    if choice is None:
        names = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}
        return f"{names.get(_run().environment.dtype, _run().environment.dtype)} dense"
    from llmtrace.tracer.hardware.kernel_choice import STORED

    if choice.weights == STORED:
        return f"`{choice.picked}` over the file's blocks as stored, {choice.dtype} activations"
    return f"{choice.dtype} dense"


def run_recorded_on() -> str:
    """Where the run was recorded."""
    env = _run().environment
    return f"{env.device_name}, {env.threads} threads"


def run_chars() -> str:
    return str(len(_run().tokenization.model_text))


def run_utf8() -> str:
    return str(len(_run().tokenization.model_text.encode("utf-8")))


def run_tokens() -> str:
    return str(len(_run().tokenization.ids))


def run_embedding_table() -> str:
    from llmtrace.cli import formatting as fmt
    from llmtrace.cli.render_run import embedding_table
    from llmtrace.tracer.trace.records import PREFILL

    trace = _run()
    embed = next(s for s in trace.stages_of(PREFILL) if s.kind == "embedding")
    held, size = embedding_table(trace.config, embed)
    return f"{fmt.nbytes(size)} table ({held})"


def _prefill_stages(path: Path, layer0: bool) -> str:
    """Stage records of a committed trace's prefill: a layer's (layer 0), or all of them."""
    from llmtrace.tracer.trace.records import PREFILL

    return str(sum(1 for s in _trace(path).stages_of(PREFILL) if not layer0 or s.layer == 0))


def run_head_matrix() -> str:
    config = _run().config
    return f"{config.vocab_size} × {config.dim}"


def run_kv_per_token() -> str:
    """The KV cache's growth per token: the formula with the run's numbers, and its value."""
    from llmtrace.cli import formatting as fmt

    trace = _run()
    config = trace.config
    width = {"float32": 4, "float16": 2, "bfloat16": 2}[trace.environment.dtype]
    total = 2 * config.n_layers * config.n_kv_heads * config.head_dim * width
    return (f"2 × {config.n_layers} layers × {config.n_kv_heads} KV heads × {config.head_dim} × {width} bytes = "
            f"{fmt.nbytes(total)}")


def run_weight_products_share() -> str:
    from llmtrace.cli import formatting as fmt

    stages = _report(RUN_TRACE).decode_stages
    return fmt.share(stages.weight_products_ns_per_step, stages.forward_ns_per_step)


def run_decode_intensity() -> str:
    from llmtrace.cli import formatting as fmt

    return fmt.intensity(_report(RUN_TRACE).summary.decode.arithmetic_intensity)


def kept_marks() -> str:
    """The `kept` cell of a candidate each filter dropped, as section 5 prints it."""
    from llmtrace.cli.render_run import _kept_cell
    from llmtrace.tracer.trace.records import CandidateRecord

    def dropped_by(k: bool, p: bool, m: bool) -> str:
        cand = CandidateRecord(token_id=0, piece="", logit=0.0, logit_penalized=0.0, prob_raw=0.0,
                               prob_tempered=0.0, kept_top_k=k, kept_top_p=p, kept_min_p=m, prob_final=0.0)
        return f"`{_kept_cell(cand)}`"

    return " / ".join((dropped_by(False, False, False), dropped_by(True, False, False), dropped_by(True, True, False)))


# ---- the lens and attention run (tests/data/readme_lens.trace.json.gz) -------------------------------------------


def _lens_step() -> Any:
    return _lens().lens[0]


def lens_piece() -> str:
    from llmtrace.cli import formatting as fmt

    return f'"{fmt.piece(_lens_step().piece).replace("·", " ")}"'


def lens_embed_rank() -> str:
    return f"{_lens_step().layers[0].chosen_rank:,}"


def lens_first_top() -> str:
    step = _lens_step()
    top = step.first_top_layer
    if top is None:
        return "never on top before the sampler"
    layer = next(x for x in step.layers if x.layer == top)
    last = len(step.layers) - 2
    where = "the last" if top == last else f"of layers 0-{last}"
    return f"first on top ({100 * layer.chosen_probability:.0f}%) after layer {top}, {where}"


def attention_sinks() -> str:
    from llmtrace.tracer.trace.attention_focus import sink_heads

    first = _lens().attention[0]
    return f"{len(sink_heads(first))} of {len(first.heads)}"


def attention_focused() -> str:
    """The most focused head that does not look at position 0, as section 5d and the HTML report rank them."""
    from llmtrace.cli import formatting as fmt
    from llmtrace.tracer.trace.attention_focus import focused_heads

    first = _lens().attention[0]
    h = focused_heads(first, 1)[0]
    piece = fmt.piece(first.pieces[h.top_positions[0]]).replace("·", " ")
    return f'layer {h.layer} head {h.head}, {100 * h.top_weights[0]:.0f}% on "{piece}"'


# ---- what loads: the readers' registries, each claim tried on the readers ----------------------------------------

# Architectures in no registry, refused by the readers' generic line (which lists what loads): each is tried.
UNKNOWN_HF = {"GPT2LMHeadModel": "gpt2", "FalconForCausalLM": "falcon"}
UNKNOWN_GGUF = ("gpt2", "falcon")


def _hf_config(arch: str, model_type: str = "", **extra: Any) -> dict[str, Any]:
    return {"architectures": [arch], "model_type": model_type, "vocab_size": 32, "hidden_size": 16,
            "num_hidden_layers": 1, "num_attention_heads": 2, "intermediate_size": 32, "num_local_experts": 4,
            "num_experts_per_tok": 2, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 64, **extra}


def _refusal(read: Callable[[], object]) -> str | None:
    """The one-line message `read` refuses with, None if it reads."""
    from llmtrace.tracer.core.errors import UnsupportedModelError

    try:
        read()
    except UnsupportedModelError as exc:
        return str(exc)
    return None


def _checked(claim: bool, what: str) -> None:
    if not claim:
        raise RuntimeError(f"README's table of what loads says {what}, and the readers disagree")


def _gguf_types() -> tuple[list[str], list[str], str]:
    """The GGUF tensor types the reader decodes and those it refuses (every type code llmtrace knows), and the
    installed gguf's version, which decides."""
    from importlib.metadata import version

    from llmtrace.tracer.core.errors import UnsupportedModelError
    from llmtrace.tracer.core.ggml_types import GGML_TYPES
    from llmtrace.tracer.load.gguf_dequant import check_decodable

    read, refused = [], []
    for code, (name, _, _) in GGML_TYPES.items():
        try:
            check_decodable(code, "t")
            read.append(name)
        except UnsupportedModelError:
            refused.append(name)
    return read, refused, version("gguf")


def table_loads() -> str:
    from llmtrace.tracer.checkpoint.gguf_tokenizer import SUPPORTED_PRE
    from llmtrace.tracer.core.config import ModelConfig
    from llmtrace.tracer.core.config_gguf import GGUF_ARCHITECTURES
    from llmtrace.tracer.core.config_hf import HF_ARCHITECTURES
    from llmtrace.tracer.core.refusals import REFUSALS

    for arch in HF_ARCHITECTURES:
        config = ModelConfig.from_hf_dict(_hf_config(arch))
        _checked(config.n_layers == 1, f"{arch} loads")
    biased = ModelConfig.from_hf_dict(_hf_config("LlamaForCausalLM", attention_bias=True, mlp_bias=True))
    _checked(biased.qkv_bias and biased.wo_bias and biased.mlp_bias, "LLaMA's attention_bias and mlp_bias load")
    qwen = ModelConfig.from_hf_dict(_hf_config("Qwen2ForCausalLM", "qwen2"))
    _checked(qwen.qkv_bias and not qwen.wo_bias, "Qwen2 has biases on Q, K and V")
    qwen3 = ModelConfig.from_hf_dict(_hf_config("Qwen3ForCausalLM", "qwen3"))
    _checked(qwen3.qk_norm and not qwen3.qkv_bias, "Qwen3 has QK-norm and no biases")
    phi3 = ModelConfig.from_hf_dict(_hf_config("Phi3ForCausalLM", "phi3", rope_scaling={
        "type": "longrope", "short_factor": [1.0] * 4, "long_factor": [2.0] * 4}))  # a head of 8: 4 frequencies
    _checked(phi3.rope_scaling is not None and phi3.rope_scaling.kind == "longrope", "Phi-3's LongRoPE is read")
    phi4 = ModelConfig.from_hf_dict(_hf_config("Phi3ForCausalLM", "phi3", partial_rotary_factor=0.5))
    _checked((phi4.head_dim, phi4.rotary_dim) == (8, 4), "Phi-4-mini's partial_rotary_factor is read")
    phi4_gguf = ModelConfig.from_gguf_metadata(
        {"general.architecture": "phi3", "phi3.block_count": 1, "phi3.embedding_length": 16,
         "phi3.feed_forward_length": 32, "phi3.attention.head_count": 2, "phi3.vocab_size": 32,
         "phi3.rope.dimension_count": 4}, "m", "m.gguf")
    _checked(phi4_gguf.rotary_dim == 4, "a 'phi3' GGUF's rope.dimension_count below its head of 8 is read")
    _checked(_refusal(lambda: ModelConfig.from_hf_dict(_hf_config("LlamaForCausalLM", rope_scaling={
        "type": "yarn", "factor": 2.0}))) is not None, "rope scaling 'yarn' is refused")
    for refusal in REFUSALS:  # every name of a refused family is refused, in one line naming what is missing
        for arch in refusal.hf:
            line = _refusal(lambda: ModelConfig.from_hf_dict(_hf_config(arch)))
            _checked(line is not None and "\n" not in line and refusal.missing in line, f"{arch} is refused")
        for model_type in refusal.model_types:
            line = _refusal(lambda: ModelConfig.from_hf_dict({**_hf_config(""), "architectures": [],
                                                              "model_type": model_type}))
            _checked(line is not None and refusal.missing in line, f"model type {model_type!r} is refused")
        for arch in refusal.gguf:
            line = _refusal(lambda: ModelConfig.from_gguf_metadata({"general.architecture": arch}, "m", "m.gguf"))
            _checked(line is not None and refusal.missing in line, f"GGUF {arch!r} is refused")
    for arch, model_type in UNKNOWN_HF.items():
        _checked(_refusal(lambda: ModelConfig.from_hf_dict(_hf_config(arch, model_type))) is not None,
                 f"{arch} is refused")
    for arch in UNKNOWN_GGUF:
        _checked(_refusal(lambda: ModelConfig.from_gguf_metadata({"general.architecture": arch}, "m", "m.gguf"))
                 is not None, f"GGUF {arch!r} is refused")
    mixtral = ModelConfig.from_hf_dict(_hf_config("MixtralForCausalLM", "mixtral"))
    _checked(mixtral.moe is not None and (mixtral.moe.n_experts, mixtral.moe.experts_per_token) == (4, 2)
             and qwen3.moe is None, "Mixtral has 4 experts, 2 per token; a dense model none")
    llama_moe = ModelConfig.from_gguf_metadata(
        {"general.architecture": "llama", "llama.block_count": 1, "llama.embedding_length": 16,
         "llama.feed_forward_length": 32, "llama.attention.head_count": 2, "llama.vocab_size": 32,
         "llama.expert_count": 4, "llama.expert_used_count": 2}, "m", "m.gguf")
    _checked(llama_moe.moe is not None and llama_moe.moe.n_experts == 4, "a 'llama' GGUF's experts are read")
    qwen3_moe = ModelConfig.from_hf_dict(_hf_config("Qwen3MoeForCausalLM", "qwen3_moe", moe_intermediate_size=8,
                                                    norm_topk_prob=True))
    _checked(qwen3_moe.qk_norm and qwen3_moe.ffn_dim == 8 and qwen3_moe.moe is not None
             and qwen3_moe.moe.router_norm == "renormalised", "Qwen3-MoE: QK-norm, its experts' width, renormalised")
    qwen2_moe = ModelConfig.from_hf_dict(_hf_config("Qwen2MoeForCausalLM", "qwen2_moe"))
    _checked(qwen2_moe.qkv_bias and qwen2_moe.shared_expert_dim == 64 and qwen2_moe.moe is not None
             and qwen2_moe.moe.router_norm == "softmax", "Qwen2-MoE: Q/K/V biases, a shared expert, the softmax's "
             "own weights")
    olmoe = ModelConfig.from_hf_dict(_hf_config("OlmoeForCausalLM", "olmoe"))
    _checked(olmoe.qk_norm_whole and olmoe.moe is not None and olmoe.moe.router_norm == "softmax",
             "OLMoE: QK-norm over the whole projections, the softmax's own weights")
    read, refused, gguf_version = _gguf_types()
    hf = ", ".join(f"`{a}` ({what})" for a, what in HF_ARCHITECTURES.items())
    gguf = ", ".join(f"`{a}` ({what})" for a, what in GGUF_ARCHITECTURES.items())
    rows = [
        "| | reads | refuses, and why |",
        "|---|---|---|",
        f"| HF architectures | {hf} | the families below, each naming what it needs; any other (e.g. "
        f"{', '.join(UNKNOWN_HF)}): one line listing what loads; rope scaling other than `llama3` and `longrope` |",
        f"| GGUF architectures | {gguf} | the families below; any other `general.architecture` (e.g. "
        f"{', '.join(f'`{a}`' for a in UNKNOWN_GGUF)}) |",
    ]
    for r in REFUSALS:
        names = ", ".join(f"`{a}`" for a in r.hf) + (f"; GGUF {', '.join(f'`{a}`' for a in r.gguf)}" if r.gguf else "")
        instead = f" ({r.instead})" if r.instead else ""
        rows.append(f"| {r.family} | no | {names}: needs {r.missing}{instead} |")
    rows += [
        f"| GGUF tensor types | every type the installed gguf ({gguf_version}) dequantizes: {', '.join(read)} | "
        f"{', '.join(refused)} (llama.cpp's intermediate formats, integer and F64 tensors, types this gguf cannot "
        "decode): the message says to use another quantization of the model or its HF folder |",
        "| safetensors dtypes | F32, BF16, F16 (converted to the run's dtype) | quantized safetensors (GPTQ, AWQ, "
        "bitsandbytes): their tensors are not the config's |",
        "| tokenizers | `tokenizer.json`, SentencePiece `tokenizer.model`; from GGUF: `llama` (SentencePiece) and "
        f"`gpt2` (byte-level BPE, pre-tokenizers {', '.join(f'`{p}`' for p in SUPPORTED_PRE)}) | other GGUF "
        "tokenizer types or pre-tokenizers |",
    ]
    return "\n".join(rows) + "\n"


def table_elementwise() -> str:
    """The elementwise estimate's constants (tracer/core/flop_formulas.py), each formula as written here checked
    against the function that counts it, at sizes where no two terms could stand in for each other."""
    from llmtrace.tracer.core import flop_formulas as f

    rows, d, heads, kv_heads, head_dim, ffn, batch, q, kv = 7, 11, 5, 3, 13, 17, 2, 19, 23
    k = (f.RMSNORM_FLOPS_PER_ELEMENT, f.RMSNORM_FLOPS_PER_ROW, f.ROPE_FLOPS_PER_ELEMENT,
         f.SCORE_SCALE_FLOPS_PER_ELEMENT, f.SOFTMAX_FLOPS_PER_ELEMENT, f.SWIGLU_FLOPS_PER_ELEMENT,
         f.RESIDUAL_FLOPS_PER_ELEMENT)
    _checked(f.rmsnorm_flops(rows, d) == rows * (k[0] * d + k[1]), "RMSNorm's count")
    _checked(f.rope_flops(rows, heads, kv_heads, head_dim) == k[2] * rows * (heads + kv_heads) * head_dim, "RoPE's")
    _checked(f.score_scale_flops(batch, heads, q, kv) == k[3] * batch * heads * q * kv, "the scaling's")
    _checked(f.softmax_flops(batch, heads, q, kv) == k[4] * batch * heads * q * kv, "softmax's")
    _checked(f.swiglu_activation_flops(rows, ffn) == k[5] * rows * ffn, "SwiGLU's")
    _checked(f.residual_flops(rows, d) == k[6] * rows * d, "the residual add's")

    def times(n: int, rest: str) -> str:
        return rest if n == 1 else f"{n}·{rest}"

    table = [
        "| stage | FLOPs | per element |",
        "|---|---|---|",
        f"| RMSNorm | rows·({k[0]}d + {k[1]}) | square, sum, × rsqrt, × weight; per row: mean, + eps, rsqrt |",
        f"| RoPE | {times(k[2], 'rows·(H + Hkv)·D')} | x·cos + rotate_half(x)·sin |",
        f"| score scaling | {times(k[3], 'B·H·T·S')} | ÷ √D (the causal mask is a select: 0) |",
        f"| softmax | {times(k[4], 'B·H·T·S')} | max, subtract, exp, sum, divide |",
        f"| SwiGLU activation | {times(k[5], 'rows·F')} | sigmoid (4), × gate, × up |",
        f"| residual add | {times(k[6], 'rows·d')} | one add |",
    ]
    return "\n".join(table) + "\n"


# ---- analytical figures --------------------------------------------------------------------------------------------


def _no_cache(prompt_len: int | None) -> str:
    """The KV cache's saving for LLaMA-7B in fp16: the step at t = 1000 (prompt_len None), or a whole 1000-token
    generation from a prompt of prompt_len tokens."""
    from llmtrace.tracer.analytic.estimate import Dtypes
    from llmtrace.tracer.analytic.no_cache import generation_without_cache, step_ratio
    from llmtrace.tracer.core.dtypes import FP16
    from llmtrace.tracer.core.presets import get_preset

    config, dtypes = get_preset("llama-7b"), Dtypes.for_weights(FP16)
    if prompt_len is None:
        return f"{step_ratio(config, 1000, dtypes):.0f}x"
    return f"{generation_without_cache(config, prompt_len, 1000, dtypes).ratio:.0f}x"


@functools.cache
def _roofline(model: str, prompt_len: int = 512, new_tokens: int = 128, kernels: str | None = None) -> Any:
    """`llmtrace roofline --model MODEL` on the A100 80GB (the command's default hardware), as README's example."""
    from llmtrace.tracer.core.presets import get_preset
    from llmtrace.tracer.hardware.profiles import get_profile
    from llmtrace.tracer.roofline.analysis import roofline

    return roofline(get_preset(model), get_profile("a100-80gb"), prompt_len=prompt_len, new_tokens=new_tokens,
                    kernels=kernels)


def _roof(figure: Callable[[Any], str]) -> Callable[[], str]:
    return lambda: figure(_roofline("llama-7b"))


def _fmt() -> Any:
    from llmtrace.cli import formatting

    return formatting


def _crossover_without_activations(kernels: str) -> str:
    """llama3-8b's decode crossover batch at the end of a 128 + 128 generation counting only the weights and KV cache
    (as if no activation ever left the chip): the smallest B with B·f / (W + B·kv) at the ridge."""
    import math

    from llmtrace.tracer.analytic.estimate import Dtypes, decode_step
    from llmtrace.tracer.analytic.kernels import Kernels
    from llmtrace.tracer.core.dtypes import FP16
    from llmtrace.tracer.core.presets import get_preset

    c = _roofline("llama3-8b", 128, 128, kernels).crossover
    totals = decode_step(get_preset("llama3-8b"), c.kv_len - 1, Dtypes.for_weights(FP16), 1, Kernels(kernels)).totals
    kv = totals.kv_read_bytes + totals.kv_write_bytes
    return str(math.ceil(c.ridge_point * c.shared_bytes / (c.per_sequence_flops - c.ridge_point * kv)))


def _eager_activations() -> str:
    """What eager kernels' activations add per sequence to llama3-8b's decode step at the crossover's context."""
    from llmtrace.tracer.analytic.estimate import Dtypes, decode_step
    from llmtrace.tracer.analytic.kernels import Kernels
    from llmtrace.tracer.core.dtypes import FP16
    from llmtrace.tracer.core.presets import get_preset

    kv_len = _roofline("llama3-8b", 128, 128, "eager").crossover.kv_len
    totals = decode_step(get_preset("llama3-8b"), kv_len - 1, Dtypes.for_weights(FP16), 1, Kernels.EAGER).totals
    return _fmt().nbytes(totals.activation_bytes)


def _long_prefill(kernels: str, prompt_len: int = 8192) -> Any:
    """llama3.1-8b's prefill of `prompt_len` tokens on an H100 SXM under `kernels` (fit not checked)."""
    from llmtrace.tracer.core.presets import get_preset
    from llmtrace.tracer.hardware.profiles import get_profile
    from llmtrace.tracer.roofline.analysis import roofline

    return roofline(get_preset("llama3.1-8b"), get_profile("h100-sxm"), prompt_len=prompt_len, new_tokens=1,
                    kernels=kernels, check_fit=False)


def long_prefill(kernels: str) -> str:
    fmt = _fmt()
    report = _long_prefill(kernels)
    p = report.prefill
    moved = f"{fmt.flops(p.flops)}, {fmt.nbytes(p.bytes)} moved"
    if kernels == "eager":  # the scores, written by one op and read by the next: half the largest kernel's traffic
        moved += f" ({fmt.nbytes(report.memory.activation_bytes_per_device // 2)} of scores per op per layer)"
    return f"{moved}, {p.bound}-bound at {fmt.duration_s(p.seconds)}"


def long_prefill_scores() -> str:
    """At 32k, the eager scaling's scores in and out."""
    report = _long_prefill("eager", 32768)
    return f"2 × {report.memory.activation_bytes_per_device / 2 / 2**30:g} GiB"


def sliding_window_cache(windowed: bool) -> str:
    """Mistral 7B's KV cache at 32k positions in fp16: the window's positions, or all of them."""
    from llmtrace.tracer.analytic.kvmem import kv_bytes_per_token, kv_cache_bytes
    from llmtrace.tracer.core.dtypes import FP16
    from llmtrace.tracer.core.presets import get_preset

    config = get_preset("mistral-7b")
    size = kv_cache_bytes(config, 32768, FP16) if windowed else kv_bytes_per_token(config, FP16) * 32768
    return _fmt().nbytes(size)


def same_gguf(written: str) -> bool:
    """Whether README's table of what loads was made with the installed gguf, which decides the tensor types."""
    from importlib.metadata import version

    return f"gguf ({version('gguf')})" in written


# Facts that depend on the installed packages, with how to tell whether README's text was made with the same ones:
# a check elsewhere compares only those that were.
SAME_ENVIRONMENT: dict[str, Callable[[str], bool]] = {"table.loads": same_gguf}

FACTS: dict[str, Callable[[], str]] = {
    "run.kernels": run_kernels,
    "run.recorded_on": run_recorded_on,
    "run.chars": run_chars,
    "run.utf8": run_utf8,
    "run.tokens": run_tokens,
    "run.embedding_table": run_embedding_table,
    # the run is fused; --lens and --attention make the other go stage by stage
    "run.fused_stages": lambda: _prefill_stages(RUN_TRACE, layer0=True),
    "run.fused_marks": lambda: _prefill_stages(RUN_TRACE, layer0=False),
    "lens.staged_stages": lambda: _prefill_stages(LENS_TRACE, layer0=True),
    "lens.staged_wrappers": lambda: _prefill_stages(LENS_TRACE, layer0=False),
    "run.head_matrix": run_head_matrix,
    "run.kv_per_token": run_kv_per_token,
    "run.weight_products_share": run_weight_products_share,
    "run.decode_intensity": run_decode_intensity,
    "run.kept_marks": kept_marks,
    "lens.piece": lens_piece,
    "lens.embed_rank": lens_embed_rank,
    "lens.first_top": lens_first_top,
    "attention.sinks": attention_sinks,
    "attention.focused": attention_focused,
    "table.loads": table_loads,
    "table.elementwise": table_elementwise,
    # README's answer to "why 150 tokens/s": llama-7b on the A100 80GB, as its roofline example
    "roof.decode_flops": _roof(lambda r: _fmt().flops(r.first_decode.flops)),
    "roof.decode_kv_len": _roof(lambda r: str(r.first_decode.kv_len)),
    "roof.peak": _roof(lambda r: _fmt().flops_per_s(r.machine.peak_flops)),
    "roof.compute_time": _roof(lambda r: _fmt().duration_s(r.first_decode.compute_seconds)),
    "roof.compute_tok_s": _roof(lambda r: f"{r.first_decode.passes_per_s_at_peak:,.0f}"),
    "roof.weights": _roof(lambda r: _fmt().nbytes(r.first_decode.weight_bytes)),
    "roof.bandwidth": _roof(lambda r: _fmt().bytes_per_s(r.machine.memory_bandwidth)),
    "roof.decode_time": _roof(lambda r: _fmt().duration_s(r.first_decode.seconds)),
    "roof.decode_tok_s": _roof(lambda r: f"{1 / r.first_decode.seconds:,.0f}"),
    "roof.decode_intensity": _roof(lambda r: _fmt().intensity(r.first_decode.arithmetic_intensity)),
    "roof.ridge": _roof(lambda r: _fmt().intensity(r.machine.ridge_point)),
    "roof.left": _roof(lambda r: f"{r.machine.ridge_point / r.first_decode.arithmetic_intensity:.0f}×"),
    "roof.idle": _roof(lambda r: f"{100 * (1 - r.first_decode.arithmetic_intensity / r.machine.ridge_point):.0f}%"),
    "roof.prompt": _roof(lambda r: f"{r.prefill.new_tokens:,}"),
    "roof.prefill_intensity": _roof(lambda r: _fmt().intensity(r.prefill.arithmetic_intensity)),
    "roof.ttft": _roof(lambda r: _fmt().duration_s(r.generation.ttft_seconds)),
    "roof.table_kv_len": _roof(lambda r: str(r.crossover.kv_len)),
    "roof.kv_cap": _roof(lambda r: _fmt().intensity(r.crossover.intensity_limit)),
    "roof.l3_kv_len": lambda: str(_roofline("llama3-8b", 128, 128, "fused").crossover.kv_len),
    "roof.l3_fused": lambda: str(_roofline("llama3-8b", 128, 128, "fused").crossover.crossover_batch),
    "roof.l3_no_activations": lambda: _crossover_without_activations("fused"),
    "roof.l3_eager": lambda: str(_roofline("llama3-8b", 128, 128, "eager").crossover.crossover_batch),
    "roof.l3_eager_activations": _eager_activations,
    "flops.long_prefill_fused": lambda: long_prefill("fused"),
    "flops.long_prefill_eager": lambda: long_prefill("eager"),
    "flops.long_prefill_scores_32k": long_prefill_scores,
    "kvmem.window_32k": lambda: sliding_window_cache(True),
    "kvmem.no_window_32k": lambda: sliding_window_cache(False),
    "no_cache.step_1000": lambda: _no_cache(None),
    "no_cache.prompt_1": lambda: _no_cache(1),
    "no_cache.prompt_100": lambda: _no_cache(100),
}
