"""Our Transformer against HF transformers' LlamaForCausalLM on the same safetensors, and cached against uncached."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Callable

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from llmtrace.tracer.core.config import ModelConfig
from llmtrace.tracer.core.contract import expected_shapes
from llmtrace.tracer.core.dtypes import BF16
from llmtrace.tracer.core.errors import BadArgumentError
from llmtrace.tracer.core.presets import get_preset
from llmtrace.tracer.load.hf_loader import load_hf_state_dict
from llmtrace.tracer.model.transformer import Transformer, build_meta_model, build_random_model
from llmtrace.tracer.run.backends import ModulesBackend, PackedBackend, backend_for
from llmtrace.tracer.run.select import Request
from llmtrace.tracer.trace.records import MODULES

transformers = pytest.importorskip("transformers")

LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 32}
# name -> hf_config_dict keywords. llama3 scaling with a 32-position original context so that, at head dim 16,
# frequencies fall in all three bands (kept, blended, divided by the factor).
VARIANTS: dict[str, dict] = {
    "mha-untied": dict(n_heads=4, n_kv_heads=4, tie=False),
    "gqa-tied": dict(n_heads=6, n_kv_heads=2, dim=96, tie=True),
    "mqa-untied": dict(n_heads=4, n_kv_heads=1, tie=False),
    "llama3-rope": dict(n_heads=4, n_kv_heads=2, rope_scaling=LLAMA3_SCALING, rope_theta=500000.0),
    "head-dim-24": dict(n_heads=4, n_kv_heads=2, head_dim=24, tie=True),
    "biased": dict(n_heads=4, n_kv_heads=2, attention_bias=True, mlp_bias=True),
}


def ours_from_folder(folder: Path) -> Transformer:
    config = ModelConfig.from_hf_json(folder)
    model = build_meta_model(config)
    model.load_weights(load_hf_state_dict(folder, config))
    return model.eval()


def hf_from_folder(folder: Path) -> torch.nn.Module:
    model = transformers.LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager")
    return model.eval()


@pytest.fixture(scope="module", params=list(VARIANTS))
def pair(request: pytest.FixtureRequest, make_tiny_llama: Callable[..., Path]) -> tuple[Transformer, torch.nn.Module]:
    folder = make_tiny_llama(request.param, seed=len(request.param), **VARIANTS[request.param])
    return ours_from_folder(folder), hf_from_folder(folder)


def tokens(vocab: int, batch: int, length: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, vocab, (batch, length), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def test_full_forward_logits_match_hf(pair: tuple[Transformer, torch.nn.Module]) -> None:
    ours, hf = pair
    ids = tokens(ours.config.vocab_size, 2, 40)
    expected = hf(input_ids=ids).logits
    got = ours(ids)
    assert got.shape == expected.shape == (2, 40, ours.config.vocab_size)
    assert expected.abs().max() > 1.0  # weights large enough that a mismatch would show
    assert (got - expected).abs().max().item() <= 1e-4


@torch.no_grad()
def test_prefill_and_decode_match_full_forward_and_hf(pair: tuple[Transformer, torch.nn.Module]) -> None:
    ours, hf = pair
    ids = tokens(ours.config.vocab_size, 2, 17, seed=1)
    ours.setup_cache(max_batch=2, max_seq=32)
    logits = [ours.prefill(ids[:, :12])]
    for t in range(12, 17):
        logits.append(ours.decode_one(ids[:, t : t + 1]))
    assert ours.pos == 17
    cached = torch.stack(logits, dim=1)  # (B, 6, V): positions 11..16
    full = ours(ids)[:, 11:]
    reference = hf(input_ids=ids).logits[:, 11:]
    assert (cached - full).abs().max().item() <= 1e-5
    assert (cached - reference).abs().max().item() <= 1e-4


@torch.no_grad()
def test_greedy_generation_with_cache_equals_full_recompute_and_hf(pair: tuple[Transformer, torch.nn.Module]) -> None:
    ours, hf = pair
    prompt = tokens(ours.config.vocab_size, 1, 6, seed=2)
    steps = 20
    ours.setup_cache(max_batch=1, max_seq=32)
    cached = [int(ours.prefill(prompt).argmax(-1))]
    for _ in range(steps - 1):
        cached.append(int(ours.decode_one(torch.tensor([[cached[-1]]])).argmax(-1)))
    sequence = prompt
    recomputed = []
    for _ in range(steps):
        next_id = int(ours(sequence)[0, -1].argmax())
        recomputed.append(next_id)
        sequence = torch.cat([sequence, torch.tensor([[next_id]])], dim=1)
    hf_ids = hf.generate(prompt, max_new_tokens=steps, min_new_tokens=steps, do_sample=False, eos_token_id=None,
                         pad_token_id=0)[0, 6:].tolist()
    assert cached == recomputed == hf_ids
    assert len(set(cached)) > 1  # not a degenerate constant output


@torch.no_grad()
def test_batched_prefill_rows_equal_single_rows(pair: tuple[Transformer, torch.nn.Module]) -> None:
    ours, _ = pair
    ids = tokens(ours.config.vocab_size, 3, 9, seed=3)
    ours.setup_cache(max_batch=3, max_seq=16)
    batched = ours.prefill(ids)
    for row in range(3):
        ours.setup_cache(max_batch=1, max_seq=16)
        assert torch.allclose(ours.prefill(ids[row : row + 1])[0], batched[row], atol=1e-5)


def test_state_dict_names_follow_meta_naming_and_tying() -> None:
    for name in ("smollm2-135m", "llama2-7b"):
        config = get_preset(name)
        model = build_meta_model(config)
        names = set(model.state_dict())
        assert names == set(expected_shapes(config))
        assert ("output.weight" in names) == (not config.tie_embeddings)
        assert (model.output.weight is model.tok_embeddings.weight) == config.tie_embeddings


def test_meta_model_of_the_largest_preset_has_every_shape_and_no_memory() -> None:
    config = get_preset("llama3.1-405b")
    model = build_meta_model(config)
    assert all(p.is_meta for p in model.parameters())
    n_params = sum(p.numel() for p in model.parameters())
    assert n_params == sum(torch.Size(s).numel() for s in expected_shapes(config).values())
    assert 405e9 < n_params < 406e9  # Meta's model card: 405B
    assert model.layers[125].attention.wk.weight.shape == (8 * 128, 16384)


def test_random_init_is_seeded_and_dtype_is_respected() -> None:
    config = ModelConfig("t", 100, 32, 2, 4, 2, 48, tie_embeddings=True)
    a, b, c = (build_random_model(config, seed=s) for s in (7, 7, 8))
    assert torch.equal(a.layers[1].attention.wq.weight, b.layers[1].attention.wq.weight)
    assert not torch.equal(a.layers[1].attention.wq.weight, c.layers[1].attention.wq.weight)
    assert a.output.weight is a.tok_embeddings.weight
    assert 0.015 < a.tok_embeddings.weight.std().item() < 0.025
    assert torch.equal(a.norm.weight, torch.ones(32))
    half = build_random_model(config, seed=7, dtype=BF16)
    assert {p.dtype for p in half.parameters()} == {torch.bfloat16}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@torch.no_grad()
def test_half_precision_errors_are_no_worse_than_hf(dtype: torch.dtype, tiny_llama_dir: Path) -> None:
    ours = ours_from_folder(tiny_llama_dir)
    ids = tokens(ours.config.vocab_size, 1, 12, seed=4)
    reference = ours(ids)[0, -1]  # fp32
    half = ours_from_folder(tiny_llama_dir).to(dtype)
    half.setup_cache(1, 16)
    logits = half.prefill(ids)[0]
    assert half.layers[0].attention.kv_cache.kv.dtype == logits.dtype == dtype
    hf_half = transformers.LlamaForCausalLM.from_pretrained(tiny_llama_dir, dtype=dtype, attn_implementation="eager")
    hf_logits = hf_half(input_ids=ids).logits[0, -1]
    our_error = (logits.float() - reference).abs().max().item()
    hf_error = (hf_logits.float() - reference).abs().max().item()
    assert 0 < our_error <= 2 * hf_error
    assert our_error < 0.05 * reference.abs().max().item()


@torch.no_grad()
def test_kv_cache_bytes_and_live_slice(tiny_llama_dir: Path) -> None:
    model = ours_from_folder(tiny_llama_dir)
    cfg = model.config
    model.setup_cache(max_batch=2, max_seq=50)
    per_layer_allocated = 2 * 2 * cfg.n_kv_heads * 50 * cfg.head_dim * 4  # K and V, B=2, fp32
    assert model.layers[0].attention.kv_cache.allocated_bytes == per_layer_allocated
    assert model.kv_allocated_bytes == cfg.n_layers * per_layer_allocated
    assert model.kv_live_bytes == 0
    model.prefill(tokens(cfg.vocab_size, 2, 7))
    model.decode_one(tokens(cfg.vocab_size, 2, 1))
    assert model.kv_live_bytes == cfg.n_layers * 2 * 2 * cfg.n_kv_heads * 8 * cfg.head_dim * 4
    model.reset_cache()
    assert model.pos == 0 and model.kv_live_bytes == 0
    assert model.kv_allocated_bytes == cfg.n_layers * per_layer_allocated


@torch.no_grad()
def test_decode_runs_the_flops_of_the_live_cache_only(tiny_llama_dir: Path) -> None:
    """Counted decode FLOPs = 2*params of every matmul + QK^T and PV over the S live positions, not max_seq."""
    model = ours_from_folder(tiny_llama_dir)
    c = model.config
    model.setup_cache(max_batch=1, max_seq=200)
    model.prefill(tokens(c.vocab_size, 1, 9))
    counter = FlopCounterMode(display=False)
    with counter:
        model.decode_one(tokens(c.vocab_size, 1, 1))
    seen = 10
    linear = c.dim * (c.q_dim + 2 * c.kv_dim) + c.q_dim * c.dim + 3 * c.dim * c.ffn_dim
    attention = 2 * (2 * c.n_heads * seen * c.head_dim)
    expected = c.n_layers * (2 * linear + attention) + 2 * c.dim * c.vocab_size
    assert counter.get_total_flops() == expected


@torch.no_grad()
def test_prefill_runs_the_final_norm_and_lm_head_on_the_last_position_only(tiny_llama_dir: Path) -> None:
    model = ours_from_folder(tiny_llama_dir)
    model.setup_cache(1, 32)
    seen: dict[str, tuple[int, ...]] = {}
    handles = [
        module.register_forward_hook(lambda mod, args, out, name=name: seen.__setitem__(name, tuple(args[0].shape)))
        for name, module in (("norm", model.norm), ("output", model.output), ("wq", model.layers[0].attention.wq))
    ]
    ids = tokens(model.config.vocab_size, 1, 20)
    logits = model.prefill(ids)
    for handle in handles:
        handle.remove()
    assert seen == {"wq": (1, 20, model.config.dim), "norm": (1, model.config.dim), "output": (1, model.config.dim)}
    assert torch.allclose(logits, model(ids)[:, -1], atol=1e-5)


@torch.no_grad()
def test_cache_misuse_gives_typed_errors_and_a_failed_step_leaves_no_trace(tiny_llama_dir: Path) -> None:
    model = ours_from_folder(tiny_llama_dir)
    ids = tokens(model.config.vocab_size, 1, 5)
    with pytest.raises(BadArgumentError, match="setup_cache"):
        model.prefill(ids)
    with pytest.raises(BadArgumentError, match="context length"):
        model.setup_cache(1, model.config.max_seq_len + 1)
    model.setup_cache(1, 8)
    model.prefill(ids)
    with pytest.raises(BadArgumentError, match="exceed the cache"):
        model.prefill(ids)
    with pytest.raises(BadArgumentError, match=r"\(B, 1\)"):
        model.decode_one(ids)

    def fail(*_: object) -> None:
        raise RuntimeError("interrupted")

    handle = model.layers[1].attention.wq.register_forward_hook(fail)
    with pytest.raises(RuntimeError):
        model.decode_one(ids[:, :1])
    handle.remove()
    assert model.pos == 5
    assert {layer.attention.kv_cache.length for layer in model.layers} == {5}
    after = model.decode_one(ids[:, :1])
    assert torch.allclose(after, model(torch.cat([ids, ids[:, :1]], dim=1))[:, -1], atol=1e-5)


# ---- the fused path (tracer/model/fused.py) ------------------------------------------------------------------------


def staged_and_fused_logits(model: Transformer, ids: torch.Tensor, decode_steps: int, max_batch: int) -> list:
    """The logits of a prefill and `decode_steps` greedy steps on the modules backend (the reference), then on the
    backend a run takes (packed: these models have no native step)."""
    results = []
    for backend in (MODULES, None):
        model.setup_cache(max_batch=max_batch, max_seq=64)
        run = backend_for(model, Request(batch=ids.shape[0], backend=backend))
        assert isinstance(run, ModulesBackend) is (backend == MODULES)
        logits = [run.prefill(ids)]
        for step in range(decode_steps):
            logits.append(run.decode(logits[-1].argmax(-1, keepdim=True)))
        results.append(torch.stack(logits, dim=1))
    return results


@pytest.mark.parametrize("variant", ["gqa-tied", "mha-untied", "head-dim-24"])
@pytest.mark.parametrize("batch,max_batch", [(1, 1), (2, 2), (1, 3)])
@torch.no_grad()
def test_fused_path_equals_the_stage_by_stage_path(make_tiny_llama: Callable[..., Path], variant: str, batch: int,
                                                   max_batch: int) -> None:
    model = ours_from_folder(make_tiny_llama(variant, seed=len(variant), **VARIANTS[variant]))
    ids = tokens(model.config.vocab_size, batch, 9, seed=5)
    staged, fused = staged_and_fused_logits(model, ids, decode_steps=6, max_batch=max_batch)
    assert (staged - fused).abs().max().item() <= 1e-5
    assert torch.equal(staged.argmax(-1), fused.argmax(-1))


@torch.no_grad()
def test_any_observer_sends_the_step_stage_by_stage(tiny_llama_dir: Path) -> None:
    model = ours_from_folder(tiny_llama_dir)
    model.setup_cache(1, 32)
    assert isinstance(backend_for(model), PackedBackend)
    calls = []
    handle = model.layers[1].feed_forward.act.register_forward_hook(lambda *args: calls.append(1))
    run = backend_for(model)
    assert isinstance(run, ModulesBackend)
    run.prefill(tokens(model.config.vocab_size, 1, 4))
    run.decode(tokens(model.config.vocab_size, 1, 1))
    assert calls == [1, 1]  # the watched stage ran, once per step
    handle.remove()
    assert isinstance(backend_for(model), PackedBackend)
    handle = torch.nn.modules.module.register_module_forward_pre_hook(lambda *args: None)
    assert isinstance(backend_for(model), ModulesBackend)
    handle.remove()
    assert isinstance(backend_for(model), PackedBackend)
    rope = model.layers[0].attention.rope
    rope.forward = lambda *args, **kwargs: type(rope).forward(rope, *args, **kwargs)  # an instance-level wrapper
    assert isinstance(backend_for(model), ModulesBackend)
    del rope.forward
    assert isinstance(backend_for(model), PackedBackend)
    with FlopCounterMode(display=False) as counter:
        model.decode_one(tokens(model.config.vocab_size, 1, 1))
    assert counter.get_total_flops() > 0
    assert "TransformerBlock.attention.scores" in "".join(counter.get_flop_counts())  # counted stage by stage


@torch.no_grad()
def test_packing_keeps_names_and_values_and_costs_no_memory(tiny_llama_dir: Path) -> None:
    model = ours_from_folder(tiny_llama_dir)
    before = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    model.setup_cache(1, 16)
    backend_for(model)  # a run's plan packs the projections (once)
    after = model.state_dict()
    assert set(after) == set(before) and all(torch.equal(after[n], before[n]) for n in before)
    attn = model.layers[0].attention
    storage = attn.wq.weight.untyped_storage()
    for linear in (attn.wk, attn.wv):
        assert linear.weight.untyped_storage().data_ptr() == storage.data_ptr()
    assert storage.nbytes() == (model.config.q_dim + 2 * model.config.kv_dim) * model.config.dim * 4


@torch.no_grad()
def test_moves_and_in_place_edits_are_read_by_the_next_run(tiny_llama_dir: Path) -> None:
    model = ours_from_folder(tiny_llama_dir)
    ids = tokens(model.config.vocab_size, 1, 6)
    model.setup_cache(1, 16)
    backend_for(model).prefill(ids)
    model.layers[0].ffn_norm.weight.mul_(2.0)  # an in-place edit the last run's plan's values would miss
    model.setup_cache(1, 16)
    fused = backend_for(model).prefill(ids)
    model.setup_cache(1, 16)
    assert torch.allclose(fused, model.prefill(ids), atol=1e-5)
    model.to(torch.float64)
    model.to(torch.float32)
    model.setup_cache(1, 16)
    run = backend_for(model)
    assert isinstance(run, PackedBackend) and torch.allclose(fused, run.prefill(ids), atol=1e-5)


@torch.no_grad()
def test_a_long_cache_free_forward_keeps_the_fused_path(tiny_llama_dir: Path) -> None:
    model = ours_from_folder(tiny_llama_dir)
    model.setup_cache(1, 8)
    model(tokens(model.config.vocab_size, 1, 12))  # longer than the cache: the rope tables grow
    run = backend_for(model)
    assert isinstance(run, PackedBackend)
    ids = tokens(model.config.vocab_size, 1, 6)
    fused = run.prefill(ids)
    model.reset_cache()
    assert torch.allclose(fused, model.prefill(ids), atol=1e-5)


@torch.no_grad()
def test_reloading_weights_asks_for_a_new_cache(tiny_llama_dir: Path) -> None:
    model = ours_from_folder(tiny_llama_dir)
    model.setup_cache(1, 8)
    model.prefill(tokens(model.config.vocab_size, 1, 3))
    model.load_weights({name: t.clone() for name, t in model.state_dict().items()})
    with pytest.raises(BadArgumentError, match="not set up"):
        model.prefill(tokens(model.config.vocab_size, 1, 3))
    model.setup_cache(1, 8)
    assert model.prefill(tokens(model.config.vocab_size, 1, 3)).shape == (1, model.config.vocab_size)


def assert_within_one_ulp(staged: torch.Tensor, fused: torch.Tensor, dtype: torch.dtype) -> None:
    """The half-precision parity tolerance: one ulp of the largest logit in `dtype` (2^-7 of its power of two in
    bf16, 2^-10 in fp16), and the same argmax everywhere."""
    staged, fused = staged.float(), fused.float()
    ulp = torch.finfo(dtype).eps * 2.0 ** math.floor(math.log2(staged.abs().max().item()))
    assert (staged - fused).abs().max().item() <= ulp
    assert torch.equal(staged.argmax(-1), fused.argmax(-1))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("variant", ["gqa-tied", "mha-untied", "head-dim-24", "biased"])
@pytest.mark.parametrize("batch,max_batch", [(1, 1), (2, 2)])
@torch.no_grad()
def test_fused_path_rounds_like_the_stage_by_stage_path_in_half_precision(
        make_tiny_llama: Callable[..., Path], variant: str, batch: int, max_batch: int, dtype: torch.dtype) -> None:
    """Both paths call the same functions of tracer/model/functional.py, so every rounding happens at the same
    place: norms normalised in fp32 then times the weight, scores scaled after the product, softmax in fp32, one
    query token's attention products in fp32. On this CPU the logits are bitwise equal.

    Tolerance (assert_within_one_ulp): one ulp of the largest logit. The one place the paths still differ is a
    packed product (Q|K|V, gate|up) against separate ones: a BLAS whose accumulation order depended on the number
    of output rows could round such a product's last bit differently, which the layers may carry to the logits'
    last bit. Before the paths rounded alike (two hand copies of the fused layer, 1/sqrt(D) folded into the RoPE
    tables, RMSNorm's weight applied in fp32) this test failed in 12 of its 16 cases (test_sliding_window's
    windowed one in both dtypes), and the bundled model's bf16 logits differed by 0.0059 on ~0.87 (4 to 5 ulps)."""
    model = ours_from_folder(make_tiny_llama(variant, seed=len(variant), **VARIANTS[variant])).to(dtype)
    ids = tokens(model.config.vocab_size, batch, 9, seed=5)
    assert_within_one_ulp(*staged_and_fused_logits(model, ids, 6, max_batch), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("variant", ["gqa-tied", "mqa-untied", "head-dim-24", "biased"])
@torch.no_grad()
def test_the_step_on_shared_cache_views_equals_the_step_on_each_layers_cache_bit_for_bit(
        make_tiny_llama: Callable[..., Path], variant: str, dtype: torch.dtype) -> None:
    """A fused step takes every layer's cache rows from the one tensor all layers' caches share (FusedPlan.kv_all: a
    few views for all layers, as the deleted one-token copy of the layer did); without it, from each layer's cache.
    The same products and elementwise ops run either way, so logits and every cache entry agree bit for bit, in every
    dtype, for the prefill and the one-token steps alike (both run the one TransformerBlock.forward with a PackedLayer)."""
    model = ours_from_folder(make_tiny_llama(variant, seed=len(variant), **VARIANTS[variant])).to(dtype)
    ids = tokens(model.config.vocab_size, 1, 9, seed=5)
    runs = []
    for per_layer in (False, True):
        model.setup_cache(1, 16)
        run = backend_for(model)
        assert run.plan.kv_all is not None
        if per_layer:
            run.plan.kv_all = None  # no shared cache views: each layer's cache sliced on its own
        logits = [run.prefill(ids)]
        for _ in range(5):
            logits.append(run.decode(logits[-1].argmax(-1, keepdim=True)))
        runs.append((torch.stack(logits), model._kv_all[:, :, :, :14].clone()))
    assert torch.equal(runs[0][0], runs[1][0]) and torch.equal(runs[0][1], runs[1][1])
    assert model.layers[-1].attention.kv_cache.length == 14 and model.kv_live_bytes == runs[0][1][:, 0].nbytes
