"""Roofline predictions checked against values derived by hand here (not by calling the code under test).

LLaMA-7B by hand: d=4096, 32 layers, 32 heads of 128 (no GQA), FFN 11008, vocab 32000.
  per layer matrices: 4*4096^2 + 3*4096*11008 = 67,108,864 + 135,266,304 = 202,375,168 parameters
  LM head 4096*32000 = 131,072,000; embedding table the same size (a decode step gathers one row of it)
  one decode step reads, in fp16: 2 bytes * (32 * 202,375,168 + 131,072,000 + one embedding row 4096
  + norm vectors 65 * 4096) = 13,214,695,424 bytes of weights
  KV cache: 2 (K, V) * 32 layers * 4096 * 2 bytes = 524,288 bytes per position
"""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from llmtrace.tracer.analytic import estimate
from llmtrace.tracer.analytic.kernels import Kernels
from llmtrace.tracer.analytic.tensor_parallel import device_cost
from llmtrace.tracer.core.dtypes import FP8, FP16, FP32, INT4, INT8, get_dtype
from llmtrace.tracer.core.errors import BadArgumentError, HardwareError
from llmtrace.tracer.core.presets import get_preset
from llmtrace.tracer.hardware.profiles import get_profile
from llmtrace.tracer.roofline.analysis import bound_pass, compute_dtype_for, machine_for, roofline
from llmtrace.tracer.roofline.compare import compare_with_measured

A100 = get_profile("a100-80gb")
H100 = get_profile("h100-sxm")
LLAMA_7B_LAYER_MATRICES = 4 * 4096**2 + 3 * 4096 * 11008
LLAMA_7B_DECODE_WEIGHT_BYTES = 2 * (32 * LLAMA_7B_LAYER_MATRICES + 4096 * 32000 + 4096 + 65 * 4096)
KV_BYTES_PER_POSITION_7B = 2 * 32 * 4096 * 2
GiB = 2**30


def test_hand_constants() -> None:
    assert LLAMA_7B_DECODE_WEIGHT_BYTES == 13_214_695_424
    assert KV_BYTES_PER_POSITION_7B == 524_288  # the well-known 0.5 MiB per token


# ---- the seed's question: llama-7b fp16 on an A100 80GB -------------------------------------------------------


def test_llama7b_decode_batch1_is_memory_bound_at_about_6_6_ms() -> None:
    r = roofline(get_preset("llama-7b"), A100, prompt_len=128, new_tokens=2, dtype=FP16)
    d = r.first_decode
    assert d is not None and d.kv_len == 129
    assert d.weight_bytes == LLAMA_7B_DECODE_WEIGHT_BYTES
    assert d.kv_read_bytes == KV_BYTES_PER_POSITION_7B * 129
    assert d.kv_write_bytes == KV_BYTES_PER_POSITION_7B
    assert d.activation_bytes < 0.002 * d.bytes  # a decode step's activations are negligible
    assert d.bound == "memory"
    assert d.memory_seconds == pytest.approx(d.bytes / 2.039e12, rel=1e-12)
    # ~13.3 GB / 2.039 TB/s: the 13.5 GB / 2.04 TB/s = 6.6 ms, 150 tokens/s
    assert 6.4e-3 < d.seconds < 6.7e-3
    assert 149 < r.generation.tokens_per_s_per_sequence < 156
    # matmul FLOPs: 2 per weight of every layer matrix and the LM head, plus QK^T and PV over 129 positions
    matmul = 2 * (32 * LLAMA_7B_LAYER_MATRICES + 4096 * 32000) + 2 * 2 * 32 * 129 * 128 * 32
    assert d.flops == pytest.approx(matmul, rel=1e-3)  # + elementwise work, under 0.1%
    assert d.compute_seconds == pytest.approx(d.flops / 312e12)
    # compute alone would allow ~23,000 tokens/s: the seed's "33,000" with its 9.3 GFLOP undercount
    assert 22_000 < 1 / d.compute_seconds < 24_000
    assert d.arithmetic_intensity == pytest.approx(1.0, abs=0.01)


def test_llama7b_prefill_2048_is_compute_bound() -> None:
    r = roofline(get_preset("llama-7b"), A100, prompt_len=2048, new_tokens=1, dtype=FP16, kernels="eager")
    p = r.prefill
    dense_attention = 2 * 2 * 32 * 2048 * 2048 * 128 * 32  # QK^T and PV over all 2048^2 pairs, 32 layers
    matmul = 2 * 2048 * 32 * LLAMA_7B_LAYER_MATRICES + 2 * 4096 * 32000 + dense_attention  # LM head: last position
    assert matmul == 28_725_003_419_648
    assert p.flops == pytest.approx(matmul, rel=2e-3)
    assert p.bound == "compute"
    assert p.arithmetic_intensity > A100.ridge_point("fp16")
    assert p.seconds == pytest.approx(p.flops / 312e12)
    assert 0.090 < r.generation.ttft_seconds < 0.095
    assert r.first_decode is None and r.generation.decode_steps == 0
    assert r.generation.tokens_per_s_per_sequence is None


def test_gqa_kv_traffic_shrinks_by_the_head_ratio() -> None:
    gqa = get_preset("llama2-70b")  # 64 query heads share 8 KV heads
    mha = replace(gqa, name="llama2-70b-mha", n_kv_heads=64)
    kw = dict(prompt_len=1000, new_tokens=2, dtype=INT4, check_fit=False)
    a = roofline(gqa, H100, **kw).first_decode
    b = roofline(mha, H100, **kw).first_decode
    assert b.kv_read_bytes == 8 * a.kv_read_bytes
    assert b.kv_write_bytes == 8 * a.kv_write_bytes
    # by hand: 2 * 80 layers * 8 KV heads * 128 * 2 bytes (fp16 cache) * 1001 positions
    assert a.kv_read_bytes == 2 * 80 * 8 * 128 * 2 * 1001


# ---- batching -------------------------------------------------------------------------------------------------


def test_crossover_batch_is_ridge_over_per_sequence_intensity() -> None:
    r = roofline(get_preset("llama-7b"), A100, prompt_len=128, new_tokens=2, dtype=FP16)
    c = r.crossover
    assert c.ridge_point == pytest.approx(312e12 / 2.039e12)
    assert c.shared_bytes == LLAMA_7B_DECODE_WEIGHT_BYTES - 2 * 4096  # the embedding row is per sequence
    assert c.per_sequence_intensity == pytest.approx(c.per_sequence_flops / c.shared_bytes)
    assert c.crossover_batch_weights_only == pytest.approx(c.ridge_point / c.per_sequence_intensity)
    # fp16: ~2 FLOPs per weight per sequence over 2 bytes per weight -> ~1 FLOP/byte, so the crossover ~ the ridge
    assert 145 < c.crossover_batch_weights_only < 155


def test_exact_crossover_is_where_the_bound_flips() -> None:
    cfg = get_preset("llama3-8b")  # GQA 4:1 keeps the per-sequence KV traffic small
    r = roofline(cfg, A100, prompt_len=16, new_tokens=2, dtype=FP16, check_fit=False)
    b = r.crossover.crossover_batch
    assert b is not None and b > r.crossover.crossover_batch_weights_only  # KV traffic pushes it later
    at = roofline(cfg, A100, prompt_len=16, new_tokens=2, batch=b, dtype=FP16, check_fit=False).last_decode
    below = roofline(cfg, A100, prompt_len=16, new_tokens=2, batch=b - 1, dtype=FP16, check_fit=False).last_decode
    assert at.bound == "compute" and below.bound == "memory"


def test_mha_at_long_context_never_turns_compute_bound() -> None:
    r = roofline(get_preset("llama-7b"), A100, prompt_len=1900, new_tokens=100, dtype=FP16)
    c = r.crossover
    assert c.crossover_batch is None
    # each sequence reads its own 0.5 MiB * ~2000 positions of KV per step for ~13 GFLOP: ~13 FLOPs/byte at most
    assert c.intensity_limit < c.ridge_point
    assert c.intensity_limit == pytest.approx(c.per_sequence_flops / c.per_sequence_bytes)
    assert all(row.bound == "memory" for row in r.batch_table)


def test_batch_table_marks_where_the_kv_cache_stops_fitting() -> None:
    r = roofline(get_preset("llama-7b"), A100, prompt_len=1000, new_tokens=25, dtype=FP16)
    # by hand: 80 GiB - 13.48 GB of weights leaves room for floor(free / (0.5 MiB * 1024 positions + the fused
    # kernels' largest working set, w1's: 1000 rows of 4096 in and 11008 out, 2 bytes each)) sequences
    weights = 2 * 6_738_415_616
    per_sequence = KV_BYTES_PER_POSITION_7B * 1024 + 1000 * (4096 + 11008) * 2
    assert r.memory.activation_bytes_per_device == 1000 * (4096 + 11008) * 2
    assert r.memory.weight_bytes_per_device == weights
    assert r.memory.max_batch == (80 * GiB - weights) // per_sequence
    rows = {row.batch: row for row in r.batch_table}
    assert rows[r.memory.max_batch].fits  # the table shows the largest batch that fits...
    assert [b for b, row in rows.items() if not row.fits] == [b for b in rows if b > r.memory.max_batch] != []
    for row in r.batch_table:
        assert row.tokens_per_s_total == pytest.approx(row.batch * row.tokens_per_s_per_sequence)
        assert row.fits == (row.memory_bytes_per_device + row.batch * r.memory.activation_bytes_per_device
                            <= 80 * GiB)


# ---- a whole generation -----------------------------------------------------------------------------------


@pytest.mark.parametrize("batch", [1, 250])
def test_decode_total_equals_the_sum_of_every_step(batch: int) -> None:
    """The closed-form sum against a brute-force loop over every step, incl. a generation whose bound flips."""
    cfg = get_preset("llama3-8b")
    dtypes = estimate.Dtypes.for_weights(get_dtype("fp16"))
    r = roofline(cfg, A100, prompt_len=16, new_tokens=300, batch=batch, dtype=FP16, check_fit=False)
    assert r.kernels == "fused" and r.kernels_from == "default"  # a GPU profile
    machine = machine_for(A100, get_dtype("fp16"))
    steps = [bound_pass("step", phase, device_cost(cfg, phase, 2, 1), machine)
             for phase in (estimate.decode_step(cfg, cached, dtypes, batch, Kernels.FUSED)
                           for cached in range(16, 16 + 299))]
    assert r.generation.decode_seconds == pytest.approx(sum(s.seconds for s in steps), rel=1e-9)
    memory_steps = sum(1 for s in steps if s.bound == "memory")
    assert r.generation.memory_bound_decode_steps == memory_steps
    if batch == 250:
        assert 0 < memory_steps < 299  # compute-bound early, memory-bound once the cache has grown
    assert r.generation.total_seconds == pytest.approx(r.generation.ttft_seconds + r.generation.decode_seconds)
    assert r.generation.tokens_per_s_total == pytest.approx(batch * 299 / r.generation.decode_seconds)


# ---- tensor parallelism -------------------------------------------------------------------------------------


def test_tensor_parallel_splits_weights_kv_and_adds_allreduce() -> None:
    cfg = get_preset("llama2-70b")
    r4 = roofline(cfg, H100, prompt_len=512, new_tokens=128, batch=8, dtype=FP16, tp=4)
    # by hand: 68,976,648,192 parameters in fp16; the 161 norm vectors of 8192 are replicated
    norms = 2 * 8192 * 161
    assert r4.memory.weight_bytes_per_device == (2 * 68_976_648_192 - norms) // 4 + norms
    # KV: 2 * 80 layers * 8 KV heads * 128 * 2 bytes per position, 639 positions, batch 8, over 4 devices
    assert r4.memory.kv_bytes_per_device == 2 * 80 * 8 * 128 * 2 * 639 * 8 // 4
    t = r4.tensor_parallel
    assert t.decode_payload_bytes == 8 * 1 * 8192 * 2  # B * T * d * 2 bytes
    assert t.prefill_payload_bytes == 8 * 512 * 8192 * 2
    # 80 layers * 2 all-reduces * ring share 2(N-1)/N = 1.5 of the payload
    assert t.decode_comm_bytes_per_step == 80 * 2 * 3 * 8 * 8192 * 2 // 2
    assert t.decode_comm_seconds_per_step == pytest.approx(t.decode_comm_bytes_per_step / 450e9)  # NVLink 900/2
    assert t.prefill_comm_seconds == pytest.approx(80 * 2 * 1.5 * t.prefill_payload_bytes / 450e9)

    r1 = roofline(cfg, H100, prompt_len=512, new_tokens=128, batch=8, dtype=FP16, tp=1, check_fit=False)
    d1, d4 = r1.last_decode, r4.last_decode
    assert d4.flops == pytest.approx(d1.flops / 4, rel=1e-3)  # only norms and residuals are replicated
    assert d4.kv_read_bytes == d1.kv_read_bytes // 4
    assert d4.seconds == pytest.approx(max(d4.compute_seconds, d4.memory_seconds) + t.decode_comm_seconds_per_step)
    assert d1.comm_seconds == 0 and r1.tensor_parallel.decode_comm_bytes_per_step == 0


def test_tp_that_does_not_divide_the_heads() -> None:
    with pytest.raises(BadArgumentError, match=r"--tp 3 does not divide llama2-70b's 64 query heads.*--tp 2, 4, 8"):
        roofline(get_preset("llama2-70b"), H100, tp=3)
    with pytest.raises(BadArgumentError, match="--tp 16 does not divide llama3.1-405b's 8 KV heads"):
        roofline(get_preset("llama3.1-405b"), H100, tp=16, dtype=FP8)


def test_tp_without_an_interconnect() -> None:
    with pytest.raises(HardwareError, match="m3-max has no interconnect"):
        roofline(get_preset("llama-7b"), get_profile("m3-max"), tp=2)


# ---- bad input ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kwargs, message", [
    (dict(batch=0), "--batch must be an integer >= 1, got 0"),
    (dict(batch=-3), "--batch must be an integer >= 1, got -3"),
    (dict(prompt_len=0), "--prompt-len must be"),
    (dict(new_tokens=0), "--max-new-tokens must be"),
    (dict(tp=0), "--tp must be an integer >= 1"),
])
def test_bad_arguments(kwargs: dict, message: str) -> None:
    with pytest.raises(BadArgumentError, match=message):
        roofline(get_preset("llama-7b"), A100, **kwargs)


def test_model_that_does_not_fit_says_by_how_much() -> None:
    # llama2-70b fp16: 137.95 GB = 128.5 GiB of weights on an 80 GiB card: ~48.5 GiB short (+ KV)
    with pytest.raises(HardwareError) as err:
        roofline(get_preset("llama2-70b"), A100, prompt_len=512, new_tokens=128, dtype=FP16)
    msg = str(err.value)
    assert "llama2-70b (fp16) does not fit on a100-80gb" in msg
    assert "weights 128.5 GiB" in msg and "has 80.0 GiB" in msg
    assert "48.7 GiB short" in msg  # 128.48 GiB weights + 0.20 GiB KV - 80 GiB
    assert "--tp 2" in msg
    assert "\n" not in msg


def test_a_smaller_dtype_hint_names_only_smaller_dtypes() -> None:
    with pytest.raises(HardwareError) as err:
        roofline(get_preset("llama2-70b"), get_profile("a100-40gb"), prompt_len=512, new_tokens=128, dtype=INT8)
    assert "a smaller --dtype (fp8, int4)" in str(err.value)


def test_kv_cache_that_does_not_fit_suggests_a_batch() -> None:
    with pytest.raises(HardwareError, match=r"does not fit on l4: .* short; try --batch \d+"):
        roofline(get_preset("llama-7b"), get_profile("l4"), prompt_len=2000, new_tokens=48, batch=64)


# ---- dtypes -----------------------------------------------------------------------------------------------------


def test_compute_dtype_follows_the_weights_and_the_hardware() -> None:
    assert compute_dtype_for(get_dtype("bf16"), A100) == ("bf16", "")
    assert compute_dtype_for(get_dtype("fp8"), H100) == ("fp8", "")
    dtype, note = compute_dtype_for(get_dtype("fp8"), A100)  # no fp8 tensor cores on Ampere
    assert dtype == "fp16" and "dequantized" in note
    assert compute_dtype_for(get_dtype("int4"), H100)[0] == "fp16"


def test_int4_weights_quarter_the_decode_traffic_and_kv_dtype_applies() -> None:
    cfg = get_preset("llama-7b")
    fp16 = roofline(cfg, A100, prompt_len=128, new_tokens=2, dtype=FP16).first_decode
    int4 = roofline(cfg, A100, prompt_len=128, new_tokens=2, dtype=INT4).first_decode
    # Q4_0: 18 bytes per 32 weights (4.5 bits) against 64 bytes in fp16
    assert int4.weight_bytes == pytest.approx(fp16.weight_bytes * 18 / 64, rel=1e-3)
    kv8 = roofline(cfg, A100, prompt_len=128, new_tokens=2, dtype=FP16, kv_dtype=INT8)
    # Q8_0 cache: 34 bytes per 32 values against 64
    assert kv8.first_decode.kv_read_bytes == fp16.kv_read_bytes * 34 // 64
    assert kv8.kv_dtype == "int8"


# ---- measured vs bound (the API `llmtrace run` calls) --------------------------------------------------------


def test_compare_with_measured_reports_percent_of_bound() -> None:
    cfg = get_preset("smollm2-135m")
    cmp = compare_with_measured(cfg, A100, prompt_len=10, new_tokens=33, measured_ttft_s=0.01,
                                measured_decode_tokens_per_s=500.0, dtype=FP32)
    # the run executed llmtrace's eager kernels, so the bound is costed under them whatever the hardware
    report = roofline(cfg, A100, prompt_len=10, new_tokens=33, dtype=FP32, check_fit=False, kernels="eager")
    assert cmp.kernels == "eager"
    assert cmp.predicted_ttft_s == report.generation.ttft_seconds
    assert cmp.ttft_percent_of_bound == pytest.approx(100 * report.generation.ttft_seconds / 0.01)
    assert cmp.predicted_decode_tokens_per_s == report.generation.tokens_per_s_per_sequence
    assert cmp.decode_percent_of_bound == pytest.approx(100 * 500.0 / report.generation.tokens_per_s_per_sequence)
    assert cmp.compute_dtype == "fp32" and cmp.decode_bound == "memory"
    single = compare_with_measured(cfg, A100, prompt_len=10, new_tokens=1, measured_ttft_s=0.01,
                                   measured_decode_tokens_per_s=None)
    assert single.decode_percent_of_bound is None and single.predicted_decode_tokens_per_s is None
    with pytest.raises(BadArgumentError, match="measured TTFT must be > 0"):
        compare_with_measured(cfg, A100, 10, 2, measured_ttft_s=0.0, measured_decode_tokens_per_s=1.0)
    with pytest.raises(BadArgumentError, match="decode tokens/s must be > 0"):
        compare_with_measured(cfg, A100, 10, 2, measured_ttft_s=0.1, measured_decode_tokens_per_s=None)


# ---- the kernel model (eager vs fused) ---------------------------------------------------------------------
#
# llama3.1-8b by hand: d=4096, 32 layers, 32 query heads and 8 KV heads of 128, FFN 14336, vocab 128256, untied.
#   per layer matrices: 2*4096^2 + 2*4096*1024 + 3*4096*14336 = 218,103,808; LM head 4096*128256 = 525,336,576
#   fp16 weights a pass reads: 2 * (32 * 218,103,808 + 525,336,576 + 65 norm vectors of 4096) + the gathered rows

L31_LAYER = 2 * 4096**2 + 2 * 4096 * 1024 + 3 * 4096 * 14336
L31_HEAD = 4096 * 128256


def _causal_prefill_flops(p: int) -> int:
    """Matmul FLOPs of a causal prefill of p tokens, attention over the p(p+1)/2 kept pairs (elementwise apart)."""
    return 2 * p * 32 * L31_LAYER + 2 * L31_HEAD + 2 * 2 * 32 * (p * (p + 1) // 2) * 128 * 32


def _minimal_prefill_bytes(p: int) -> int:
    """Weights once (embedding: the p gathered rows), the KV cache written once: what no kernel can avoid."""
    weights = 2 * (32 * L31_LAYER + L31_HEAD + 65 * 4096) + p * 4096 * 2
    return weights + p * 2 * 32 * 1024 * 2


def test_hand_constants_llama31_8b() -> None:
    assert L31_LAYER == 218_103_808
    assert _causal_prefill_flops(8192) == 131_944_593_489_920  # 0.133 s at H100's 989.5 TFLOP/s


@pytest.mark.parametrize(("hardware", "prompt", "ttft"), [(H100, 8192, 0.1336), (H100, 32768, 0.7502),
                                                          (A100, 32768, 2.379)])
def test_fused_prefill_meets_the_causal_compute_bound(hardware, prompt: int, ttft: float) -> None:
    """With fused kernels TTFT is within 1.2x of max(causal FLOPs / peak, minimal bytes / bandwidth)."""
    r = roofline(get_preset("llama3.1-8b"), hardware, prompt_len=prompt, new_tokens=1, dtype=FP16)
    assert r.kernels == "fused" and r.kernels_from == "default"
    floor = max(_causal_prefill_flops(prompt) / hardware.fp16, _minimal_prefill_bytes(prompt) / hardware.memory_bandwidth)
    assert r.prefill.bound == "compute"
    # compute-bound, so the floor is the causal FLOPs at peak, and TTFT sits above it by exactly the elementwise
    # work (norms, softmax, ...) counted on top of the causal matmuls
    assert floor == _causal_prefill_flops(prompt) / hardware.fp16
    assert r.generation.ttft_seconds / floor == pytest.approx(r.prefill.flops / _causal_prefill_flops(prompt), rel=1e-12)
    # compute-bound: TTFT is exactly the counted FLOPs at peak, and what they add to the causal matmuls is the
    # elementwise work: above 0, under 1% (0.18% at 8k, 0.47% at 32k)
    assert r.generation.ttft_seconds == pytest.approx(r.prefill.flops / hardware.fp16, rel=1e-12)
    causal = _causal_prefill_flops(prompt)
    assert 0.001 * causal < r.prefill.flops - causal < 0.01 * causal
    assert r.generation.ttft_seconds == pytest.approx(ttft, rel=5e-4)  # the figures: 0.134, 0.750, 2.38 s
    assert r.prefill.flops == r.prefill.useful_flops  # masked tiles skipped: nothing computed beyond the causal pairs


def test_eager_prefill_is_what_llmtrace_runs_and_much_slower() -> None:
    """Eager materialises the scores: at 8k they are 32 heads * 8192^2 * 2 bytes = 4.3 GB per op per layer."""
    cfg = get_preset("llama3.1-8b")
    eager = roofline(cfg, H100, prompt_len=8192, new_tokens=1, dtype=FP16, kernels="eager")
    fused = roofline(cfg, H100, prompt_len=8192, new_tokens=1, dtype=FP16, kernels="fused")
    assert eager.kernels == "eager" and eager.kernels_from == "option"
    assert eager.prefill.bound == "memory" and eager.generation.ttft_seconds > 2 * fused.generation.ttft_seconds
    dense_attention = 2 * 2 * 32 * 8192 * 8192 * 128 * 32
    assert eager.prefill.flops - fused.prefill.flops > 0.99 * (dense_attention // 2)  # the masked half
    assert eager.memory.activation_bytes_per_device == 2 * 32 * 8192 * 8192 * 2  # scores in, scaled scores out


def test_materialised_scores_that_cannot_fit_are_caught() -> None:
    """Eager at 32k: scale reads 68.7 GB of scores and writes as much: 137 GB on an 80 GiB card."""
    cfg = get_preset("llama3.1-8b")
    with pytest.raises(HardwareError) as err:
        roofline(cfg, H100, prompt_len=32768, new_tokens=1, dtype=FP16, kernels="eager")
    msg = str(err.value)
    assert "eager kernels' largest activations 128.0 GiB" in msg  # 2 * 32 * 32768^2 * 2 bytes = 128 GiB
    assert "--kernels fused" in msg and "\n" not in msg
    fused = roofline(cfg, H100, prompt_len=32768, new_tokens=1, dtype=FP16)
    assert fused.memory.fits
    assert fused.memory.activation_bytes_per_device == 32768 * (4096 + 14336) * 2  # w1: x in, silu(gate)*up out


def test_decode_crossover_by_hand_under_both_kernel_models() -> None:
    """llama3-8b fp16 on an A100, prompt 128, 128 new tokens: the batch table's step attends 255 positions.

    Per sequence per step: FLOPs F1 (matrices, attention over 255 keys, elementwise) and bytes K1 (KV read and
    written, its embedding row, the activations between kernels); shared: W, the weights. Compute-bound from
    B = ceil(ridge * W / (F1 - ridge * K1)).
    """
    d, q, f, s = 4096, 4096, 14336, 255
    ridge = 312e12 / 2.039e12
    w = 2 * (32 * L31_LAYER + L31_HEAD + 65 * 4096)
    elementwise = 32 * (2 * (4 * d + 3) + 3 * (32 + 8) * 128 + 6 * 32 * s + 6 * f + 2 * d) + 4 * d + 3
    f1 = 2 * (32 * L31_LAYER + L31_HEAD) + 2 * 2 * 32 * s * 128 * 32 + elementwise
    kv = (s + 1) * 32 * 2 * 1024 * 2  # K and V of 255 positions read, the new one written
    # fused, per layer: wq x in q out, attention q in and out, wo q in x out, w1 x in F out, w2 F in x out, two
    # residual skip inputs; then the embedding row written, the LM head's x in and logits out
    fused_act = 32 * (6 * d + 4 * q + 2 * f) * 2 + 2 * d * 2 + 128256 * 2
    k1_fused = kv + 4096 * 2 + fused_act
    r = roofline(get_preset("llama3-8b"), A100, prompt_len=128, new_tokens=128, dtype=FP16)
    c = r.crossover
    assert c.kv_len == s and c.shared_bytes == w and c.per_sequence_flops == f1
    assert c.per_sequence_bytes == k1_fused
    assert c.crossover_batch == math.ceil(ridge * w / (f1 - ridge * k1_fused)) == 248
    # weights and KV alone (no kernel moves activations) would give 230; eager's 15.3 MB more per sequence, 300
    assert math.ceil(ridge * w / (f1 - ridge * (kv + 4096 * 2))) == 230
    eager = roofline(get_preset("llama3-8b"), A100, prompt_len=128, new_tokens=128, dtype=FP16, kernels="eager")
    assert eager.crossover.crossover_batch == 300


def test_kernel_model_choice() -> None:
    from llmtrace.tracer.analytic.kernels import default_kernels, parse_kernels

    assert default_kernels(A100) is Kernels.FUSED
    assert default_kernels(replace(A100, name="this-machine", measured=True)) is Kernels.EAGER
    assert parse_kernels("Fused") is Kernels.FUSED
    with pytest.raises(BadArgumentError, match="--kernels must be eager or fused, got 'flash'"):
        roofline(get_preset("llama-7b"), A100, kernels="flash")


def test_a_run_read_as_stored_is_bounded_by_the_files_bytes() -> None:
    """`run` on a GGUF read as stored passes the file's tensors (run_roofline's `stored`): the decode bound is then
    the stored bytes over the bandwidth (plus a small KV cache and activations), not the fp32 matrices' bytes."""
    from llmtrace.tracer.analytic.flops_report import weights_as_stored
    from llmtrace.tracer.checkpoint.resolve import bundled_source, resolve_model

    resolved = resolve_model(bundled_source())
    stored = weights_as_stored(resolved)
    file_bytes = sum(n_bytes for _, n_bytes, _ in stored)
    assert 90e6 < file_bytes < 100e6  # Q4_1 layers and a Q8_0 embedding/head: 96.6 MB
    cfg = resolved.config
    as_stored = compare_with_measured(cfg, A100, prompt_len=10, new_tokens=33, measured_ttft_s=0.01,
                                      measured_decode_tokens_per_s=500.0, dtype=FP32, stored=stored)
    dense = compare_with_measured(cfg, A100, prompt_len=10, new_tokens=33, measured_ttft_s=0.01,
                                  measured_decode_tokens_per_s=500.0, dtype=FP32)
    report = roofline(cfg, A100, prompt_len=10, new_tokens=33, dtype=FP32, check_fit=False, kernels="eager",
                      stored=stored)
    assert as_stored.predicted_decode_tokens_per_s == report.generation.tokens_per_s_per_sequence
    moved = as_stored.predicted_time_per_output_token_s * as_stored.memory_bandwidth  # memory-bound: bytes a step
    assert as_stored.decode_bound == "memory" and file_bytes <= moved < 1.05 * file_bytes
    dense_moved = dense.predicted_time_per_output_token_s * dense.memory_bandwidth
    assert dense_moved > 5 * file_bytes  # ~540 MB of fp32 matrices: what the run did not read
