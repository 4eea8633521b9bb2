"""Memory at the sizes users run, checked on small models (issue 31, items 2 and 6): `run --dry-run`'s bytes and
`kvmem`'s are the ones a run then uses (the stored weights, the cache dtype it allocates), a request that cannot fit
is one line before loading, and what the memory check counts is what the loaded model holds. The 7B/8B figures
live in benchmarks/bench_scale.py."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Callable

import gguf
import pytest
import torch
from typer.testing import CliRunner

from llmtrace.cli.app import app
from llmtrace.tracer.analytic.kvmem import kv_cache_bytes, run_cache_dtype
from llmtrace.tracer.checkpoint.gguf_header import read_gguf_header
from llmtrace.tracer.checkpoint.resolve import resolve_model
from llmtrace.tracer.core.dtypes import BF16, FP32
from llmtrace.tracer.core.errors import HardwareError
from llmtrace.tracer.load import memory_fit
from llmtrace.tracer.load.loader import load_model
from llmtrace.tracer.load.stored_weights import DENSE, WeightsChoice
from llmtrace.tracer.model import native_kernel
from llmtrace.tracer.run.generate import generate
from llmtrace.tracer.trace.records import DECODE, PREFILL, RunSettings

Q = gguf.GGMLQuantizationType
SETTINGS = RunSettings(model="", prompt="The capital of France is", max_new_tokens=2, temperatures=())


@pytest.fixture(autouse=True)
def _private_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LLMTRACE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))


def _bytes_by_stage(trace, phase: str) -> dict[str, tuple[int, str]]:  # noqa: ANN001 - a Trace
    step = 0 if phase == PREFILL else 1
    return {s.stage: (s.weight_bytes_read, s.weight_format) for s in trace.stages
            if s.phase == phase and s.step == step}


@pytest.mark.parametrize("kernel", ["native", "i8dot", "int4pack", "dense"])
def test_dry_run_counts_the_bytes_the_run_reads(kernel: str, tiny_quantized: Callable[..., Path]) -> None:
    """A Q4_0 file with a Q8_0 head: every stage of the dry run's prefill and decode step reads the bytes the real
    run's same stage reads, under the same --weights (the stored bytes where a kernel runs the matrix as stored,
    fp32 where it is dequantized), with the same format label."""
    if kernel in ("native", "i8dot") and not native_kernel.available():
        pytest.skip(native_kernel.unavailable_reason())
    path = str(tiny_quantized(Q.Q4_0, Q.Q8_0))
    real = load_model(path, FP32, weights=kernel)
    dry = load_model(path, FP32, weights=kernel, dry_run=True)
    assert dry.weights == real.weights
    ran, counted = generate(real, SETTINGS), generate(dry, replace(SETTINGS, dry_run=True))
    for phase in (PREFILL, DECODE):
        assert _bytes_by_stage(counted, phase) == _bytes_by_stage(ran, phase), phase
    if kernel != "dense":  # the stored file's matrices, each once, plus the norms in fp32
        header = read_gguf_header(path)
        matrices = sum(t.n_bytes for t in header.tensors if len(t.shape) == 2 and t.name != "token_embd.weight")
        norms = sum(t.n_bytes for t in header.tensors if len(t.shape) == 1)
        decode = [s for s in counted.stages if s.phase == DECODE and s.step == 1 and s.kind != "embedding"]
        assert sum(s.weight_bytes_read for s in decode) == matrices + norms


def test_dry_run_of_a_7b_shaped_file_reads_its_stored_bytes(tmp_path: Path) -> None:
    """The issue's case at full size, on the meta device (nothing is read but the header): a LLaMA-7B-shaped Q4_0
    file's dry run under i8dot reads its stored 3.8 GB a decode step (it reported 26.7 GB of fp32 before)."""
    if not native_kernel.available():
        pytest.skip(native_kernel.unavailable_reason())
    path = _seven_b_header_only(tmp_path)
    dry = load_model(str(path), FP32, weights="i8dot", dry_run=True)
    trace = generate(dry, replace(SETTINGS, dry_run=True))
    decode = sum(s.weight_bytes_read for s in trace.stages if s.phase == DECODE and s.step == 1)
    header = read_gguf_header(path)
    stored = sum(t.n_bytes for t in header.tensors if t.name != "token_embd.weight")
    assert decode == stored + 4096 // 32 * 18  # plus the one embedding row the step looks up (Q4_0)
    assert 3.7e9 < decode < 3.9e9


def _seven_b_header_only(folder: Path) -> Path:
    """A GGUF with LLaMA-7B's tensors (Q4_0, Q6_K head, F32 norms) whose data section is a sparse hole: the header
    is real, the file takes no disk, and a dry run reads no data."""
    from tiny_gguf import sentencepiece_vocab
    from tiny_llama import train_sentencepiece

    vocab = sentencepiece_vocab(train_sentencepiece())
    pad = 32000 - len(vocab["tokens"])
    vocab["tokens"] += [f"<unused{i}>" for i in range(pad)]
    vocab["scores"] += [-1e9] * pad
    vocab["types"] += [gguf.TokenType.UNUSED] * pad
    path = folder / "llama-7b.Q4_0.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    for add, value in ((writer.add_block_count, 32), (writer.add_context_length, 4096),
                       (writer.add_embedding_length, 4096), (writer.add_feed_forward_length, 11008),
                       (writer.add_head_count, 32), (writer.add_head_count_kv, 32), (writer.add_vocab_size, 32000)):
        add(value)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(vocab["tokens"])
    writer.add_token_scores(vocab["scores"])
    writer.add_token_types(vocab["types"])
    writer.add_bos_token_id(vocab["bos"])
    writer.add_eos_token_id(vocab["eos"])
    writer.add_unk_token_id(vocab["unk"])
    import numpy as np

    def matrix(name: str, rows: int, cols: int, qtype: Q) -> None:
        block, size = gguf.GGML_QUANT_SIZES[qtype]
        writer.add_tensor_info(name, (rows, cols // block * size), np.dtype(np.uint8), rows * cols // block * size,
                               raw_dtype=qtype)

    matrix("token_embd.weight", 32000, 4096, Q.Q4_0)
    for i in range(32):
        writer.add_tensor_info(f"blk.{i}.attn_norm.weight", (4096,), np.dtype(np.float32), 4 * 4096)
        for part in ("attn_q", "attn_k", "attn_v", "attn_output"):
            matrix(f"blk.{i}.{part}.weight", 4096, 4096, Q.Q4_0)
        writer.add_tensor_info(f"blk.{i}.ffn_norm.weight", (4096,), np.dtype(np.float32), 4 * 4096)
        matrix(f"blk.{i}.ffn_gate.weight", 11008, 4096, Q.Q4_0)
        matrix(f"blk.{i}.ffn_up.weight", 11008, 4096, Q.Q4_0)
        matrix(f"blk.{i}.ffn_down.weight", 4096, 11008, Q.Q4_0)
    writer.add_tensor_info("output_norm.weight", (4096,), np.dtype(np.float32), 4 * 4096)
    matrix("output.weight", 32000, 4096, Q.Q6_K)
    sizes = [info.nbytes for info in writer.tensors[0].values()]
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    writer.fout[0].flush()
    data_offset = writer.ggml_pad(writer.fout[0].tell(), writer.data_alignment)
    writer.close()
    with open(path, "r+b") as fh:  # the data section as a hole: the offsets the header promises, no blocks written
        fh.truncate(data_offset + sum(writer.ggml_pad(n, writer.data_alignment) for n in sizes))
    return path


def _bf16_copy(folder: Path, tmp_path: Path) -> Path:
    """The tiny HF folder with its tensors stored in bf16."""
    import shutil

    from safetensors.torch import load_file, save_file

    out = tmp_path / "bf16"
    shutil.copytree(folder, out)
    tensors = {k: v.to(torch.bfloat16) for k, v in load_file(str(folder / "model.safetensors")).items()}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def test_kvmem_defaults_to_the_cache_run_allocates(tiny_quantized: Callable[..., Path],
                                                  make_tiny_llama: Callable[..., Path], tmp_path: Path) -> None:
    """kvmem's bytes without --dtype are those of the KV cache `run` allocates: fp32 for a GGUF (its activations),
    bf16 for a bf16 checkpoint, the run's own cache tensor measured."""
    runner = CliRunner()
    for path, expected in ((tiny_quantized(Q.Q4_0), FP32), (_bf16_copy(make_tiny_llama("default"), tmp_path), BF16)):
        resolved = resolve_model(str(path))
        assert run_cache_dtype(resolved.weights)[0] == expected
        report = json.loads(runner.invoke(app, ["kvmem", "--model", str(path), "--seq", "40", "--json"]).stdout)
        model = load_model(str(path), expected).model  # the dtype run computes it in
        model.setup_cache(1, 40)
        assert report["size"]["dtype"] == expected.name
        assert report["size"]["total_bytes"] == model._kv_all.nbytes == kv_cache_bytes(resolved.config, 40, expected)
    text = runner.invoke(app, ["kvmem", "--model", str(tiny_quantized(Q.Q4_0)), "--seq", "40"]).stdout
    assert "fp32, as `run` allocates it for a GGUF; --dtype for another" in text
    assert "fp16" not in json.loads(runner.invoke(app, ["kvmem", "--seq", "2000", "--json"]).stdout)["size"]["dtype"]


def _file_ranges(path: str) -> list[tuple[int, int]]:
    """The address ranges this process maps `path` at (/proc/self/maps)."""
    real = str(Path(path).resolve())
    ranges = []
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and fields[5] == real:
            low, high = (int(x, 16) for x in fields[0].split("-"))
            ranges.append((low, high))
    return ranges


def _held_bytes(model: torch.nn.Module, path: str, in_map: bool = False) -> int:
    """Bytes of every distinct tensor the model holds: its dense parameters, and each stored matrix's tensors, its
    torch kernel's layout and i8dot's interleaved rows, its fused products' copies (shared storage counted once);
    not views of the file's map (file pages, which the kernel reclaims when it needs the memory); `in_map`: only
    those views."""
    mapped = _file_ranges(path)
    seen: dict[int, int] = {}

    def add(t: torch.Tensor | None) -> None:
        if t is None or t.is_meta or any(low <= t.data_ptr() < high for low, high in mapped) != in_map:
            return
        storage = t.untyped_storage()
        seen[storage.data_ptr()] = max(seen.get(storage.data_ptr(), 0), storage.nbytes())

    for module in model.modules():
        for p in list(module.parameters(recurse=False)):
            add(p)
        for packed in (getattr(module, "packed", None), getattr(module, "fused_packed", None)):
            if packed is None:
                continue
            groups = packed.row_blocks.groups if packed.row_blocks is not None else ()
            for t in (*packed.tensors.values(), *(packed._prepared or ()), *groups):
                add(t)
    return sum(seen.values())


@pytest.mark.parametrize("kernel", ["native", "i8dot", "int4pack", "dense"])
def test_the_memory_check_counts_what_the_model_holds(kernel: str, tiny_quantized: Callable[..., Path]) -> None:
    """memory_fit.weights_held, computed from the header before loading, equals the bytes the loaded model holds
    once it has run (layouts made, Q|K|V and gate|up fused): the arena's blocks, torch's tensors and layouts,
    dense fp32 tensors, and the blocks the C library's kernels read in place from the file's map (a decode step
    reads every one of them: they are its working set, though file pages)."""
    if kernel in ("native", "i8dot") and not native_kernel.available():
        pytest.skip(native_kernel.unavailable_reason())
    path = str(tiny_quantized(Q.Q4_0, Q.Q8_0))
    loaded = load_model(path, FP32, weights=kernel)
    generate(loaded, SETTINGS)
    expected, _ = memory_fit.weights_held(resolve_model(path), loaded.weights, FP32)
    in_map = _held_bytes(loaded.model, path, in_map=True)
    assert _held_bytes(loaded.model, path) + in_map == expected
    assert (in_map > 0) == (kernel in ("native", "i8dot"))  # Q8_0 under either, Q4_0 under native (issue 31)


def test_a_model_that_cannot_fit_is_one_line_before_loading(tiny_quantized: Callable[..., Path],
                                                            monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """With less memory available than the weights need: exit 2, one line naming what it needs and what the
    machine has, and nothing converted (no cache entry written)."""
    path = str(tiny_quantized(Q.Q4_0))
    need, _ = memory_fit.weights_held(resolve_model(path), WeightsChoice(DENSE, ""), FP32)
    monkeypatch.setattr(memory_fit, "available_memory_bytes", lambda: need)  # 90% of it is less than the need
    with pytest.raises(HardwareError, match="needs .* of memory for its weights, this machine has .* available"):
        load_model(path, FP32, weights="dense", use_cache=True)
    result = CliRunner().invoke(app, ["run", "--model", path, "hi", "--dtype", "fp32", "--weights", "dense",
                                      "--max-new-tokens", "1", "--no-roofline"])
    assert result.exit_code == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "--weights stored holds the file's" in lines[0], result.stderr
    assert not list((tmp_path / "cache").rglob("*.safetensors"))  # nothing was converted and cached


def test_an_hf_folder_is_held_once_in_its_own_dtype(make_tiny_llama: Callable[..., Path], tmp_path: Path) -> None:
    """A bf16 folder run in bf16: Q|K|V and gate|up are one bf16 tensor per layer, written at load in the members'
    order, which the fused plan uses as it is (no copy of its own after a run); every other matrix is still a view
    of the mapped file, the norms too; so the model holds the checkpoint's bytes once: the packed copies, and the
    mapped rest. In fp32 nothing is bf16 any more. Same logits as the tensors loaded plainly."""
    folder = _bf16_copy(make_tiny_llama("default"), tmp_path)
    path = str(folder / "model.safetensors")
    loaded = load_model(str(folder), BF16)
    layer = loaded.model.layers[0]
    before = layer.attention.wq.weight.data_ptr()
    generate(loaded, SETTINGS)
    qkv = [layer.attention.wq.weight, layer.attention.wk.weight, layer.attention.wv.weight]
    assert qkv[0].data_ptr() == before  # the fused plan did not copy them
    assert qkv[1].data_ptr() == qkv[0].data_ptr() + qkv[0].nbytes and all(w.dtype == torch.bfloat16 for w in qkv)
    mapped = _file_ranges(path)
    assert any(low <= layer.attention.wo.weight.data_ptr() < high for low, high in mapped)
    packed = sum(w.nbytes for block in loaded.model.layers for w in (
        block.attention.wq.weight, block.attention.wk.weight, block.attention.wv.weight,
        block.feed_forward.w1.weight, block.feed_forward.w3.weight))
    norms = [p for n, p in loaded.model.named_parameters() if "norm" in n]  # never copied: views of the file
    assert all(any(low <= p.data_ptr() < high for low, high in mapped) for p in norms)
    assert _held_bytes(loaded.model, path) == packed
    fp32 = load_model(str(folder), FP32).model
    assert all(p.dtype == torch.float32 for p in fp32.parameters())
    from llmtrace.tracer.load.hf_loader import load_hf_state_dict
    from llmtrace.tracer.model.transformer import build_meta_model

    config = loaded.config
    plain = build_meta_model(config)  # the mapped tensors as they are, the fused plan packing them itself
    plain.load_weights(load_hf_state_dict(folder, config))
    tokens = torch.tensor([[1, 5, 9, 14]])
    plain.setup_cache(1, 8)
    loaded.model.setup_cache(1, 8)
    assert torch.equal(plain.prefill(tokens), loaded.model.prefill(tokens))
