"""The model families llmtrace refuses, each with what its model code lacks for them: the registry the config readers
name in their one-line refusal and README's table of what loads is generated from (benchmarks/readme_facts.py).
Pure Python.

A family is matched by any of its HF architectures (config.json's `architectures`), HF model types (`model_type`,
for a config without architectures) or GGUF architectures (`general.architecture`). An architecture in none of them
gets the readers' generic line, which lists what llmtrace reads (HF_ARCHITECTURES in tracer/core/config_hf.py and
GGUF_ARCHITECTURES in config_gguf.py; a family moves there when the model code gains what it lacks).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Refusal:
    family: str  # what README's table calls it
    missing: str  # what the model code does not have, as the refusal line names it
    hf: tuple[str, ...]  # HF architectures (config.json "architectures")
    model_types: tuple[str, ...]  # HF model types (config.json "model_type")
    gguf: tuple[str, ...]  # GGUF general.architecture values
    instead: str = ""  # what llmtrace offers for the family meanwhile, said after the refusal


REFUSALS: tuple[Refusal, ...] = (
    Refusal("vision-language models", "a vision tower (image encoder and projector) beside the language model",
            hf=("LlavaForConditionalGeneration", "LlavaNextForConditionalGeneration",
                "Qwen2VLForConditionalGeneration", "Qwen2_5_VLForConditionalGeneration",
                "MllamaForConditionalGeneration", "Gemma3ForConditionalGeneration",
                "PaliGemmaForConditionalGeneration", "Idefics3ForConditionalGeneration",
                "Llama4ForConditionalGeneration"),
            model_types=("llava", "llava_next", "qwen2_vl", "qwen2_5_vl", "mllama", "gemma3", "paligemma",
                         "idefics3", "llama4"),
            gguf=("clip",)),  # llama.cpp's mmproj files: the vision tower alone
    Refusal("DeepSeek-V2/V3", "multi-head latent attention (MLA: K and V expanded from a compressed latent) and "
            "routed + shared experts",
            hf=("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM"), model_types=("deepseek_v2", "deepseek_v3"),
            gguf=("deepseek2",)),
    Refusal("state-space models", "state-space (Mamba) layers in place of attention",
            hf=("MambaForCausalLM", "Mamba2ForCausalLM", "FalconMambaForCausalLM", "JambaForCausalLM",
                "Zamba2ForCausalLM"),
            model_types=("mamba", "mamba2", "falcon_mamba", "jamba", "zamba2"), gguf=("mamba", "mamba2", "jamba")),
    # Gemma 3's text model reads (its twists are stages of tracer/core/contract.py); Gemma 2 soft-caps its scores
    Refusal("Gemma 1 and 2", "Gemma 2's soft-capped attention scores and its own config reader (Gemma 3's text "
            "model is read)",
            hf=("GemmaForCausalLM", "Gemma2ForCausalLM"),
            model_types=("gemma", "gemma2"), gguf=("gemma", "gemma2")),
    Refusal("Phi-1 and Phi-2", "LayerNorm with biases, attention and a GELU FFN in parallel, and RoPE on part of each "
            "head",
            hf=("PhiForCausalLM",), model_types=("phi",), gguf=("phi2",)),
)


def hf_refusal(architectures: list[str], model_type: str) -> tuple[str, Refusal] | None:
    """(what matched, as the refusal line names it, and its family) for a config.json's architectures or model
    type; None if no family is refused."""
    for refusal in REFUSALS:
        for name in architectures:
            if name in refusal.hf:
                return f"architecture {name!r}", refusal
        if model_type in refusal.model_types:
            return f"model type {model_type!r}", refusal
    return None


def gguf_refusal(architecture: str) -> Refusal | None:
    return next((r for r in REFUSALS if architecture in r.gguf), None)


def refusal_line(source: str, what: str, refusal: Refusal) -> str:
    """'<source>: <what> is not read: it needs <missing>, which llmtrace's model code does not have[; <instead>]'."""
    line = f"{source}: {what} is not read: it needs {refusal.missing}, which llmtrace's model code does not have"
    return f"{line}; {refusal.instead}" if refusal.instead else line
