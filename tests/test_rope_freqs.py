"""A Llama 3.1-style GGUF: llama.cpp's converter writes the model's RoPE scaling as one F32 tensor, rope_freqs.weight
(frequency i divided by factor i), and no metadata key. Read as kind "freqs", the GGUF gives the logits transformers'
LlamaForCausalLM gives on the HF folder with rope_type "llama3" (R1's finding: the file ran unscaled before)."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Callable

import pytest
import torch
from tiny_gguf import sentencepiece_vocab, write_tiny_gguf

from llmtrace.tracer.core.config import ModelConfig
from llmtrace.tracer.core.dtypes import FP32
from llmtrace.tracer.core.errors import UnsupportedModelError
from llmtrace.tracer.load.hf_loader import load_hf_state_dict
from llmtrace.tracer.load.loader import load_model
from llmtrace.tracer.model.rope import rope_inv_freq

transformers = pytest.importorskip("transformers")

# an original context of 32 positions at head dim 16 and base 10,000: frequencies in all three bands (kept, blended,
# divided; wavelengths 6.3, 19.9, 62.8...)
SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
           "original_max_position_embeddings": 32}


def converter_factors(head_dim: int, theta: float, scaling: dict) -> list[float]:
    """rope_freqs as llama.cpp's convert_hf_to_gguf.py computes it for rope_type llama3 (written from its formula)."""
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old = scaling["original_max_position_embeddings"]
    out = []
    for i in range(0, head_dim, 2):
        wavelen = 2 * math.pi * theta ** (i / head_dim)
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return out


def _unscaled(folder: Path) -> ModelConfig:
    """The folder's config without its scaling: what write_tiny_gguf's metadata should say (no scaling key)."""
    return dataclasses.replace(ModelConfig.from_hf_json(folder), rope_scaling=None)


def _weights(folder: Path) -> dict[str, torch.Tensor]:
    return load_hf_state_dict(folder, ModelConfig.from_hf_json(folder))


@pytest.fixture(scope="module")
def llama31(make_tiny_llama: Callable[..., Path], sp_model_bytes: bytes,
            tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, list[float]]:
    folder = make_tiny_llama("llama3-rope-freqs", seed=5, n_heads=4, n_kv_heads=2, rope_scaling=SCALING,
                             rope_theta=10000.0)
    config = ModelConfig.from_hf_json(folder)
    factors = converter_factors(config.head_dim, config.rope_theta, SCALING)
    path = write_tiny_gguf(tmp_path_factory.mktemp("llama31-gguf") / "llama31.gguf", _unscaled(folder),
                           _weights(folder), sentencepiece_vocab(sp_model_bytes),
                           extra_tensors={"rope_freqs.weight": torch.tensor(factors)})
    return folder, path, factors


def test_the_gguf_reads_its_factors_as_freqs_scaling(llama31: tuple[Path, Path, list[float]]) -> None:
    """The file's factors read back as kind "freqs", and the frequencies they give are transformers' llama3 ones
    (its _compute_llama3_parameters on the folder's config), in all three bands: kept, blended, divided by 8."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    folder, path, factors = llama31
    config = load_model(str(path), dtype=FP32, use_cache=False, dry_run=True).config
    scaling = config.rope_scaling
    assert scaling is not None and scaling.kind == "freqs"
    assert scaling.freq_factors == pytest.approx(factors, rel=1e-6) and scaling.factor == 8.0
    theirs, _ = ROPE_INIT_FUNCTIONS["llama3"](transformers.AutoConfig.from_pretrained(folder), "cpu")
    ours = rope_inv_freq(config.head_dim, config.rope_theta, scaling)
    assert torch.allclose(ours, theirs.float(), rtol=1e-6, atol=0)
    unscaled = rope_inv_freq(config.head_dim, config.rope_theta, None)
    ratio = (unscaled / theirs.float()).tolist()
    assert ratio[0] == pytest.approx(1.0) and ratio[-1] == pytest.approx(8.0)
    assert any(1.01 < r < 7.99 for r in ratio)  # a blended frequency: the smooth band is exercised


@torch.no_grad()
def test_gguf_logits_equal_llama_for_causal_lm_with_llama3_scaling(llama31: tuple[Path, Path, list[float]],
                                                                   tmp_path: Path, sp_model_bytes: bytes) -> None:
    folder, path, _ = llama31
    hf = transformers.LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager").eval()
    ids = torch.randint(3, hf.config.vocab_size, (1, 40), generator=torch.Generator().manual_seed(2))
    expected = hf(input_ids=ids).logits
    assert (load_model(str(path), dtype=FP32, use_cache=False).model(ids) - expected).abs().max().item() <= 1e-4
    # the same file without its rope_freqs (how it read before: unscaled) is far off at 40 positions
    without = write_tiny_gguf(tmp_path / "unscaled.gguf", _unscaled(folder), _weights(folder),
                              sentencepiece_vocab(sp_model_bytes))
    assert (load_model(str(without), dtype=FP32, use_cache=False).model(ids) - expected).abs().max().item() > 1e-3


def test_a_gguf_scaling_type_llmtrace_does_not_read_is_one_line(llama31: tuple[Path, Path, list[float]],
                                                                tmp_path: Path, sp_model_bytes: bytes) -> None:
    folder, _, _ = llama31
    path = write_tiny_gguf(tmp_path / "yarn.gguf", _unscaled(folder), _weights(folder),
                           sentencepiece_vocab(sp_model_bytes),
                           extra_metadata={"llama.rope.scaling.type": "yarn", "llama.rope.scaling.factor": 4.0})
    with pytest.raises(UnsupportedModelError, match=r"llama\.rope\.scaling\.type is 'yarn'"):
        load_model(str(path), dtype=FP32, use_cache=False, dry_run=True)
