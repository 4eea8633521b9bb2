"""Qwen2-MoE (Qwen2's attention with Q/K/V biases; a mixture of experts in every layer beside one shared expert whose
output is scaled by sigmoid(x·g) and added to the routed sum): its config.json (num_experts, moe_intermediate_size,
shared_expert_intermediate_size, norm_topk_prob) and its 'qwen2moe' GGUF (ffn_*_shexp, a {n_embd} ffn_gate_inp_shexp)
read; greedy ids and logits equal to transformers' Qwen2MoeForCausalLM on a tiny random model, the router's k weights
as the softmax gave them (Qwen1.5-MoE's) and renormalised, from the HF folder and from a Q8_0 GGUF of the same
weights (whose values the folder holds exactly), on the stage modules and the packed path; the traced FLOPs equal
FlopCounterMode's and the estimate's, and a step's weight bytes count the shared expert once; Qwen1.5-MoE-A2.7B's
parameters by hand."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from test_mixtral import PROMPT, greedy, hf_greedy, prompt_ids
from test_moe_native import PROMPT as NATIVE_PROMPT
from test_moe_native import TOKENS, assert_same_routes, steps, untimed
from test_qwen2 import _bundled_vocab, _write_tokenizer_json
from tiny_gguf import write_tiny_gguf
from tiny_llama import random_weights
from torch.utils.flop_counter import FlopCounterMode
from typer.testing import CliRunner

from llmtrace.cli.app import app
from llmtrace.tracer.analytic import estimate
from llmtrace.tracer.analytic.params import count_params
from llmtrace.tracer.core.config import ModelConfig, MoeSpec
from llmtrace.tracer.core.dtypes import FP32
from llmtrace.tracer.core.presets import PRESETS
from llmtrace.tracer.load.hf_loader import hf_state_dict_from_ours
from llmtrace.tracer.load.loader import load_model
from llmtrace.tracer.model.transformer import Transformer, build_random_model
from llmtrace.tracer.run.backends import backend_for
from llmtrace.tracer.run.select import Request, select
from llmtrace.tracer.trace.fused_marks import staged_order
from llmtrace.tracer.trace.hooks import Tracer
from llmtrace.tracer.model import native_kernel
from llmtrace.tracer.trace.records import DECODE, MODULES, NATIVE, PACKED, PREFILL
from llmtrace.tracer.trace.routing import routing_step
from llmtrace.tracer.trace.summary import stage_totals
from tests.stamp_count import stamp_count
from tests.torch_threads import torch_threads

transformers = pytest.importorskip("transformers")

Q8_0 = gguf.GGMLQuantizationType.Q8_0
E, K, F, FS = 4, 2, 96, 128

pytestmark = pytest.mark.usefixtures("private_dirs")


def qwen2_moe_dict(vocab: dict, norm_topk_prob: bool) -> dict:
    """A Qwen2MoeForCausalLM config.json: 4 heads of 16 in a width-64 model (GQA 4:2), 4 experts of F=96, 2 per token,
    a shared expert of 128 (its intermediate_size, for dense layers, differs: it must not be read)."""
    return {
        "architectures": ["Qwen2MoeForCausalLM"], "model_type": "qwen2_moe", "vocab_size": len(vocab["tokens"]),
        "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "intermediate_size": 160, "moe_intermediate_size": F, "shared_expert_intermediate_size": FS,
        "num_experts": E, "num_experts_per_tok": K, "norm_topk_prob": norm_topk_prob, "decoder_sparse_step": 1,
        "mlp_only_layers": [], "rms_norm_eps": 1e-6, "rope_theta": 1e6, "max_position_embeddings": 128,
        "tie_word_embeddings": False, "use_sliding_window": False, "sliding_window": None, "hidden_act": "silu",
        "bos_token_id": vocab["bos"], "eos_token_id": vocab["eos"], "torch_dtype": "float32",
    }


_MADE: dict[bool, tuple[Path, Path, ModelConfig]] = {}


@pytest.fixture(scope="module", params=[False, True], ids=["softmax", "renormalised"])
def qwen2_moe(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
              ) -> tuple[Path, Path, ModelConfig]:
    """(a Qwen2MoeForCausalLM folder, the same weights as a Q8_0 'qwen2moe' GGUF, the config), with the routed
    weights as the softmax gives them and renormalised (`norm_topk_prob`)."""
    return _checkpoints(tmp_path_factory, request.param)


@pytest.fixture(scope="module")
def qwen2_moe_gguf(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, ModelConfig]:
    """The softmax's checkpoints alone: a 'qwen2moe' GGUF holds no norm_topk_prob (llama.cpp's qwen2moe keeps the
    softmax's weights), so the tests of the file take this pair only."""
    return _checkpoints(tmp_path_factory, False)


def _checkpoints(tmp_path_factory: pytest.TempPathFactory, renormalised: bool) -> tuple[Path, Path, ModelConfig]:
    if renormalised in _MADE:
        return _MADE[renormalised]
    vocab = _bundled_vocab()
    folder = tmp_path_factory.mktemp("tiny-qwen2-moe")
    (folder / "config.json").write_text(json.dumps(qwen2_moe_dict(vocab, renormalised)), encoding="utf-8")
    config = ModelConfig.from_hf_json(folder)
    weights = random_weights(config, seed=41)
    for name, tensor in weights.items():
        if tensor.dim() >= 2:  # the values a Q8_0 file holds exactly (the shared gate's too: the GGUF's F32 vector)
            array = tensor.numpy().astype(np.float32)
            weights[name] = torch.from_numpy(gguf.quants.dequantize(gguf.quants.quantize(array, Q8_0), Q8_0).copy())
    save_file({k: v.contiguous() for k, v in hf_state_dict_from_ours(weights, config, "mlp").items()},
              str(folder / "model.safetensors"), metadata={"format": "pt"})
    _write_tokenizer_json(folder, vocab)
    gguf_path = write_tiny_gguf(tmp_path_factory.mktemp("tiny-qwen2-moe-gguf") / "qwen2moe.gguf", config, weights,
                                vocab, matrix_type=Q8_0, arch="qwen2moe", tokenizer_model="gpt2",
                                extra_metadata={"qwen2moe.expert_count": E, "qwen2moe.expert_used_count": K,
                                                "qwen2moe.expert_feed_forward_length": F,
                                                "qwen2moe.expert_shared_feed_forward_length": FS})
    _MADE[renormalised] = folder, gguf_path, config
    return _MADE[renormalised]


def test_config_reads_the_experts_the_shared_expert_and_the_biases(qwen2_moe: tuple[Path, Path, ModelConfig]) -> None:
    folder, gguf_path, config = qwen2_moe
    norm = json.loads((folder / "config.json").read_text())["norm_topk_prob"]
    assert config.moe == MoeSpec(E, K, "renormalised" if norm else "softmax")
    assert (config.ffn_dim, config.shared_expert_dim, config.qkv_bias, config.wo_bias, config.qk_norm) == (
        F, FS, True, False, False)
    from_gguf = load_model(str(gguf_path), dry_run=False).config
    assert (from_gguf.moe, from_gguf.ffn_dim, from_gguf.shared_expert_dim, from_gguf.qkv_bias) == (
        MoeSpec(E, K, "softmax"), F, FS, True)  # llama.cpp's qwen2moe keeps the softmax's weights
    shared_gate = load_model(str(gguf_path)).model.layers[1].feed_forward.shared_gate.weight
    on_disk = load_file(str(folder / "model.safetensors"))["model.layers.1.mlp.shared_expert_gate.weight"]
    assert shared_gate.shape == (1, 64) and torch.equal(shared_gate, on_disk)  # the GGUF's (64,) vector as (1, 64)


@pytest.mark.parametrize("backend", [MODULES, PACKED])
def test_the_folders_greedy_ids_and_logits_equal_transformers(qwen2_moe: tuple[Path, Path, ModelConfig],
                                                              backend: str) -> None:
    """The folder, both router norms, on the stage modules and the packed path (the shared expert's gate|up one
    product)."""
    _greedy_equals_transformers(qwen2_moe, "hf", backend)


@pytest.mark.parametrize("backend", [MODULES, PACKED, NATIVE])
def test_the_gguf_greedy_ids_and_logits_equal_transformers(qwen2_moe_gguf: tuple[Path, Path, ModelConfig],
                                                           backend: str) -> None:
    """The GGUF (its experts as stored) on the stage modules, the packed path and the native C step (decode; the
    exact kernel: the shared expert's products and gate beside the routed ones)."""
    _greedy_equals_transformers(qwen2_moe_gguf, "gguf", backend)


def _greedy_equals_transformers(checkpoints: tuple[Path, Path, ModelConfig], source: str, backend: str) -> None:
    folder, gguf_path, config = checkpoints
    if backend == NATIVE and not native_kernel.available():
        pytest.skip(native_kernel.unavailable_reason())
    hf = transformers.Qwen2MoeForCausalLM.from_pretrained(folder, dtype=torch.float32,
                                                          attn_implementation="eager").eval()
    # the GGUF on the exact kernel: its Q8_0 default is i8dot with AVX-512 VNNI (llama.cpp's numerics)
    loaded = load_model(str(folder if source == "hf" else gguf_path),
                        weights="native" if source == "gguf" and native_kernel.available() else None)
    prompt = prompt_ids(config)
    want_ids, want_logits = hf_greedy(hf, prompt)
    ids, logits = greedy(loaded.model, prompt, backend)
    assert ids == want_ids
    assert (logits - want_logits).abs().max().item() < 1e-4
    assert want_logits.abs().max().item() > 1.0
    ffn = loaded.model.layers[0].feed_forward
    assert len(ffn.route.last[1]) == 1 and prompt.shape[1] == PROMPT
    if (source, backend) == ("hf", MODULES):  # without the shared expert the logits are far from these: 1e-4 sees it
        for layer in hf.model.layers:
            layer.mlp.shared_expert.down_proj.weight.data.zero_()
        assert (hf_greedy(hf, prompt)[1][0] - want_logits[0]).abs().max().item() > 1e-2


@torch.no_grad()
def test_transformers_gguf_reading_gives_llmtraces_logits(qwen2_moe_gguf: tuple[Path, Path, ModelConfig]) -> None:
    """The same 'qwen2moe' GGUF through transformers' own GGUF loading (its dequantization, its split of the 3-D
    experts, its (1, d) shared gate) and through llmtrace's reader; the folder's config passed (transformers' GGUF
    mapping for qwen2moe reads no shared expert width)."""
    folder, gguf_path, config = qwen2_moe_gguf
    hf_config = transformers.AutoConfig.from_pretrained(folder)
    theirs = transformers.Qwen2MoeForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name,
                                                              config=hf_config, dtype=torch.float32,
                                                              attn_implementation="eager").eval()
    # exact products (the Q8_0 default is i8dot with AVX-512 VNNI: llama.cpp's numerics, not transformers')
    ours = load_model(str(gguf_path), use_cache=False, weights="native" if native_kernel.available() else None).model
    ids = torch.randint(3, config.vocab_size, (2, 11), generator=torch.Generator().manual_seed(6))
    expected = theirs(input_ids=ids).logits
    assert expected.abs().max() > 1.0
    assert (ours(ids) - expected).abs().max().item() <= 1e-4


# ---- the trace: FLOPs and bytes with a shared expert ---------------------------------------------------------

TINY = ModelConfig("tiny-qwen2-moe", 96, 64, 2, 4, 2, 48, max_seq_len=32, qkv_bias=True,
                   moe=MoeSpec(8, 2, "softmax"), shared_expert_dim=80)
STEPS = 3


def test_flops_equal_flop_counter_mode_and_the_estimate_and_the_shared_expert_is_read_once() -> None:
    """Each step's traced matmul FLOPs are FlopCounterMode's and all its FLOPs the estimate's (per stage of layer 0
    too); its weight bytes are the attention's, the distinct routed experts', the shared expert's (once, whatever
    the tokens) and its gate's, the router's, the norms', the embedding rows' and the head's."""
    model = build_random_model(TINY, seed=4)
    with torch.no_grad():  # a sharper router: tokens that differ pick different experts
        for layer in model.layers:
            layer.feed_forward.router.weight.mul_(20)
    model.setup_cache(1, PROMPT + STEPS)
    generator = torch.Generator().manual_seed(0)
    counted, routed = [], []
    with Tracer(model, mechanism="wrap") as tracer:
        for step in range(STEPS + 1):
            ids = torch.randint(0, TINY.vocab_size, (1, PROMPT if step == 0 else 1), generator=generator)
            tracer.begin_step(PREFILL if step == 0 else DECODE, step)
            with FlopCounterMode(display=False) as counter, torch.no_grad():
                model.prefill(ids) if step == 0 else model.decode_one(ids)
            tracer.end_step()
            counted.append(counter.get_total_flops())
            routed.append(routing_step(model, PREFILL if step == 0 else DECODE, step))
    records = tracer.records()
    nbytes = {name: p.numel() * 4 for name, p in model.named_parameters()}
    expert = 3 * TINY.ffn_dim * TINY.dim * 4
    shared = (3 * 80 * 64 + 64) * 4  # w1, w3, w2 of the shared expert and its gate's (1, 64)
    dtypes = estimate.Dtypes.for_weights(FP32)
    for step, routing in enumerate(routed):
        mine = [r for r in records if r.step == step]
        assert sum(r.matmul_flops for r in mine) == counted[step]
        phase = (estimate.prefill(TINY, PROMPT, dtypes) if step == 0
                 else estimate.decode_step(TINY, PROMPT - 1 + step, dtypes))
        ours = stage_totals(mine)
        assert (ours.flops, ours.matmul_flops) == (phase.totals.total_flops, phase.totals.matmul_flops)
        components = {c.name: c for c in phase.components}
        by_role: dict[str, int] = {}
        for record in (r for r in mine if r.layer == 0):
            by_role[record.short_name] = by_role.get(record.short_name, 0) + record.flops
        for role, flops in by_role.items():
            assert flops == sum(components[part].flops for part in estimate.stage_components(role, TINY)), role
        tokens = PROMPT if step == 0 else 1
        assert [r.elementwise_flops for r in mine if r.stage.endswith("shared_add")] == [tokens * (4 + 2 * 64)] * 2
        want = tokens * TINY.dim * 4 + nbytes["norm.weight"] + nbytes["output.weight"]  # embedding rows, head
        for layer in routing.layers:
            prefix = f"layers.{layer.layer}."
            dense = [n for n in nbytes if n.startswith(prefix) and not any(
                f"feed_forward.{m}." in n for m in ("w1", "w3", "w2", "shared_w1", "shared_w3", "shared_w2",
                                                    "shared_gate"))]  # attention, its biases, norms, router
            want += sum(nbytes[n] for n in dense) + layer.distinct * expert + shared
        assert sum(r.weight_bytes_read for r in mine) == want, step


def test_qwen15_moe_a27b_parameters_by_hand_and_as_published() -> None:
    """Qwen/Qwen1.5-MoE-A2.7B/config.json: 24 layers, d 2048, 16 heads of 128 (MHA) with Q/K/V biases, 60 experts of
    1408, top 4, a shared expert of 5632 and its (1, 2048) gate, vocabulary 151,936, untied."""
    p = count_params(PRESETS["qwen1.5-moe-a2.7b"])
    attention = 4 * 2048 * 2048 + 3 * 2048
    expert, shared = 3 * 2048 * 1408, 3 * 2048 * 5632 + 2048
    layer = attention + 60 * expert + 2048 * 60 + shared + 2 * 2048
    assert p.total == 2 * 151936 * 2048 + 24 * layer + 2048 == 14_315_784_192
    assert p.active == p.total - 24 * 56 * expert == 2_689_173_504
    # The model card: "14.3B parameters in total and 2.7B activated parameters during runtime"
    assert round(p.total / 1e9, 1) == 14.3 and round(p.active / 1e9, 1) == 2.7


runner = CliRunner()


@pytest.mark.parametrize("command", [["models"], ["flops", "--model", "qwen1.5-moe-a2.7b"],
                                     ["kvmem", "--model", "qwen1.5-moe-a2.7b"],
                                     ["roofline", "--model", "qwen1.5-moe-a2.7b"]])
def test_the_analytic_commands_know_the_preset(command: list[str]) -> None:
    result = runner.invoke(app, command)
    assert result.exit_code == 0, result.output
    assert "qwen1.5-moe-a2.7b" in result.stdout


def test_flops_names_the_shared_expert_beside_the_routed_ones() -> None:
    """The experts line says a shared expert runs for every token (its rows are in the table below it); a model
    without one does not say it, and the JSON carries the width."""
    text = " ".join(runner.invoke(app, ["flops", "--model", "qwen1.5-moe-a2.7b"]).stdout.split())
    assert "one shared expert (5,632 wide) run by every token beside them" in text
    assert "shared expert" not in runner.invoke(app, ["flops", "--model", "mixtral-8x7b"]).stdout
    data = json.loads(runner.invoke(app, ["flops", "--model", "qwen1.5-moe-a2.7b", "--json"]).stdout)
    assert data["moe"]["shared_expert_dim"] == 5632


def test_a_dry_run_traces_the_estimates_flops_and_a_decode_steps_bytes(tmp_path: Path) -> None:
    """The meta model routes round-robin: FLOPs are the estimate's exactly, and a decode step's weight bytes too
    (one token reads k experts and the shared expert a layer)."""
    from llmtrace.tracer.trace.dry_run import dry_run_check
    from llmtrace.tracer.trace.run_trace import Trace

    path = tmp_path / "dry.json"
    result = runner.invoke(app, ["run", "--model", "qwen1.5-moe-a2.7b", "--dry-run", "--dtype", "fp32",
                                 "--json-file", str(path)])
    assert result.exit_code == 0, result.output
    trace = Trace.from_json(path.read_text(encoding="utf-8"))
    check = dry_run_check(trace)
    assert [p.equal for p in check.passes] == [True, True]
    decode = check.passes[1]
    step = estimate.decode_step(trace.config, decode.context_length - 1, estimate.Dtypes.for_weights(FP32))
    assert decode.weight_bytes_read == step.totals.weight_bytes


# ---- the C step: the shared expert beside the routed ones ----------------------------------------------------


def _native_model(qwen2_moe_gguf: tuple[Path, Path, ModelConfig]) -> Transformer:
    _, gguf_path, _ = qwen2_moe_gguf
    if not native_kernel.available():
        pytest.skip(native_kernel.unavailable_reason())
    return load_model(str(gguf_path), weights="native").model


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("staged", [False, True])
def test_the_c_step_gives_the_stage_modules_logits_and_routes(qwen2_moe_gguf: tuple[Path, Path, ModelConfig],
                                                              staged: bool, threads: int) -> None:
    model = _native_model(qwen2_moe_gguf)
    model.setup_cache(1, NATIVE_PROMPT + len(TOKENS))
    assert select(model, Request(staged=staged)).route.decode == NATIVE
    with torch_threads(threads):
        want, want_routes, _ = steps(model, Request(staged=staged, backend=MODULES))
        got, routes, _ = steps(model, Request(staged=staged))
    for step, (a, b) in enumerate(zip(got, want, strict=True)):
        assert int(a.argmax()) == int(b.argmax()), step
        assert (a - b).abs().max().item() < 1e-4, step
    assert max(b.abs().max().item() for b in want) > 1.0
    assert_same_routes(routes, want_routes)


@pytest.mark.parametrize("staged", [False, True])
def test_a_traced_c_steps_records_are_the_wrapped_stage_modules_records(qwen2_moe_gguf: tuple[Path, Path, ModelConfig],
                                                                       staged: bool) -> None:
    """Traced, the C step runs the stage modules' stages apart, the shared expert's once before the router and its
    gated add after the weighted sum: the records are the modules', names, order, shapes, FLOPs, bytes."""
    model = _native_model(qwen2_moe_gguf)
    _, _, native = steps(model, Request(staged=staged, traced=True), traced=True)
    _, _, modules = steps(model, Request(staged=staged, traced=True, backend=MODULES), traced=True)
    assert [untimed(r) for r in native] == [untimed(r) for r in modules]
    decode = [r.stage for r in native if r.step == 1]
    assert decode == staged_order(model)
    per_layer = [r.stage.split(".", 2)[2] for r in native if r.step == 1 and r.layer == 0]
    shared = ["feed_forward.shared_w1", "feed_forward.shared_w3", "feed_forward.shared_act",
              "feed_forward.shared_w2", "feed_forward.shared_gate"]
    assert per_layer[per_layer.index("ffn_norm") + 1:per_layer.index("feed_forward.router")] == shared
    assert per_layer[per_layer.index("feed_forward.combine") + 1] == "feed_forward.shared_add"
    assert len(decode) == stamp_count(model.config.n_layers, staged=True, experts=K, shared_expert=True) - 1


@pytest.mark.parametrize("staged", [False, True])
def test_one_reading_per_stage(qwen2_moe_gguf: tuple[Path, Path, ModelConfig], staged: bool) -> None:
    """The C step's count (llmt_step_stamps) is stamp_count's, by hand: per layer the dense stages, k experts' and
    the shared expert's gate|up (gate, up), silu*up, down, gate logit and gated add."""
    model = _native_model(qwen2_moe_gguf)
    model.setup_cache(1, NATIVE_PROMPT + len(TOKENS))
    backend = backend_for(model)
    backend.prefill(torch.arange(3, 3 + NATIVE_PROMPT).view(1, -1))
    step = backend.plan.native
    step(TOKENS[0], NATIVE_PROMPT, stamps=True, staged=staged)
    readings = step.readings()
    assert len(readings) == stamp_count(model.config.n_layers, staged, experts=K, shared_expert=True)
    assert readings == sorted(readings)
    assert len(readings) == 1 + 1 + model.config.n_layers * ((16 + 4 * K + 6) if staged else (14 + 3 * K + 5)) + 2
