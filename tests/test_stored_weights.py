"""`--weights stored`: a GGUF's matrices multiplied as the file stores them (tracer/load/stored_weights.py).

Checked against independent figures: the file's own tensor sizes (what a decode step must read), the dense path's
logits (same values; the int4 kernel's products in bf16: a stated tolerance), the bundled model's greedy " Paris".
The native kernel's own exactness is tests/test_native_kernel.py's."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Callable

import gguf
import pytest
import torch
from typer.testing import CliRunner

from llmtrace.cli.app import app
from llmtrace.tracer.checkpoint.bundled import bundled_model_path
from llmtrace.tracer.checkpoint.gguf_header import read_gguf_header
from llmtrace.tracer.core.dtypes import FP32
from llmtrace.tracer.load import weights_cache
from llmtrace.tracer.load.loader import load_model
from llmtrace.tracer.load.stored_weights import DENSE, STORED, all_kernels, entry_variant
from llmtrace.tracer.model import native_kernel
from llmtrace.tracer.model.weight_formats import INT4PACK, NATIVE
from llmtrace.tracer.run.generate import generate
from llmtrace.tracer.trace.records import DECODE, RunSettings

Q = gguf.GGMLQuantizationType

# Logits of the stored path against the dense one for the same file: the int4 kernel runs in bf16 (activations,
# scales and its output rounded to 8 significant bits), so they agree to this fraction of the largest logit
# (measured on the tiny GGUFs: 1.0% Q4_0, 2.6% Q4_1, 1.1% Q8_0; bf16's own rounding is 0.4% per product).
LOGIT_TOLERANCE = 0.04


@pytest.fixture(autouse=True)
def _private_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LLMTRACE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))




def _logits(path: Path, weights: str, tokens: list[int]) -> torch.Tensor:
    model = load_model(str(path), FP32, weights=weights).model
    model.setup_cache(1, 16)
    out = [model.prefill(torch.tensor([tokens[:-1]]))]
    out.append(model.decode_one(torch.tensor([tokens[-1:]])))
    return torch.cat(out)  # (2, V): the prompt's last position, then one decode step


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1, Q.Q8_0])
def test_stored_logits_match_dense_within_the_stated_tolerance(qtype: Q, tiny_quantized: Callable[[Q], Path]) -> None:
    path = tiny_quantized(qtype)
    tokens = [1, 40, 41, 42, 43, 44]
    stored, dense = _logits(path, "int4pack", tokens), _logits(path, DENSE, tokens)
    scale = dense.abs().max()
    assert (stored - dense).abs().max() <= LOGIT_TOLERANCE * scale, float((stored - dense).abs().max() / scale)
    assert not torch.equal(stored, dense)  # the stored path really ran (bf16 products differ in the last bits)


def test_default_is_stored_when_every_matrix_has_a_kernel(tiny_quantized: Callable[[Q], Path]) -> None:
    loaded = load_model(str(tiny_quantized(Q.Q4_1)), FP32)
    assert loaded.weights.mode == STORED and "as stored" in loaded.weight_format
    formats = {name: w.format.name for name, w in loaded.model.stored_weights().items()}
    assert formats["layers.0.attention.wq"] == "q4_1" and formats["tok_embeddings"] == "q4_1"
    f32 = load_model(str(tiny_quantized(Q.F32)), FP32)  # F32 matrices: no stored kernel, so dense and said why
    assert f32.weights.mode == DENSE and "F32" in f32.weights.reason and not f32.model.stored_weights()


def test_cached_stored_entry_is_reused_and_a_damaged_one_reconverted(tiny_quantized: Callable[[Q], Path]) -> None:
    """int4pack's packing is a conversion, cached; the native kernel's weights are the file's blocks, never cached."""
    path = tiny_quantized(Q.Q4_0)
    if native_kernel.available():
        native = [load_model(str(path), FP32, weights=NATIVE) for _ in range(2)]
        assert not any(n.from_cache for n in native) and not list(weights_cache.weights_dir().glob("*.safetensors"))
    first = load_model(str(path), FP32, weights=INT4PACK)
    second = load_model(str(path), FP32, weights=INT4PACK)
    assert not first.from_cache and second.from_cache
    x = torch.randn(1, 64)
    wq1, wq2 = first.model.layers[0].attention.wq, second.model.layers[0].attention.wq
    assert torch.equal(wq1(x), wq2(x)) and wq2.packed.format == wq1.packed.format
    entry = weights_cache.cache_path(path, entry_variant("int4pack", torch.float32))
    raw = bytearray(entry.read_bytes())
    raw[-1] ^= 0xFF  # a flipped bit in the last tensor's bytes
    entry.write_bytes(bytes(raw))
    third = load_model(str(path), FP32, weights=INT4PACK)
    assert not third.from_cache and "damaged" in third.cache_note
    assert torch.equal(third.model.layers[0].attention.wq(x), wq1(x))


@pytest.mark.parametrize("kernel", [NATIVE, INT4PACK])
def test_a_decode_step_reads_the_files_bytes_and_every_record_names_its_format(kernel: str) -> None:
    """Bundled Q4_1 file: one decode step reads every stored tensor once (the tied LM head is the Q8_0 embedding,
    the norms F32 = the fp32 compute dtype) plus the embedding row of its token (576 values of Q8_0 = 612 B).
    The fused path and --staged both run the stored weights and count the same bytes."""
    if kernel == NATIVE and not native_kernel.available():
        pytest.skip(native_kernel.unavailable_reason())
    path = bundled_model_path()
    file_bytes = sum(t.n_bytes for t in read_gguf_header(path).tensors)
    loaded = load_model(None, FP32, weights=kernel)
    assert loaded.weights.mode == STORED and loaded.weights.kernel == kernel
    settings = RunSettings(model="", prompt="The capital of France is", max_new_tokens=3, temperatures=())
    for staged in (False, True):
        trace = generate(loaded, replace(settings, staged=staged))
        step = [s for s in trace.stages if s.phase == DECODE and s.step == 1]
        assert sum(s.weight_bytes_read for s in step) == file_bytes + 576 * 34 // 32, staged
        formats = {s.short_name: s.weight_format for s in step if s.kind in ("linear", "lm_head", "embedding")}
        assert set(formats.values()) == {f"q4_1 ({kernel})", f"q8_0 ({kernel})"}, formats
        assert formats["output"] == formats["tok_embeddings"] == f"q8_0 ({kernel})"
        assert loaded.tokenizer.decode([trace.steps[0].token_id]) == " Paris", staged


def test_weights_option_on_the_command_line() -> None:
    result = CliRunner().invoke(app, ["run", "capital", "--max-new-tokens", "1", "--weights", "dense", "--no-trace",
                                      "--no-roofline", "--temperatures", ""])
    assert result.exit_code == 0, result.output
    assert "as stored" not in result.output and "Q4_1+Q8_0 -> fp32" in result.output  # what was asked: no note
    bad = CliRunner().invoke(app, ["run", "capital", "--weights", "int3"])
    assert bad.exit_code == 2
    assert f"--weights must be one of auto, tuned, stored, dense, {', '.join(all_kernels())}" in bad.output
    assert all_kernels() == (("i8dot", "i16dot", NATIVE) if native_kernel.available() else ()) + (INT4PACK, "blocks")
