"""Tensor parallelism over a GGUF's stored blocks (tracer/load/gguf_shard.py): each rank reads and holds only its
shard of each matrix as the file stores it, multiplied by the single-process run's kernel. Ranks as threads
(tests/tp_threads.py); the reference is the single-process model loaded with the same kernel, run stage by stage."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import gguf
import numpy as np
import pytest
import torch
from tp_threads import run_ranks
from typer.testing import CliRunner

from llmtrace.cli.app import app
from llmtrace.tracer.checkpoint.resolve import resolve_model
from llmtrace.tracer.core.dtypes import FP32
from llmtrace.tracer.core.errors import BadArgumentError
from llmtrace.tracer.load.gguf_shard import ShardReads, shard_header
from llmtrace.tracer.load.gguf_source import GGUFSource
from llmtrace.tracer.load.loader import load_model, plan_load
from llmtrace.tracer.load.tensor_parallel import load_shard, shard_bytes
from llmtrace.tracer.trace.hooks import Tracer

Q = gguf.GGMLQuantizationType
runner = CliRunner()
TOKENS = torch.tensor([[1, 50, 99, 7, 60, 98]])
NEXT = torch.tensor([[64]])


@pytest.fixture(scope="module")
def quantized(make_tiny_llama: Callable[..., Path], sp_model_bytes: bytes,
              tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """"Q4_0", "Q8_0", "Q4_1+Q8_0 head" (the bundled file's mix), "Q8_0 biases" (Q, K, V and O biases, F32: a
    column-parallel bias split, wo's added once): the tiny LLaMA (dim 64, GQA, untied) with an FFN of 128, whose rows split over 2 ranks at block boundaries (wo: 32 values a rank, w2: 64; blocks of 32). "Q4_K": a
    wider one whose rows are whole blocks of 256 and split over 2 ranks at their boundaries (q_dim 512: wo's 256
    values a rank; FFN 1024: w2's 512), not over 4 (wo's 128 values a rank lie inside a block)."""
    from tiny_gguf import block_dtype, llama_cpp_name, random_blocks, sentencepiece_vocab, write_tiny_gguf

    from llmtrace.tracer.core.config import ModelConfig
    from llmtrace.tracer.load.hf_loader import load_hf_state_dict

    made: dict[str, Path] = {}

    def make(which: str) -> Path:
        if which not in made:
            shapes: dict[str, Any] = dict(dim=512, n_heads=8, n_kv_heads=4, ffn_dim=1024) if which == "Q4_K" \
                else dict(ffn_dim=128, attention_bias=which.endswith("biases"))
            folder = make_tiny_llama(f"tp-{'wide' if which == 'Q4_K' else 'ffn128'}-{which[-6:]}", **shapes)
            config = ModelConfig.from_hf_json(folder)
            state = load_hf_state_dict(folder, config)
            qtype, raw = Q[which.split("+")[0].split(" ")[0]], {}
            if qtype == Q.Q4_K:  # gguf quantizes no K-quant: random blocks, scales small enough for sane logits
                rng = np.random.default_rng(3)
                for ours, tensor in state.items():
                    if tensor.ndim == 2:
                        blocks = random_blocks(qtype, tensor.shape[0], tensor.shape[1], rng)
                        fields = blocks.reshape(-1).view(block_dtype(qtype))
                        fields["d"] = rng.uniform(1e-4, 1e-3, fields["d"].shape).astype("<f2")
                        fields["dmin"] = rng.uniform(1e-4, 1e-3, fields["dmin"].shape).astype("<f2")
                        raw[llama_cpp_name(ours)] = (blocks, qtype)
            if which.endswith("head"):
                head = state["output.weight"].float().numpy()
                raw = {"output.weight": (gguf.quants.quantize(head, Q.Q8_0), Q.Q8_0)}
            path = tmp_path_factory.mktemp(f"tp-{which.replace(' ', '-').replace('+', '-')}") / "tiny.gguf"
            made[which] = write_tiny_gguf(path, config, state, sentencepiece_vocab(sp_model_bytes), matrix_type=qtype,
                                          raw_blocks=raw)
        return made[which]

    return make


def _single(path: Path, kernel: str) -> tuple[Any, tuple[torch.Tensor, ...]]:
    loaded = load_model(str(path), dtype=FP32, weights=kernel)
    model = loaded.model
    model.setup_cache(1, 16)
    with torch.no_grad():
        return loaded, (model.prefill(TOKENS), model.decode_one(NEXT), model(TOKENS))


def _ranks(path: Path, kernel: str, tp: int = 2) -> list[Any]:
    def body(rank: int, comm: Any) -> Any:
        loaded = load_shard(str(path), FP32, "cpu", rank, tp, comm, weights=kernel)
        model = loaded.model
        model.setup_cache(1, 16)
        with torch.no_grad():
            return loaded, (model.prefill(TOKENS), model.decode_one(NEXT), model(TOKENS))

    return run_ranks(tp, body)


@pytest.mark.parametrize("which, kernel", [("Q4_0", "native"), ("Q8_0", "native"), ("Q4_K", "native"),
                                           ("Q8_0 biases", "native"),
                                           ("Q4_0", "i8dot"), ("Q4_1+Q8_0 head", "i8dot")])
def test_tp2_over_stored_blocks_equals_one_process(quantized: Callable[[str], Path], which: str, kernel: str) -> None:
    """Same greedy tokens and logits (to fp32 summation order: a row-parallel product's two halves are added after
    the all-reduce) as one process with the same kernels; i8dot too, whose int8 activation blocks a split at block
    boundaries leaves as they were."""
    path = quantized(which)
    whole, reference = _single(path, kernel)
    ranks = _ranks(path, kernel)
    for loaded, outputs in ranks:
        assert loaded.kernels == whole.kernels and loaded.weights == whole.weights
        for got, want in zip(outputs, reference, strict=True):
            assert got.shape == want.shape
            assert torch.allclose(got, want, atol=1e-4, rtol=0), (got - want).abs().max()
            assert torch.equal(got.argmax(-1), want.argmax(-1))


def test_each_rank_holds_its_shard_as_stored(quantized: Callable[[str], Path]) -> None:
    """Every matrix of a rank is the single process's format and kernel; the ranks' stored bytes add up to the
    file's (the vocabulary's last slice padded by zero rows), and the trace counts each rank's at those sizes."""
    path = quantized("Q4_1+Q8_0 head")
    whole, _ = _single(path, "i8dot")
    mine = whole.model.stored_weights()
    config = whole.config
    ranks = _ranks(path, "i8dot")
    shards = [loaded.model.stored_weights() for loaded, _ in ranks]
    assert set(shards[0]) == set(shards[1]) == set(mine)
    for name, weight in mine.items():
        parts = [s[name] for s in shards]
        assert all(p.format == weight.format for p in parts), name
        if name in ("tok_embeddings", "output"):
            padded = -(-config.vocab_size // 2) * 2
            assert sum(p.stored_bytes for p in parts) == weight.stored_bytes // config.vocab_size * padded
        else:
            assert sum(p.stored_bytes for p in parts) == weight.stored_bytes, name
        assert sum(p.resident_bytes for p in parts) <= weight.resident_bytes + 2 * weight.stored_bytes // config.dim
    plan = plan_load(str(path), FP32, weights="i8dot")
    assert shard_bytes(plan, 0, 2) == shard_bytes(plan, 1, 2)
    held = sum(w.stored_bytes for n, w in shards[0].items())
    norms = sum(t.nbytes for n, t in ranks[0][0].model.state_dict().items() if n.endswith("norm.weight"))
    assert shard_bytes(plan, 0, 2) == held + norms

    def traced(rank: int, comm: Any) -> dict[str, int]:
        model = load_shard(str(path), FP32, "cpu", rank, 2, comm, weights="i8dot").model
        model.setup_cache(1, 16)
        with Tracer(model, mechanism="wrap") as t:
            t.begin_step("prefill", 0)
            model.prefill(TOKENS)
            t.end_step()
        return {s.stage: s.weight_bytes_read for s in t.records()}

    per_rank = run_ranks(2, traced)
    for name in ("layers.0.attention.wq", "layers.1.attention.wo", "layers.0.feed_forward.w2"):
        assert per_rank[0][name] == per_rank[1][name] == mine[name].stored_bytes // 2


def test_shard_reads_are_the_whole_files_blocks(quantized: Callable[[str], Path]) -> None:
    """A row-parallel shard's rows are the file's rows cut at the rank's blocks; a column-parallel one is the rank's
    rows; the last vocabulary slice ends in zero bytes."""
    path = quantized("Q4_0")
    resolved = resolve_model(str(path))
    header = resolved.gguf_header
    assert header is not None
    by_name = {i.name: i for i in header.tensors}
    with GGUFSource(header) as source:
        def whole(name: str) -> torch.Tensor:
            info = by_name[name]
            raw = source.read(header.data_offset + info.offset, info.n_bytes)
            return torch.from_numpy(raw).view(info.shape[-1], -1)

        for rank in (0, 1):
            sheader, spans = shard_header(header, resolved.config, rank, 2)
            reads = ShardReads(source, spans)
            mine = {i.name: i for i in sheader.tensors}

            def shard(name: str) -> torch.Tensor:
                info = mine[name]
                return torch.from_numpy(reads.read(info.offset, info.n_bytes)).view(info.shape[-1], -1)

            down, gate = whole("blk.0.ffn_down.weight"), whole("blk.0.ffn_gate.weight")
            half = down.shape[1] // 2  # 128 values = 4 Q4_0 blocks of 18 bytes: 36 bytes a row a rank
            assert torch.equal(shard("blk.0.ffn_down.weight"), down[:, rank * half:(rank + 1) * half])
            assert torch.equal(shard("blk.0.ffn_gate.weight"), gate[rank * 64:(rank + 1) * 64])
            embedding = whole("token_embd.weight")
            rows = -(-embedding.shape[0] // 2)
            got = shard("token_embd.weight")
            assert torch.equal(got[:embedding.shape[0] - rank * rows], embedding[rank * rows:(rank + 1) * rows])
            assert not got[embedding.shape[0] - rank * rows:].any()
            # a read that starts mid-row
            info = mine["blk.1.attn_output.weight"]
            assert torch.equal(torch.from_numpy(reads.read(info.offset + 5, 40)),
                               shard("blk.1.attn_output.weight").view(-1)[5:45])


def test_a_split_inside_a_block_is_refused_naming_the_valid_tp(quantized: Callable[[str], Path]) -> None:
    with pytest.raises(BadArgumentError) as caught:
        load_shard(str(quantized("Q4_K")), FP32, "cpu", 0, 4, None, weights="native")  # type: ignore[arg-type]
    message = str(caught.value)
    assert message.startswith("--tp 4 would split blk.0.attn_output.weight (Q4_K: 512 values a row in blocks of "
                              "256) inside a block")
    assert message.endswith("use --tp 1, 2, or --weights dense") and "\n" not in message


@pytest.mark.parametrize("inside_a_block", [False, True])
def test_dense_shards(quantized: Callable[[str], Path], tiny_quantized: Callable[..., Path],
                      inside_a_block: bool) -> None:
    """--weights dense: each rank dequantizes its own blocks, or where the split falls inside a block (an FFN of 96,
    48 values a rank) the whole file's values, then keeps its slices; the logits are the single process's."""
    path = tiny_quantized(Q.Q8_0) if inside_a_block else quantized("Q8_0")
    _, reference = _single(path, "dense")
    for loaded, outputs in _ranks(path, "dense"):
        assert not loaded.model.stored_weights()
        for got, want in zip(outputs, reference, strict=True):
            assert torch.allclose(got, want, atol=1e-4, rtol=0)


def test_cli_refuses_a_split_inside_a_block_before_starting_ranks(quantized: Callable[[str], Path]) -> None:
    result = runner.invoke(app, ["run", "hi", "--model", str(quantized("Q4_K")), "--tp", "4", "--weights", "native"])
    assert result.exit_code == 2
    assert result.stderr.strip().count("\n") == 0
    assert "--tp 4 would split blk.0.attn_output.weight" in result.stderr and "use --tp 1, 2" in result.stderr


def test_cli_says_what_the_shards_need_when_they_cannot_fit(quantized: Callable[[str], Path],
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """One line before any rank starts: what the ranks' shards need together and a rank alone, what is available."""
    from llmtrace.tracer.hardware import memory

    path = quantized("Q4_0")
    plan = plan_load(str(path), FP32, weights="native")
    need = shard_bytes(plan, 0, 2) + shard_bytes(plan, 1, 2)
    monkeypatch.setattr(memory, "available_memory_bytes", lambda: need)  # 90% of it is what a run may take
    result = runner.invoke(app, ["run", "hi", "--model", str(path), "--tp", "2", "--weights", "native"])
    assert result.exit_code == 2
    line = result.stderr.strip()
    assert "\n" not in line and "..." not in line
    assert f"need {need / 1e9:.1f} GB of memory together ({need / 2e9:.2f} GB a rank)" in line
    assert line.endswith("close what else is using the memory")


def test_the_biased_file_has_the_biases_the_split_covers(quantized: Callable[[str], Path]) -> None:
    config = resolve_model(str(quantized("Q8_0 biases"))).config
    assert config.qkv_bias and config.wo_bias  # so the biases case above splits Q, K, V biases and adds O's once


def test_dry_run_tp_shows_the_embedding_bytes_rank_0_then_holds(quantized: Callable[[str], Path],
                                                                 tmp_path: Path) -> None:
    """`run --dry-run --tp 2`: the embedding table and LM head shown are rank 0's rows, and the table's bytes are
    those rank 0 holds when it loads (not the whole table's)."""
    from llmtrace.cli.render_run import embedding_table
    from llmtrace.tracer.trace.run_trace import Trace

    path = quantized("Q4_1+Q8_0 head")
    out = tmp_path / "dry.json"
    result = runner.invoke(app, ["run", "hi", "--model", str(path), "--dry-run", "--tp", "2", "--weights", "i8dot",
                                 "--dtype", "fp32", "--json", str(out)], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    trace = Trace.from_json(out.read_text(encoding="utf-8"))
    config = trace.config
    rows = -(-config.vocab_size // 2)
    assert f"table tok_embeddings [{rows}, {config.dim}]" in result.output
    assert f"W_out [{rows}, {config.dim}]ᵀ, rank 0's 1/2 of {config.vocab_size:,} rows" in result.output
    embed = next(s for s in trace.stages if s.kind == "embedding")
    _, shown = embedding_table(config, embed, 2)
    held = run_ranks(2, lambda rank, comm: load_shard(str(path), FP32, "cpu", rank, 2, comm, weights="i8dot")
                     .model.stored_weights()["tok_embeddings"].stored_bytes)
    assert shown == held[0] == held[1]
    whole = load_model(str(path), dtype=FP32, weights="i8dot").model.stored_weights()["tok_embeddings"]
    assert shown == whole.stored_bytes // config.vocab_size * rows  # before: the whole table's
