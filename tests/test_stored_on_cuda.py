"""A GGUF's matrices held as stored on CUDA (tracer/model/weight_formats.py INT4_OPS, PackedWeight.to; the loader;
the kernel choice's candidates there).

Everything but the GPU's own arithmetic runs on the CPU here: the CUDA int4 ops' input bytes and the shapes torch's
meta functions give them, PackedWeight.to, the loader's refusal of a plan that cannot run on the device (before it
asks whether the machine has one), and the candidates `pick` times on "cuda" (an injected timer). The tests marked
`gpu` need one (skipped without): int4pack products against gguf's dequantizer, the bundled model's greedy " Paris"
and auto's candidates."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import gguf
import numpy as np
import pytest
import torch
from conftest import fixed_timings
from gguf.quants import dequantize as gguf_dequantize
from typer.testing import CliRunner

from llmtrace.cli.app import app
from llmtrace.tracer.checkpoint.bundled import bundled_model_path
from llmtrace.tracer.checkpoint.gguf_header import read_gguf_header
from llmtrace.tracer.checkpoint.resolve import resolve_model
from llmtrace.tracer.core.dtypes import AUTO, FP32
from llmtrace.tracer.core.errors import HardwareError
from llmtrace.tracer.load import kernel_pick
from llmtrace.tracer.load.loader import load_model
from llmtrace.tracer.load.stored_weights import STORED
from llmtrace.tracer.model import native_kernel
from llmtrace.tracer.model.weight_formats import (
    BLOCKS,
    DENSE,
    INT4_OPS,
    INT4PACK,
    NATIVE,
    device_refusal,
    int4_layout,
    pack_gguf,
)
from llmtrace.tracer.run.generate import generate
from llmtrace.tracer.trace.records import DECODE, RunSettings
from tests.tiny_gguf import random_blocks

Q = gguf.GGMLQuantizationType
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU on this machine")


# ---- the CUDA int4 ops' input, on the CPU ---------------------------------------------------------------------------


def test_cuda_codes_hold_the_even_column_in_the_high_nibble() -> None:
    """int4mm.cu reads byte j of a row as values 2j (high nibble) and 2j+1 (low): 16 * even + odd."""
    codes = torch.randint(0, 16, (8, 64), generator=torch.Generator().manual_seed(0), dtype=torch.int32)
    packed = INT4_OPS["cuda"].codes(codes)
    assert packed.dtype == torch.uint8 and packed.shape == (8, 32)
    assert torch.equal(packed.to(torch.int32), codes[:, 0::2] * 16 + codes[:, 1::2])
    assert torch.equal(INT4_OPS["cpu"].codes(codes), codes)  # the CPU op takes the int32 codes themselves


@pytest.mark.parametrize(("rows", "cols", "tiles"), [(50, 576, 4), (1536, 576, 4), (576, 1536, 8), (48, 1152, 8),
                                                     (8, 32, 2), (9, 96, 2)])
def test_cuda_layout_fits_the_kernels_checks(rows: int, cols: int, tiles: int) -> None:
    """On meta tensors (torch's meta function of _convert_weight_to_int4pack: no GPU needed): N padded to a multiple
    of 16 (NVIDIA's kernel needs 8, ROCm's repack writes 16-row tiles), the widest k-tiling that divides K, and the shapes _weight_int4pack_mm's checks in int4mm.cu ask for:
    B.size(1) == K / (tiles * 16), scales_and_zeros (K/32, 8 * B.size(0), 2)."""
    meta = {"device": "meta"}
    codes = torch.empty(rows, cols, dtype=torch.int32, **meta)
    scale, zero = torch.empty(rows, cols // 32, **meta), torch.empty(rows, cols // 32, **meta)
    packed, scales_zeros = int4_layout(lambda start, stop: codes[start:stop], rows, scale, zero, INT4_OPS["cuda"])
    padded = -(-rows // 16) * 16
    assert packed.dtype == torch.int32 and packed.shape == (padded // 8, cols // (tiles * 16), 32, tiles // 2)
    assert scales_zeros.dtype == torch.bfloat16 and scales_zeros.shape == (cols // 32, 8 * packed.shape[0], 2)


@pytest.mark.parametrize("qtype", [Q.Q4_1, Q.Q8_0], ids=lambda q: q.name)
def test_codes_widened_a_few_rows_at_a_time_give_the_same_layout(qtype: Q, monkeypatch: pytest.MonkeyPatch) -> None:
    """int4_layout widens the codes to int32 in row chunks (a GPU's memory): chunks of one row and of all rows give
    the same layout, so the same products, bit for bit (on the CPU's ops; the CUDA ones take the same chunks)."""
    from llmtrace.tracer.model import weight_formats

    raw = random_blocks(qtype, 37, 256, np.random.default_rng(5))
    x = torch.randn(2, 256, generator=torch.Generator().manual_seed(2))
    whole = pack_gguf(raw, int(qtype), 256, INT4PACK)(x)
    monkeypatch.setattr(weight_formats, "_CODE_VALUES", 1)  # one row a chunk
    assert torch.equal(pack_gguf(raw, int(qtype), 256, INT4PACK)(x), whole)


# ---- PackedWeight.to ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kernel", [INT4PACK, BLOCKS])
def test_to_gives_a_new_weight_with_the_same_products(kernel: str) -> None:
    raw = random_blocks(Q.Q4_1, 24, 256, np.random.default_rng(3))
    weight = pack_gguf(raw, int(Q.Q4_1), 256, kernel)
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(1))
    before = weight(x)
    moved = weight.to("cpu")
    assert moved is not weight and moved.format == weight.format and moved.stored_bytes == weight.stored_bytes
    assert moved.tensors.keys() == weight.tensors.keys() and moved.device == torch.device("cpu")
    assert torch.equal(moved(x), before)  # its int4 layout made again, from the same tensors: the same bits


def test_the_native_librarys_weights_stay_on_the_cpu() -> None:
    if not native_kernel.available():
        pytest.skip(native_kernel.unavailable_reason())
    weight = pack_gguf(random_blocks(Q.Q8_0, 8, 64, np.random.default_rng(4)), int(Q.Q8_0), 64, NATIVE)
    assert weight.to("cpu") is weight
    with pytest.raises(HardwareError) as exc:
        weight.to("cuda")  # refused before any tensor moves: no GPU needed
    assert str(exc.value) == ("the native kernel is llmtrace's C library, which runs on the CPU only; on cuda use "
                              "--weights int4pack, blocks or dense")
    with pytest.raises(HardwareError, match="int4pack kernel runs on cpu and cuda only; on mps use --weights dense"):
        pack_gguf(random_blocks(Q.Q8_0, 8, 64, np.random.default_rng(4)), int(Q.Q8_0), 64, INT4PACK).to("mps")
    with pytest.raises(HardwareError) as exc:  # only what runs there is offered instead
        weight.to("mps")
    assert str(exc.value) == ("the native kernel is llmtrace's C library, which runs on the CPU only; on mps use "
                              "--weights dense")
    assert device_refusal([DENSE], "meta") == ""  # dense runs wherever torch does


# ---- the loader -----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("weights", "named"), [("native", "native"), ("i8dot", "i8dot"),
                                                ("Q4_1:i8dot,Q8_0:int4pack", "i8dot"),
                                                ("Q4_1:int4pack,Q8_0:i16dot", "i16dot")])
def test_a_plan_of_the_native_librarys_kernels_is_refused_on_cuda(weights: str, named: str) -> None:
    """Before whether this machine has a GPU: such a plan is wrong on any machine, so the line says what to use."""
    if not native_kernel.available():
        pytest.skip(native_kernel.unavailable_reason())
    with pytest.raises(HardwareError) as exc:
        load_model(None, FP32, device="cuda", weights=weights)
    message = str(exc.value)
    assert "\n" not in message
    assert message == (f"--weights {weights}: the {named} kernel is llmtrace's C library, which runs on the CPU "
                       "only; on cuda use --weights int4pack, blocks or dense")


def test_the_refusal_on_the_command_line_is_one_line_and_exit_2() -> None:
    if not native_kernel.available():
        pytest.skip(native_kernel.unavailable_reason())
    result = CliRunner().invoke(app, ["run", "capital", "--device", "cuda", "--weights", "native"])
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert "llmtrace: error: --weights native: the native kernel is llmtrace's C library, which runs on the CPU " \
           "only; on cuda use --weights int4pack, blocks or dense\n" in result.output


def test_stored_weights_are_refused_on_a_device_without_torch_kernels() -> None:
    with pytest.raises(HardwareError) as exc:
        load_model(None, FP32, device="mps", weights="int4pack")
    assert str(exc.value) == "--weights int4pack: the int4pack kernel runs on cpu and cuda only; on mps use --weights " \
                             "dense"


# ---- tune's candidates on CUDA -------------------------------------------------------------------------


def test_cuda_candidates_are_the_dense_dtypes_and_torchs_stored_kernels(
        monkeypatch: pytest.MonkeyPatch, tiny_quantized: Callable[[Any], Path], tmp_path: Path) -> None:
    """A Q4_0 file on "cuda" (timer injected; nothing runs on a GPU: Q4_0 needs no probe of int4pack or bf16): the
    dense dtypes and int4pack, blocks, timed on the device; none of the C library's kernels, which the same file
    offers on the CPU."""
    timed: list[tuple[tuple[str, ...], str]] = []

    def timer(kernels: Any, config: Any, device: str = "cpu", progress: Any = None) -> Any:
        timed.append((tuple(k.name for k in kernels), device))
        return fixed_timings(kernels, config)

    monkeypatch.setattr(kernel_pick, "machine_key", lambda device: f"{device}|a test GPU")
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *args, **kwargs: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *args: (9, 0))
    resolved = resolve_model(str(tiny_quantized(Q.Q4_0)), vocabulary=True)
    picked = kernel_pick.tune(resolved, torch.device("cuda"), timer=timer, store_path=tmp_path / "kernels.json")
    assert timed == [(("fp32", "fp16", "bf16", INT4PACK, BLOCKS), "cuda")]
    assert picked.choice.picked == INT4PACK and picked.choice.weights == STORED  # fixed timings: int4pack fastest
    on_cpu = kernel_pick.tune(resolved, torch.device("cpu"), timer=timer, store_path=tmp_path / "cpu.json")
    assert set(timed[1][0]) - set(timed[0][0]) == ({"i8dot", NATIVE} if native_kernel.available() else set())
    assert on_cpu.choice.picked == INT4PACK
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *args: (7, 5))  # older than torch's int4 kernel
    older = kernel_pick.tune(resolved, torch.device("cuda"), timer=timer, store_path=tmp_path / "older.json")
    assert timed[2] == (("fp32", "fp16", "bf16", BLOCKS), "cuda") and older.choice.picked == BLOCKS


def test_int4pack_is_refused_on_a_gpu_older_than_its_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *args: (7, 5))
    with pytest.raises(HardwareError) as exc:
        load_model(None, FP32, device="cuda", weights="Q4_1:int4pack,Q8_0:blocks")
    assert str(exc.value) == ("--weights Q4_1:int4pack,Q8_0:blocks: the int4pack kernel needs a GPU of compute "
                              "capability 8.0 or later (PyTorch builds it for those only), this one is 7.5; use "
                              "--weights blocks or dense")


# ---- on a GPU -------------------------------------------------------------------------------------------------------


@gpu
@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1, Q.Q4_K, Q.Q8_0])
def test_int4pack_products_on_cuda_match_ggufs_dequantizer(qtype: Q) -> None:
    """As tests/test_weight_formats.py on the CPU: within 2^-6 of sum |x| |w| (bf16 activations, scales and values:
    CUDA's kernel also rounds each dequantized value to bf16, one more rounding of 2^-9)."""
    rng = np.random.default_rng(int(qtype))
    rows, cols = 48, 512
    raw = random_blocks(qtype, rows, cols, rng)
    weight = pack_gguf(raw, int(qtype), cols, INT4PACK).to("cuda")
    reference = torch.from_numpy(np.asarray(gguf_dequantize(raw, qtype), dtype=np.float32))  # (48, 512)
    for tokens in (1, 5):
        x = torch.randn(tokens, cols, generator=torch.Generator().manual_seed(tokens))
        got = weight(x.cuda())
        assert got.device.type == "cuda" and got.dtype == torch.float32 and got.shape == (tokens, rows)
        bound = float((x.abs() @ reference.abs().T).max()) * 2**-6
        torch.testing.assert_close(got.cpu(), x @ reference.T, rtol=0, atol=bound)
    assert weight._prepared is not None and weight._prepared[0].device.type == "cuda"  # CUDA's layout, made there


@gpu
def test_the_bundled_model_as_stored_on_cuda_answers_paris() -> None:
    """int4pack on the GPU: every matrix on the device as stored, a decode step reads the file's bytes (plus the
    token's Q8_0 embedding row), the greedy answer is " Paris"."""
    loaded = load_model(None, FP32, device="cuda", weights=INT4PACK)
    assert loaded.weights.mode == STORED and loaded.weights.kernel == INT4PACK
    assert {w.device.type for w in loaded.model.stored_weights().values()} == {"cuda"}
    settings = RunSettings(model="", prompt="The capital of France is", max_new_tokens=3, temperatures=())
    trace = generate(loaded, settings)
    assert loaded.tokenizer.decode([trace.steps[0].token_id]) == " Paris"
    file_bytes = sum(t.n_bytes for t in read_gguf_header(bundled_model_path()).tensors)
    step = [s for s in trace.stages if s.phase == DECODE and s.step == 1]
    assert sum(s.weight_bytes_read for s in step) == file_bytes + 576 * 34 // 32


@gpu
def test_the_default_on_cuda_runs_int4pack_for_q4_matrices() -> None:
    """The default table's CUDA row: Q4_1 on torch's int4 kernel, the Q8_0 head dequantized; nothing measured."""
    loaded = load_model(None, AUTO, device="cuda")
    assert loaded.kernels.source == "default" and loaded.kernels.instruction_set == "CUDA"
    assert loaded.kernels.picked == "Q4_1:int4pack" and not loaded.kernels.candidates
