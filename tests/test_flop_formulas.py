"""tracer/core/flop_formulas.py against values derived by hand (2 FLOPs per multiply-add)."""

from __future__ import annotations

import pytest

from llmtrace.tracer.core import flop_formulas as ff


def test_linear_is_two_flops_per_multiply_add() -> None:
    # LLaMA-7B's wq on one token: a 4096 x 4096 matrix-vector product = 16,777,216 MACs.
    assert ff.linear_flops(1, 4096, 4096) == 33_554_432
    # SwiGLU gate on 128 tokens: 128 * 4096 * 11008 MACs.
    assert ff.linear_flops(128, 4096, 11008) == 2 * 5_771_362_304
    assert ff.macs(ff.linear_flops(3, 5, 7)) == 105


def test_attention_products_are_dense_over_every_pair() -> None:
    # B=2, H=32, T=1, S=129, D=128: 2 * 2*32*1*129*128 = 2,113,536 for each of QKᵀ and PV.
    assert ff.attention_scores_flops(2, 32, 1, 129, 128) == 2_113_536
    assert ff.attention_values_flops(2, 32, 1, 129, 128) == 2_113_536
    # A full causal prefill of 5 tokens executes all 25 pairs.
    assert ff.attention_scores_flops(1, 1, 5, 5, 1) == 50


@pytest.mark.parametrize(
    ("q_len", "kv_len", "pairs"),
    [
        (5, 5, 15),  # 1+2+3+4+5
        (1, 7, 7),  # a decode step sees every cached key
        (3, 10, 27),  # queries at positions 7, 8, 9 see 8 + 9 + 10 keys
        (2048, 2048, 2_098_176),  # 2048 * 2049 / 2
    ],
)
def test_causal_useful_pairs(q_len: int, kv_len: int, pairs: int) -> None:
    assert ff.causal_useful_pairs(q_len, kv_len) == pairs


def test_causal_pairs_reject_more_queries_than_keys() -> None:
    with pytest.raises(ValueError):
        ff.causal_useful_pairs(4, 3)


def test_causal_product_counts_only_kept_pairs() -> None:
    # 128-token prefill, 32 heads, D=128: 8,256 kept pairs of 16,384.
    assert ff.causal_attention_product_flops(1, 32, 128, 128, 128) == 2 * 32 * 8256 * 128


def test_elementwise_constants() -> None:
    assert ff.rmsnorm_flops(2, 4096) == 2 * (4 * 4096 + 3)
    assert ff.rope_flops(1, 32, 8, 128) == 3 * (32 + 8) * 128
    assert ff.softmax_flops(1, 32, 1, 100) == 5 * 32 * 100
    assert ff.score_scale_flops(1, 32, 1, 100) == 32 * 100
    assert ff.swiglu_activation_flops(4, 11008) == 6 * 4 * 11008
    assert ff.residual_flops(4, 4096) == 4 * 4096
    assert ff.embedding_flops(100, 4096) == 0
