"""Mistral's sliding-window attention against transformers' MistralForCausalLM (window 8, prompts longer than it),
on both model paths and through the KV cache, and the window in the analytical figures."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from test_model_parity import assert_within_one_ulp, staged_and_fused_logits
from tiny_llama import hf_config_dict, write_tiny_llama

from llmtrace.tracer.core.config import ModelConfig, first_attended_position
from llmtrace.tracer.core.errors import ConfigError
from llmtrace.tracer.load.hf_loader import load_hf_state_dict
from llmtrace.tracer.model.functional import causal_mask
from llmtrace.tracer.model.transformer import Transformer, build_meta_model
from llmtrace.tracer.run.backends import ModulesBackend, backend_for
from llmtrace.tracer.run.select import Request
from llmtrace.tracer.trace.records import MODULES

transformers = pytest.importorskip("transformers")

WINDOW, PROMPT = 8, 21


def mistral_config(vocab_size: int, window: int | None = WINDOW, **extra: object) -> dict:
    data = hf_config_dict(vocab_size, n_heads=4, n_kv_heads=2, tie=False)
    data.update(architectures=["MistralForCausalLM"], model_type="mistral", sliding_window=window, **extra)
    return data


@pytest.fixture(scope="module")
def mistral_folder(tmp_path_factory: pytest.TempPathFactory, sp_model_bytes: bytes, sp_vocab_size: int) -> Path:
    return write_tiny_llama(tmp_path_factory.mktemp("tiny-mistral"), mistral_config(sp_vocab_size), seed=8,
                            tokenizer_model=sp_model_bytes)


@pytest.fixture(scope="module")
def pair(mistral_folder: Path) -> tuple[Transformer, torch.nn.Module]:
    config = ModelConfig.from_hf_json(mistral_folder)
    assert config.sliding_window == WINDOW
    ours = build_meta_model(config)
    ours.load_weights(load_hf_state_dict(mistral_folder, config))
    hf = transformers.MistralForCausalLM.from_pretrained(mistral_folder, dtype=torch.float32,
                                                        attn_implementation="eager")
    assert hf.config.sliding_window == WINDOW
    return ours.eval(), hf.eval()


def ids_of(vocab: int, batch: int, length: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, vocab, (batch, length), generator=torch.Generator().manual_seed(seed))


def test_mask_by_hand() -> None:
    """4 queries at positions 2..5 over keys 0..5, window 3: each sees itself and the 2 before it."""
    expected = torch.tensor([[0, 0, 0, 1, 1, 1],
                             [1, 0, 0, 0, 1, 1],
                             [1, 1, 0, 0, 0, 1],
                             [1, 1, 1, 0, 0, 0]], dtype=torch.bool)
    assert torch.equal(causal_mask(4, 6, torch.device("cpu"), window=3), expected)
    assert torch.equal(causal_mask(4, 6, torch.device("cpu"), window=99), causal_mask(4, 6, torch.device("cpu")))
    assert first_attended_position(end=30, new=1, window=8) == 22  # a decode step reads positions 22..29
    assert first_attended_position(end=21, new=21, window=8) == 0  # a prefill reads its whole prompt
    assert first_attended_position(end=30, new=9, window=8) == 14  # the 9 queries 21..29 reach back to 14


@torch.no_grad()
def test_full_forward_equals_mistral(pair: tuple[Transformer, torch.nn.Module]) -> None:
    ours, hf = pair
    ids = ids_of(ours.config.vocab_size, 2, PROMPT)
    expected = hf(input_ids=ids).logits
    full_attention = build_meta_model(ModelConfig.from_hf_dict({**_hf_dict(hf), "sliding_window": None}))
    full_attention.load_weights(ours.state_dict())
    assert (full_attention(ids) - expected).abs().max().item() > 1e-2  # the window changes these logits
    assert (ours(ids) - expected).abs().max().item() <= 1e-4


def _hf_dict(hf: torch.nn.Module) -> dict:
    return {**json.loads(hf.config.to_json_string()), "architectures": ["MistralForCausalLM"]}


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "staged"])
@torch.no_grad()
def test_cached_steps_equal_mistral(fused: bool, pair: tuple[Transformer, torch.nn.Module]) -> None:
    """Prefill 12, a second prefill chunk of 9 (queries reaching back past the window into the cache), then 8
    decode steps reading only the last 8 positions: every logit equals MistralForCausalLM's full forward."""
    ours, hf = pair
    ids = ids_of(ours.config.vocab_size, 2, PROMPT + 8, seed=1)
    ours.setup_cache(max_batch=2, max_seq=64)
    run = backend_for(ours, Request(batch=2, backend=None if fused else MODULES))
    assert isinstance(run, ModulesBackend) is not fused
    run.prefill(ids[:, :12])
    logits = [run.prefill(ids[:, 12:PROMPT])]
    for t in range(PROMPT, PROMPT + 8):
        logits.append(run.decode(ids[:, t : t + 1]))
    cache = ours.layers[0].attention.kv_cache
    assert cache.length == PROMPT + 8 and cache.live_bytes == 2 * 2 * 2 * WINDOW * ours.config.head_dim * 4
    cached = torch.stack(logits, dim=1)  # positions 20..28
    reference = hf(input_ids=ids).logits[:, PROMPT - 1 :]
    assert (cached - reference).abs().max().item() <= 1e-4


@torch.no_grad()
def test_greedy_tokens_equal_mistral_generate(pair: tuple[Transformer, torch.nn.Module]) -> None:
    ours, hf = pair
    prompt = ids_of(ours.config.vocab_size, 1, PROMPT, seed=2)
    steps = 12
    ours.setup_cache(max_batch=1, max_seq=64)
    ours_ids = [int(ours.prefill(prompt).argmax(-1))]
    for _ in range(steps - 1):
        ours_ids.append(int(ours.decode_one(torch.tensor([[ours_ids[-1]]])).argmax(-1)))
    hf_ids = hf.generate(prompt, max_new_tokens=steps, min_new_tokens=steps, do_sample=False, eos_token_id=None,
                         pad_token_id=0)[0, PROMPT:].tolist()
    assert ours_ids == hf_ids and len(set(ours_ids)) > 1


def test_windowed_decode_reads_only_the_window(pair: tuple[Transformer, torch.nn.Module]) -> None:
    """FlopCounterMode: a decode step at context 40 runs QKᵀ and PV over 8 keys, as the estimate says."""
    from torch.utils.flop_counter import FlopCounterMode

    from llmtrace.tracer.analytic import estimate
    from llmtrace.tracer.core.dtypes import FP32

    ours, _ = pair
    ours.setup_cache(max_batch=1, max_seq=64)
    with torch.no_grad():
        ours.prefill(ids_of(ours.config.vocab_size, 1, 40, seed=3))
        with FlopCounterMode(display=False) as counter:
            ours.decode_one(ids_of(ours.config.vocab_size, 1, 1, seed=4))
    cfg = ours.config
    step = estimate.decode_step(cfg, 40, estimate.Dtypes.for_weights(FP32))
    matmuls = step.totals.matmul_flops
    assert counter.get_total_flops() == matmuls
    scores = next(c for c in step.components if c.name == "attention.scores")
    assert scores.flops == 2 * cfg.n_heads * WINDOW * cfg.head_dim  # one query against the window's 8 keys


def test_window_config_values(sp_vocab_size: int) -> None:
    assert ModelConfig.from_hf_dict(mistral_config(sp_vocab_size)).sliding_window == WINDOW
    missing = mistral_config(sp_vocab_size)
    del missing["sliding_window"]
    assert ModelConfig.from_hf_dict(missing).sliding_window == 4096  # MistralConfig's default
    assert ModelConfig.from_hf_dict(mistral_config(sp_vocab_size, window=None)).sliding_window is None
    llama = {**hf_config_dict(sp_vocab_size), "sliding_window": 8}  # LlamaForCausalLM ignores the key
    assert ModelConfig.from_hf_dict(llama).sliding_window is None
    for bad in (0, -4, 2.5, True):
        with pytest.raises(ConfigError, match="sliding_window must be a positive integer"):
            ModelConfig.from_hf_dict(mistral_config(sp_vocab_size, window=bad))


# ---- the analytical commands -------------------------------------------------------------------------------------


def test_kvmem_of_mistral_7b_holds_the_window() -> None:
    """Mistral-7B-v0.1 at 32k: 2 x 32 layers x 8 KV heads x 128 x 2 B x 4096 positions = 536,870,912 B, not the
    4,295 GB of 32,768 positions."""
    from llmtrace.tracer.analytic.kvmem import kv_cache_bytes, kvmem_report
    from llmtrace.tracer.core.dtypes import FP16
    from llmtrace.tracer.core.presets import get_preset

    mistral = get_preset("mistral-7b")
    assert mistral.sliding_window == 4096
    report = kvmem_report(mistral, 32768, FP16)
    assert report.size.total_bytes == 2 * 32 * 8 * 128 * 2 * 4096 == 536_870_912
    assert report.size.cached_positions == 4096 and report.size.seq == 32768
    assert kv_cache_bytes(mistral, 1000, FP16) == 2 * 32 * 8 * 128 * 2 * 1000  # shorter than the window: all held
    assert {row.seq: row.total_bytes for row in report.table}[8192] == 536_870_912
    full = kvmem_report(ModelConfig(**{**_fields(mistral), "sliding_window": None}), 32768, FP16)
    assert full.size.total_bytes == 4_294_967_296


def _fields(config: ModelConfig) -> dict:
    return {name: getattr(config, name) for name in config.__dataclass_fields__}


def test_decode_attention_flops_run_over_the_window() -> None:
    from llmtrace.tracer.analytic import estimate
    from llmtrace.tracer.analytic.kernels import Kernels
    from llmtrace.tracer.core.dtypes import FP16
    from llmtrace.tracer.core.presets import get_preset

    mistral = get_preset("mistral-7b")
    step = estimate.decode_step(mistral, 32767, estimate.Dtypes.for_weights(FP16))
    scores = next(c for c in step.components if c.name == "attention.scores")
    assert scores.flops == scores.useful_flops == 2 * 32 * 4096 * 128  # one query, 4096 keys, per layer
    assert scores.kv_read_bytes == 4096 * 8 * 128 * 2  # K of the window's positions only
    full = estimate.decode_step(ModelConfig(**{**_fields(mistral), "sliding_window": None}), 32767,
                                estimate.Dtypes.for_weights(FP16))
    full_scores = next(c for c in full.components if c.name == "attention.scores")
    assert full_scores.flops == 2 * 32 * 32768 * 128
    # a 6-token chunk at context 10 with window 4: each query sees 4 keys; the chunk reads keys 7..15 (9 keys)
    small = ModelConfig("w", 64, 32, 1, 2, 1, 64, sliding_window=4)
    chunk = estimate._phase(small, "prefill", 1, 6, 10, estimate.Dtypes.for_weights(FP16), Kernels.EAGER)
    chunk_scores = next(c for c in chunk.components if c.name == "attention.scores")
    assert chunk_scores.flops == 2 * 2 * 6 * 9 * 16 and chunk_scores.useful_flops == 2 * 2 * 6 * 4 * 16


def test_cli_kvmem_and_flops_show_the_window() -> None:
    from typer.testing import CliRunner

    from llmtrace.cli.app import app

    result = CliRunner().invoke(app, ["kvmem", "--model", "mistral-7b", "--seq", "32768", "--dtype", "fp16", "--json"])
    data = json.loads(result.stdout)
    assert data["size"]["total_bytes"] == 536_870_912 and data["size"]["cached_positions"] == 4096
    text = CliRunner().invoke(app, ["kvmem", "--model", "mistral-7b", "--seq", "32768"], terminal_width=200).output
    assert "holds the last 4,096" in text and "4096 positions (sliding window 4096 of 32768)" in text
    flops = CliRunner().invoke(app, ["flops", "--model", "mistral-7b", "--prompt-len", "8000", "--json"])
    decode = json.loads(flops.stdout)["decode"]
    scores = next(c for c in decode["components"] if c["name"] == "attention.scores")
    assert "window 4096: S = 4096 of 8001" in scores["formula"] and scores["flops"] == 2 * 32 * 4096 * 128
    fused = json.loads(CliRunner().invoke(app, ["flops", "--model", "mistral-7b", "--prompt-len", "8000",
                                                "--kernels", "fused", "--json"]).stdout)
    fused_scores = next(c for c in fused["decode"]["components"] if c["name"] == "attention.scores")
    assert fused_scores["flops"] == 2 * 32 * 4096 * 128  # FlashAttention-style kernels: the window's pairs too


@pytest.mark.parametrize("staged", [False, True], ids=["fused", "staged"])
def test_run_traces_a_windowed_model(staged: bool, mistral_folder: Path, tmp_path: Path,
                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """`llmtrace run` past the window: the trace's decode steps read W positions of K and V (2 layers)."""
    from typer.testing import CliRunner

    from llmtrace.cli.app import app

    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    out = tmp_path / "trace.json"
    result = CliRunner().invoke(app, ["run", "The capital of France is a city", "--model", str(mistral_folder),
                                      "--max-new-tokens", "20", "--no-roofline", "--dtype", "fp32", "--json",
                                      str(out), *(["--staged"] if staged else [])], terminal_width=120)
    assert result.exit_code == 0, result.output
    assert "sliding window 8" in result.output
    trace = json.loads(out.read_text())
    assert trace["config"]["sliding_window"] == WINDOW
    work = trace["stage_work"]  # the stage rows index it: [work, step, layer, start_ns, duration_ns]
    scores = [work[w] for w, step, *_ in trace["stages"] if work[w]["phase"] == "decode"
              and work[w]["stage"].endswith("attention.scores") and step == 19]
    assert scores and all(r["kv_bytes_read"] == 2 * WINDOW * 16 * 4 for r in scores)  # Hkv 2, D 16, fp32


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@torch.no_grad()
def test_fused_path_rounds_like_the_staged_path_under_a_window(dtype: torch.dtype, mistral_folder: Path) -> None:
    """Half precision, a 12-token prefill then 9 decode steps (the last 5 past the window of 8): the fused path's
    logits are the staged path's within one ulp (test_model_parity states the tolerance)."""
    config = ModelConfig.from_hf_json(mistral_folder)
    model = build_meta_model(config)
    model.load_weights(load_hf_state_dict(mistral_folder, config))
    model = model.eval().to(dtype)
    ids = ids_of(config.vocab_size, 2, 12, seed=3)
    assert_within_one_ulp(*staged_and_fused_logits(model, ids, 9, 2), dtype)
