"""Tensor parallelism over an HF folder (issue 31 item 2: "--tp 2, each rank maps only its shard"): each rank copies
its slice of every tensor out of the mapped safetensors files (tracer/load/tensor_parallel.py hf_shard_state_dict),
never the whole model. Ranks as threads (tests/tp_threads.py); the references are the whole checkpoint's tensors
sliced by hand and the single-process model."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import pytest
import torch
from tp_threads import run_ranks
from typer.testing import CliRunner

from llmtrace.cli.app import app
from llmtrace.tracer.core.config import ModelConfig
from llmtrace.tracer.core.dtypes import FP32
from llmtrace.tracer.load.hf_loader import load_hf_state_dict
from llmtrace.tracer.load.loader import load_model, plan_load
from llmtrace.tracer.load.tensor_parallel import hf_shard_state_dict, load_shard, shard_bytes

TOKENS = torch.tensor([[1, 50, 99, 7, 60, 98]])
NEXT = torch.tensor([[64]])


@pytest.mark.parametrize("shards, tie, bias", [(1, False, False), (2, True, True)])
def test_each_rank_reads_exactly_its_slices_of_the_folder(make_tiny_llama: Callable[..., Path], shards: int,
                                                          tie: bool, bias: bool) -> None:
    """Two safetensors files, a tied head and Q/K/V/O biases too (a padded last vocabulary slice: the shared
    shard_tensor, tests/test_tensor_parallel.py)."""
    folder = make_tiny_llama(f"tp-hf-{shards}-{tie}-{bias}", shards=shards, tie=tie, attention_bias=bias)
    config = ModelConfig.from_hf_json(folder)
    whole = load_hf_state_dict(folder, config)
    assert ("output.weight" in whole) is not tie and ("layers.0.attention.wo.bias" in whole) is bias
    q, ffn, vocab = config.n_heads * config.head_dim // 2, config.ffn_dim // 2, -(-config.vocab_size // 2)
    for rank in (0, 1):
        got, stored = hf_shard_state_dict(folder, config, torch.float32, rank, 2)
        assert stored == "fp32"
        assert got.keys() == whole.keys()
        for name, tensor in got.items():
            assert tensor.is_contiguous() and tensor.dtype == torch.float32, name
            want = whole[name]
            if name.endswith(("attention.wq.weight", "feed_forward.w1.weight", "feed_forward.w3.weight")):
                rows = want.shape[0] // 2
                want = want[rank * rows:(rank + 1) * rows]
            elif name.endswith(("attention.wk.weight", "attention.wv.weight", "attention.wk.bias",
                                "attention.wv.bias", "attention.wq.bias")):
                rows = want.shape[0] // 2
                want = want[rank * rows:(rank + 1) * rows]
            elif name.endswith("attention.wo.bias"):
                want = want if rank == 0 else torch.zeros_like(want)  # added once, after the all-reduce
            elif name.endswith("attention.wo.weight"):
                want = want[:, rank * q:(rank + 1) * q]
            elif name.endswith("feed_forward.w2.weight"):
                want = want[:, rank * ffn:(rank + 1) * ffn]
            elif name in ("tok_embeddings.weight", "output.weight"):
                want = want[rank * vocab:(rank + 1) * vocab]
                if want.shape[0] < vocab:  # the last slice padded with zero rows
                    want = torch.cat([want, want.new_zeros(vocab - want.shape[0], want.shape[1])])
            assert torch.equal(tensor, want), name


def test_tp2_over_an_hf_folder_equals_one_process(tiny_llama_dir: Path) -> None:
    single = load_model(str(tiny_llama_dir), dtype=FP32)
    model = single.model
    model.setup_cache(1, 16)
    with torch.no_grad():
        reference = (model.prefill(TOKENS), model.decode_one(NEXT), model(TOKENS))

    def body(rank: int, comm: Any) -> Any:
        loaded = load_shard(str(tiny_llama_dir), FP32, "cpu", rank, 2, comm)
        shard = loaded.model
        shard.setup_cache(1, 16)
        with torch.no_grad():
            return loaded, (shard.prefill(TOKENS), shard.decode_one(NEXT), shard(TOKENS))

    for rank, (loaded, outputs) in enumerate(run_ranks(2, body)):
        assert loaded.weight_format.endswith(f"-> fp32, tensor-parallel shard {rank + 1}/2")
        assert loaded.tokenizer.encode("The capital") == single.tokenizer.encode("The capital")
        for got, want in zip(outputs, reference, strict=True):
            assert got.shape == want.shape
            assert torch.allclose(got, want, atol=1e-4, rtol=0), (got - want).abs().max()
            assert torch.equal(got.argmax(-1), want.argmax(-1))


def test_shard_bytes_are_what_a_rank_then_holds(tiny_llama_dir: Path) -> None:
    plan = plan_load(str(tiny_llama_dir), FP32)
    for rank in (0, 1):
        state, _ = hf_shard_state_dict(tiny_llama_dir, plan.resolved.config, torch.float32, rank, 2)
        assert shard_bytes(plan, rank, 2) == sum(t.numel() * t.element_size() for t in state.values())


def test_cli_says_what_the_shards_need_when_they_cannot_fit(tiny_llama_dir: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """One line before any rank starts, as for a GGUF (tests/test_tensor_parallel_stored.py)."""
    from llmtrace.tracer.hardware import memory

    plan = plan_load(str(tiny_llama_dir), FP32)
    need = shard_bytes(plan, 0, 2) + shard_bytes(plan, 1, 2)
    monkeypatch.setattr(memory, "available_memory_bytes", lambda: need)  # 90% of it is what a run may take
    result = CliRunner().invoke(app, ["run", "hi", "--model", str(tiny_llama_dir), "--tp", "2", "--dtype", "fp32"])
    assert result.exit_code == 2
    line = result.stderr.strip()
    assert "\n" not in line
    assert f"--tp 2: the 2 ranks' shards of {tiny_llama_dir.name} in fp32 need {need / 1e9:.1f} GB" in line


def test_dry_run_tp_shows_the_embedding_bytes_rank_0_then_holds(tiny_llama_dir: Path, tmp_path: Path) -> None:
    from llmtrace.cli.render_run import embedding_table
    from llmtrace.tracer.trace.run_trace import Trace

    out = tmp_path / "dry.json"
    result = CliRunner().invoke(app, ["run", "hi", "--model", str(tiny_llama_dir), "--dry-run", "--tp", "2",
                                      "--dtype", "fp32", "--json", str(out)])
    assert result.exit_code == 0, result.output
    trace = Trace.from_json(out.read_text(encoding="utf-8"))
    _, shown = embedding_table(trace.config, next(s for s in trace.stages if s.kind == "embedding"), 2)
    state, _ = hf_shard_state_dict(tiny_llama_dir, trace.config, torch.float32, 0, 2)
    assert shown == state["tok_embeddings.weight"].nbytes == trace.config.vocab_size // 2 * trace.config.dim * 4
