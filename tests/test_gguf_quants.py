"""Every GGUF quantization the `gguf` package decodes, loaded by llmtrace and compared with gguf's dequantizer bit for
bit. gguf cannot write K-quants or IQ types, so the files are written block by block (tiny_gguf.random_blocks, the
layouts of ggml-common.h) and carry random quant bits under small finite scales."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import gguf
import numpy as np
import pytest
import torch
from tiny_gguf import (
    BLOCK_LAYOUTS,
    block_dtype,
    llama_cpp_name,
    llama_cpp_permute,
    random_blocks,
    sentencepiece_vocab,
    write_tiny_gguf,
)
from typer.testing import CliRunner

from llmtrace.cli.app import app
from llmtrace.tracer.checkpoint.gguf_header import GGML_TYPES, read_gguf_header
from llmtrace.tracer.checkpoint.resolve import config_from_gguf_header
from llmtrace.tracer.core.config import ModelConfig
from llmtrace.tracer.core.errors import FileFormatError, UnsupportedModelError
from llmtrace.tracer.load.gguf_dequant import dequantize
from llmtrace.tracer.load.gguf_loader import load_gguf_weights
from llmtrace.tracer.load.hf_loader import load_hf_state_dict
from llmtrace.tracer.load.loader import load_model
from llmtrace.tracer.model import native_kernel
from llmtrace.tracer.model.weight_formats import rows_scales_finite

Q = gguf.GGMLQuantizationType
# Every type gguf 0.19 can dequantize, beyond the plain floats.
QUANT_TYPES = sorted(BLOCK_LAYOUTS, key=int)
# llama.cpp's Q4_K_M recipe in small: Q4_K matrices, Q6_K for attn_v / ffn_down / output, Q8_0 embedding.
Q4_K_M = {"token_embd": Q.Q8_0, "attn_v": Q.Q6_K, "ffn_down": Q.Q6_K, "output": Q.Q6_K}


pytestmark = pytest.mark.usefixtures("private_dirs")


@pytest.fixture(scope="module")
def kquant_source(make_tiny_llama: Callable[..., Path], sp_model_bytes: bytes) -> tuple[ModelConfig, dict, dict]:
    """A tiny LLaMA whose every matrix input dimension is a whole 256-value K-quant block (dim 256, F 512)."""
    folder = make_tiny_llama("kquants", seed=11, dim=256, n_layers=1, n_heads=4, n_kv_heads=2, ffn_dim=512)
    config = ModelConfig.from_hf_json(folder)
    return config, load_hf_state_dict(folder, config), sentencepiece_vocab(sp_model_bytes)


def _write_blocks(path: Path, source: tuple[ModelConfig, dict, dict], type_of: Callable[[str], Q],
                  seed: int = 0) -> tuple[Path, dict[str, tuple[np.ndarray, Q]]]:
    """Every matrix written as random blocks of type_of(llama.cpp name); norms stay F32."""
    config, state, vocab = source
    rng = np.random.default_rng(seed)
    raw = {}
    for ours, tensor in state.items():
        name = llama_cpp_name(ours)
        if tensor.ndim == 2 and not (ours == "output.weight" and config.tie_embeddings):
            qtype = type_of(name)
            raw[name] = (random_blocks(qtype, tensor.shape[0], tensor.shape[1], rng), qtype)
    return write_tiny_gguf(path, config, state, vocab, raw_blocks=raw), raw


def _assert_equals_gguf_dequantize(path: Path, raw: dict[str, tuple[np.ndarray, Q]], config: ModelConfig) -> None:
    header = read_gguf_header(path, decode_arrays=True)
    weights = load_gguf_weights(header, config_from_gguf_header(header))
    for ours, tensor in weights.state_dict.items():
        name = llama_cpp_name(ours)
        if name not in raw:
            continue
        blocks, qtype = raw[name]
        reference = gguf.quants.dequantize(blocks, qtype)
        loaded = tensor.numpy()
        if ours.endswith("attention.wq.weight"):  # the loader un-permutes; permuting back must give the file's rows
            loaded = llama_cpp_permute(loaded, config.n_heads, config.n_heads)
        elif ours.endswith("attention.wk.weight"):
            loaded = llama_cpp_permute(loaded, config.n_heads, config.n_kv_heads)
        assert loaded.dtype == np.float32
        np.testing.assert_array_equal(loaded, reference, err_msg=f"{ours} ({qtype.name})")


def test_type_table_is_ggufs() -> None:
    """The pure-Python header reader sizes every type exactly as the gguf package does."""
    expected = {int(t): (t.name, *gguf.GGML_QUANT_SIZES[t]) for t in Q}
    assert GGML_TYPES == expected


@pytest.mark.parametrize("qtype", QUANT_TYPES, ids=lambda q: q.name)
def test_block_layouts_are_ggml_sizes(qtype: Q) -> None:
    assert block_dtype(qtype).itemsize == gguf.GGML_QUANT_SIZES[qtype][1]


@pytest.mark.parametrize("qtype", QUANT_TYPES, ids=lambda q: q.name)
def test_every_type_loads_bit_for_bit(qtype: Q, kquant_source: tuple[ModelConfig, dict, dict], tmp_path: Path) -> None:
    path, raw = _write_blocks(tmp_path / f"{qtype.name}.gguf", kquant_source, lambda _: qtype, seed=int(qtype))
    assert read_gguf_header(path).tensors[0].type_name in (qtype.name, "F32")
    _assert_equals_gguf_dequantize(path, raw, kquant_source[0])


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1, Q.Q8_0], ids=lambda q: q.name)
def test_fast_paths_equal_gguf_on_random_blocks(qtype: Q) -> None:
    """The hand-written Q4_0/Q4_1/Q8_0 decoders against gguf's on every bit pattern a block can hold (random blocks)."""
    blocks = random_blocks(qtype, 64, 512, np.random.default_rng(1))
    ours = dequantize(blocks.reshape(-1), int(qtype), 512)
    np.testing.assert_array_equal(ours, gguf.quants.dequantize(blocks, qtype).reshape(-1))


def test_the_types_checked_without_gguf_are_those_it_decodes() -> None:
    """check_decodable accepts GGUF_DECODES without importing gguf (a first run's start-up): each must be one that
    gguf's dequantize decodes, and F32 reads back as gguf reads it."""
    from llmtrace.tracer.load.gguf_dequant import GGUF_DECODES, _gguf_type

    assert all(_gguf_type(code) is not None for code in GGUF_DECODES)
    raw = np.random.default_rng(2).standard_normal(96).astype("<f4").view(np.uint8)
    np.testing.assert_array_equal(dequantize(raw, int(Q.F32), 96), gguf.quants.dequantize(raw, Q.F32).reshape(-1))


def test_q4_k_m_mix_runs(kquant_source: tuple[ModelConfig, dict, dict], tmp_path: Path) -> None:
    """A file mixed the way llama.cpp's Q4_K_M is: loads bit for bit, and `llmtrace run` generates from it."""
    def type_of(name: str) -> Q:
        return next((q for part, q in Q4_K_M.items() if f".{part}." in f".{name}"), Q.Q4_K)

    path, raw = _write_blocks(tmp_path / "q4_k_m.gguf", kquant_source, type_of)
    assert {q for _, q in raw.values()} == {Q.Q4_K, Q.Q6_K, Q.Q8_0}
    _assert_equals_gguf_dequantize(path, raw, kquant_source[0])
    loaded = load_model(str(path), use_cache=False)
    assert loaded.weight_format.startswith("GGUF Q4_K+Q6_K+Q8_0")
    result = CliRunner().invoke(app, ["run", "capital", "--model", str(path), "--max-new-tokens", "2",
                                      "--dtype", "fp32", "--no-roofline", "--detail", "summary"])
    assert result.exit_code == 0, result.output
    assert "2 tokens generated" in result.output


@pytest.mark.parametrize("weights", ["int4pack", "blocks", "stored", "Q4_K:int4pack,Q6_K:native,Q8_0:native"])
def test_q4_k_m_mix_under_a_kernel_that_skips_a_type(kquant_source: tuple[ModelConfig, dict, dict], tmp_path: Path,
                                                     weights: str) -> None:
    """int4pack and blocks run Q4_K but not Q6_K, which a Q4_K_M file stores V and the FFN's down matrix in: one
    product (Q|K|V) cannot mix a stored and a dense matrix, nor int4pack's Q4_K with native's Q6_K, so Q and K are
    dequantized with V (each crashed setup_cache with a traceback before); gate|up, both Q4_K, stay stored. The
    weights line says so; the logits are the dense model's within the kernels' rounding, the greedy token too."""
    def type_of(name: str) -> Q:
        return next((q for part, q in Q4_K_M.items() if f".{part}." in f".{name}"), Q.Q4_K)

    path, _ = _write_blocks(tmp_path / "q4_k_m.gguf", kquant_source, type_of)
    if weights == "Q4_K:int4pack,Q6_K:native,Q8_0:native" and not native_kernel.available():
        pytest.skip("the native kernel is not available here")
    loaded = load_model(str(path), use_cache=False, weights=weights)
    dense = load_model(str(path), use_cache=False, weights="dense")
    stored = loaded.model.stored_weights()
    assert ("layers.0.attention.wq" in stored) == (weights == "stored")
    assert "layers.0.feed_forward.w1" in stored and "layers.0.feed_forward.w3" in stored
    with_partners = {"int4pack": "2 of type Q4_K", "blocks": "2 of type Q4_K", "stored": None,
                     "Q4_K:int4pack,Q6_K:native,Q8_0:native": "3 of type Q4_K, Q6_K"}[weights]  # V's Q6_K too
    if with_partners is not None:
        assert f"; {with_partners} run dequantized too: they share one product (Q|K|V" in loaded.weights.reason
    ids = torch.tensor([[1, 5, 9, 13]])
    for model in (loaded.model, dense.model):
        model.setup_cache(1, 8)
    got, want = loaded.model.prefill(ids), dense.model.prefill(ids)
    assert float((got - want).abs().max()) <= 2**-5 * float(want.abs().max())  # int4pack's bf16 at worst
    assert int(got.argmax()) == int(want.argmax())


def test_a_type_gguf_cannot_decode_is_one_line_with_advice(kquant_source: tuple[ModelConfig, dict, dict],
                                                            tmp_path: Path) -> None:
    """Q8_K is an intermediate type of llama.cpp's kernels that gguf has no dequantizer for."""
    config, state, vocab = kquant_source
    rows, cols = state["layers.0.feed_forward.w2.weight"].shape
    blocks = np.zeros((rows, cols // 256 * 292), dtype=np.uint8)
    path = write_tiny_gguf(tmp_path / "q8k.gguf", config, state, vocab, raw_blocks={"blk.0.ffn_down.weight": (blocks, Q.Q8_K)})
    with pytest.raises(UnsupportedModelError) as exc:
        load_model(str(path))
    message = str(exc.value)
    assert "\n" not in message
    assert "'blk.0.ffn_down.weight' is stored as Q8_K" in message
    assert "download another quantization of this model" in message and "re-quantize" not in message
    assert not any((tmp_path / "cache").rglob("*.safetensors"))  # refused before anything was converted
    result = CliRunner().invoke(app, ["run", "capital", "--model", str(path), "--no-roofline"])
    assert result.exit_code == 2 and "Q8_K" in result.output and "Traceback" not in result.output


def _set_type_code(path: Path, tensor: str, code: int) -> None:
    """Overwrite one tensor descriptor's ggml type (name string, u32 n_dims, u64 dims, then the u32 type)."""
    data = bytearray(path.read_bytes())
    header = read_gguf_header(path)
    info = next(t for t in header.tensors if t.name == tensor)
    encoded = tensor.encode()
    at = data.index(len(encoded).to_bytes(8, "little") + encoded, 0, header.data_offset) + 8 + len(encoded)
    at += 4 + 8 * len(info.shape)
    assert int.from_bytes(data[at:at + 4], "little") == info.ggml_type
    data[at:at + 4] = code.to_bytes(4, "little")
    path.write_bytes(bytes(data))


def test_unknown_type_code_is_one_line(kquant_source: tuple[ModelConfig, dict, dict], tmp_path: Path) -> None:
    config, state, vocab = kquant_source
    path = write_tiny_gguf(tmp_path / "odd.gguf", config, state, vocab)
    _set_type_code(path, "blk.0.attn_q.weight", 99)
    with pytest.raises(FileFormatError) as exc:
        load_model(str(path))
    assert "'blk.0.attn_q.weight' has ggml type code 99" in str(exc.value) and "\n" not in str(exc.value)
    result = CliRunner().invoke(app, ["flops", "--model", str(path)])
    assert result.exit_code == 2 and "type code 99" in result.output


def test_rows_that_are_not_whole_blocks_are_refused(tiny_llama_dir: Path, sp_model_bytes: bytes,
                                                    tmp_path: Path) -> None:
    """The default tiny model's norm (64 values, F32) relabelled Q4_K: 64 is not a whole 256-value block."""
    config = ModelConfig.from_hf_json(tiny_llama_dir)
    state = load_hf_state_dict(tiny_llama_dir, config)
    path = write_tiny_gguf(tmp_path / "rows.gguf", config, state, sentencepiece_vocab(sp_model_bytes))
    _set_type_code(path, "blk.0.attn_norm.weight", int(Q.Q4_K))
    with pytest.raises(FileFormatError, match=f"rows of {config.dim} values, not whole Q4_K blocks of 256"):
        read_gguf_header(path)
    result = CliRunner().invoke(app, ["run", "capital", "--model", str(path), "--no-roofline"])
    assert result.exit_code == 2 and "not whole Q4_K blocks" in result.output


# ---- the analytical commands on a GGUF: the weights dtype the file stores ------------------------------------------


def test_ggml_dtypes_have_ggufs_block_sizes() -> None:
    from llmtrace.tracer.core.dtypes import GGUF_DTYPES, get_dtype

    for qtype in QUANT_TYPES:
        block, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
        dtype = get_dtype(qtype.name)
        assert (dtype.block_size, dtype.block_bytes) == (block, block_bytes), qtype.name
        assert dtype.is_quantized
    assert get_dtype("Q4_K").bits_per_value == 4.5 and get_dtype("Q6_K").bits_per_value == 6.5625
    assert get_dtype("Q4_1").bits_per_value == 5.0
    assert get_dtype("q4_0").name == "int4" and "q4_0" not in GGUF_DTYPES


def test_flops_kvmem_roofline_on_a_q4_1_file_take_the_files_bytes() -> None:
    """The bundled file stores its matrices as Q4_1 (20 B per 32 values) and its embedding (the tied LM head) as
    Q8_0: the analytical commands cost each tensor at its stored size, as `run --weights stored` reads it (a decode
    step: every stored byte once plus its token's embedding row, 576 values of Q8_0 = 612 B); --dtype overrides."""
    import json as json_module

    from llmtrace.tracer.checkpoint.bundled import bundled_model_path

    path = str(bundled_model_path())
    file_bytes = sum(t.n_bytes for t in read_gguf_header(path).tensors)
    flops = json_module.loads(CliRunner().invoke(app, ["flops", "--model", path, "--prompt-len", "6",
                                                       "--json"]).stdout)
    assert (flops["weights_dtype"], flops["weights_dtype_from"], flops["activation_dtype"]) == \
        ("q4_1", "file", "fp16")
    assert flops["decode"]["totals"]["weight_bytes"] == file_bytes + 576 * 34 // 32
    stored = {t["name"]: t for t in flops["checkpoint"]["by_tensor"]}
    assert stored["tok_embeddings.weight"]["dtypes"] == "Q8_0" and stored["feed_forward.w2.weight"]["dtypes"] == "Q4_1"
    kv = json_module.loads(CliRunner().invoke(app, ["kvmem", "--model", path, "--budget", "1GB", "--json"]).stdout)
    assert (kv["budget"]["weights_dtype"], kv["budget"]["weights_bytes"]) == ("q4_1", file_bytes)
    roof = json_module.loads(CliRunner().invoke(app, ["roofline", "--model", path, "-H", "rtx-4090", "--json"]).stdout)
    assert (roof["weights_dtype"], roof["weights_dtype_from"]) == ("q4_1", "file")
    assert roof["memory"]["weight_bytes_per_device"] == file_bytes
    forced = json_module.loads(CliRunner().invoke(app, ["roofline", "--model", path, "-H", "rtx-4090", "--dtype",
                                                        "fp16", "--json"]).stdout)
    assert forced["weights_dtype_from"] == "option" and forced["memory"]["weight_bytes_per_device"] > 2.5 * file_bytes


def test_a_q4_k_m_mix_is_costed_tensor_by_tensor(kquant_source: tuple[ModelConfig, dict, dict], tmp_path: Path) -> None:
    """Q6_K ffn_down in layer 0 only, Q4_K elsewhere: the estimate's ffn_down bytes are the file's, per layer."""
    import json as json_module
    from dataclasses import replace

    import torch

    from llmtrace.tracer.core.contract import expected_shapes

    config, state, vocab = kquant_source
    two_layers = replace(config, n_layers=2, tie_embeddings=False, name="mix")
    rng = np.random.default_rng(5)
    raw = {}
    for ours, shape in expected_shapes(two_layers).items():
        if len(shape) == 2:
            name = llama_cpp_name(ours)
            qtype = Q.Q6_K if name == "blk.0.ffn_down.weight" else Q.Q8_0 if name == "token_embd.weight" else Q.Q4_K
            raw[name] = (random_blocks(qtype, shape[0], shape[1], rng), qtype)
    weights = {name: torch.zeros(shape) for name, shape in expected_shapes(two_layers).items()}
    path = write_tiny_gguf(tmp_path / "mix.gguf", two_layers, weights, vocab, raw_blocks=raw)
    header = read_gguf_header(path)
    down = [t.n_bytes for t in header.tensors if t.name.endswith("ffn_down.weight")]
    assert down == [256 * 512 // 256 * 210, 256 * 512 // 256 * 144]
    data = json_module.loads(CliRunner().invoke(app, ["flops", "--model", str(path), "--json"]).stdout)
    assert data["weights_dtype"] == "q4_k" and data["weights_dtype_from"] == "file"
    w2 = next(c for c in data["decode"]["components"] if c["name"] == "feed_forward.w2")
    assert w2["weight_bytes"] * 2 == sum(down)  # per instance: the mean of the two layers' stored bytes
    # untied: every matrix once, the LM head its own Q4_K matrix, and one gathered row of the Q8_0 embedding
    read = sum(t.n_bytes for t in header.tensors if t.name != "token_embd.weight") + 256 * 34 // 32
    assert data["decode"]["totals"]["weight_bytes"] == read


@pytest.mark.parametrize("qtype", [Q for Q in gguf.GGMLQuantizationType if int(Q) in native_kernel.TYPES],
                         ids=lambda q: q.name)
def test_the_native_scale_check_finds_each_fp16_field_not_finite(qtype: gguf.GGMLQuantizationType) -> None:
    """native_kernel.scales_finite (the loader's check of blocks held in the file's map, in one C pass): every fp16
    field of ggml-common.h's block (tiny_gguf.BLOCK_LAYOUTS) set to a NaN or an infinity in any block is found, as
    the numpy check finds it; finite blocks pass."""
    if not native_kernel.available():
        pytest.skip(f"native kernel not available here: {native_kernel.unavailable_reason()}")
    cols = 256
    raw = random_blocks(qtype, 3, cols, np.random.default_rng(int(qtype)))
    assert native_kernel.scales_finite(int(qtype), raw) is True and rows_scales_finite(int(qtype), raw)
    fields = [(name, count) for name, kind, count in BLOCK_LAYOUTS[qtype] if kind == "f16"]
    assert fields
    for name, count in fields:
        for at in (0, 1, raw.size // gguf.GGML_QUANT_SIZES[qtype][1] - 1):  # first, second and last block
            for value in (np.nan, np.inf, -np.inf):
                bad = raw.copy()
                blocks = bad.reshape(-1).view(block_dtype(qtype))
                blocks[name][at] = np.full(count, value, dtype="<f2").reshape(blocks[name][at].shape)
                assert native_kernel.scales_finite(int(qtype), bad) is False, (name, at, value)
                assert not rows_scales_finite(int(qtype), bad)
    assert native_kernel.scales_finite(int(gguf.GGMLQuantizationType.IQ4_NL),
                                       random_blocks(gguf.GGMLQuantizationType.IQ4_NL, 1, 32,
                                                     np.random.default_rng(0))) is None
