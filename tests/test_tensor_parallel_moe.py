"""A mixture of experts under --tp (issue 29): every rank holds every expert's F/N columns (w1 and w3 split by rows
per expert, w2 by the values of each row, as the dense FFN), the router whole, and one all-reduce after the FFN sums
the weighted partial outputs; Qwen2-MoE's shared expert split alike, its gate whole. A GGUF's experts stay as stored
on each rank (each expert's rows of this rank one contiguous byte range of its shard, read from the file's 3-D
tensor). What must hold: the ranks' logits are one process's (prefill, a decode step, a cache-free pass), each rank
holds (E, F/N, d) experts as stored, and `run --tp 2` (spawned ranks) generates one process's tokens."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from test_mixtral import mixtral_dict
from test_qwen2 import _bundled_vocab
from test_qwen2_moe import qwen2_moe_dict
from tiny_gguf import write_tiny_gguf
from tiny_llama import random_weights
from tp_threads import run_ranks

from llmtrace.tracer.core.config import ModelConfig
from llmtrace.tracer.core.dtypes import FP32
from llmtrace.tracer.load.loader import load_model
from llmtrace.tracer.load.tensor_parallel import load_shard
from llmtrace.tracer.model import native_kernel
from llmtrace.tracer.model.weight_formats import ExpertWeights
from llmtrace.tracer.run.generate import generate
from llmtrace.tracer.run.tp_launch import run_tensor_parallel
from llmtrace.tracer.trace.records import RunSettings

Q8_0 = gguf.GGMLQuantizationType.Q8_0
E, K, F = 4, 2, 128  # F/2 = 64 values a rank of each w2 row: whole Q8_0 blocks of 32
TOKENS = torch.tensor([[3, 50, 99, 7, 60, 98]])
NEXT = torch.tensor([[64]])

pytestmark = [pytest.mark.skipif(not native_kernel.available(), reason="llmtrace's C kernels are not built here"),
              pytest.mark.usefixtures("private_dirs")]


@pytest.fixture(scope="module", params=["mixtral", "qwen2moe"])
def moe_gguf(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Q8_0 GGUF: a Mixtral-style 'llama' one (4 experts of 128, 2 a token), or a 'qwen2moe' one (the same
    experts, the softmax's weights, a shared expert of 128, Q/K/V biases)."""
    vocab = _bundled_vocab()
    folder = tmp_path_factory.mktemp(f"tp-{request.param}")
    data = mixtral_dict(vocab) | {"intermediate_size": F} if request.param == "mixtral" else \
        qwen2_moe_dict(vocab, False) | {"moe_intermediate_size": F, "shared_expert_intermediate_size": F}
    (folder / "config.json").write_text(json.dumps(data), encoding="utf-8")
    config = ModelConfig.from_hf_json(folder)
    weights = random_weights(config, seed=12)
    for name in [n for n in weights if n.endswith("feed_forward.router.weight")]:
        weights[name] = weights[name] * 10  # a sharp router: each token's choice far from a tie
    metadata = {"llama.expert_count": E, "llama.expert_used_count": K} if request.param == "mixtral" else {
        "qwen2moe.expert_count": E, "qwen2moe.expert_used_count": K, "qwen2moe.expert_feed_forward_length": F,
        "qwen2moe.expert_shared_feed_forward_length": F}
    return write_tiny_gguf(folder / "moe.gguf", config, weights, vocab, matrix_type=Q8_0, tokenizer_model="gpt2",
                           arch="llama" if request.param == "mixtral" else "qwen2moe", extra_metadata=metadata)


def _outputs(model: Any) -> tuple[torch.Tensor, ...]:
    model.setup_cache(1, 16)
    with torch.no_grad():
        return model.prefill(TOKENS), model.decode_one(NEXT), model(TOKENS)


@pytest.mark.parametrize("weights", ["native", "dense"])
def test_tp2_logits_equal_one_process(moe_gguf: Path, weights: str) -> None:
    """The experts as stored (each rank its rows of every expert, read from the file's 3-D tensors) or dequantized
    (the whole model's tensors sliced): the ranks' logits are one process's."""
    reference = _outputs(load_model(str(moe_gguf), dtype=FP32, weights=weights).model)

    def body(rank: int, comm: Any) -> Any:
        loaded = load_shard(str(moe_gguf), FP32, "cpu", rank, 2, comm, weights=weights)
        return loaded, _outputs(loaded.model)

    for rank, (loaded, outputs) in enumerate(run_ranks(2, body)):
        ffn = loaded.model.layers[1].feed_forward
        held = [ffn.w1.packed, ffn.w3.packed, ffn.w2.packed]
        if weights == "native":
            assert all(isinstance(w, ExpertWeights) for w in held)
            assert [w.shape for w in held] == [(E, F // 2, 64), (E, F // 2, 64), (E, 64, F // 2)]
        else:
            assert held == [None] * 3 and ffn.w2.weight.shape == (E, 64, F // 2)
        assert ffn.router.weight.shape == (E, 64)  # whole on every rank
        if ffn.shared_add is not None:
            assert ffn.shared_w2.weight.shape == (64, F // 2) and ffn.shared_gate.weight.shape == (1, 64)
        for got, want in zip(outputs, reference, strict=True):
            assert got.shape == want.shape
            assert (got - want).abs().max().item() < 1e-4, rank
            assert torch.equal(got.argmax(-1), want.argmax(-1))
        assert max(r.abs().max().item() for r in reference) > 1.0


def test_run_tp2_generates_the_one_process_tokens(moe_gguf: Path) -> None:
    """`run --tp 2` for real (two spawned ranks): the greedy tokens of one process, the experts as stored."""
    settings = RunSettings(model=str(moe_gguf), prompt="The capital of France is", max_new_tokens=5, dtype="fp32",
                           temperatures=())
    result = run_tensor_parallel(settings, FP32, 2, threads=1, timeout_s=120.0)
    assert result.status == "ok"
    one = generate(load_model(str(moe_gguf), dtype=FP32), settings)
    assert result.trace.generated_ids == one.generated_ids
    for mine, theirs in zip(result.trace.steps, one.steps, strict=True):
        for a, b in zip(mine.candidates, theirs.candidates, strict=True):
            assert a.token_id == b.token_id and abs(a.logit - b.logit) <= 1e-4
