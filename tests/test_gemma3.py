"""Gemma 3's text model (HF Gemma3ForCausalLM, GGUF 'gemma3'): its config.json and GGUF read, logits and greedy ids
equal to transformers' on a tiny random model through every backend llmtrace runs it on (the C decode step's one
layer loop among them: fused, staged and run ahead), and each of its twists a
stage of its own in the trace ((1 + w) norms, norms after attention and FFN, GeGLU, embeddings × √d, Q/K-norm,
windowed and global layers with their own RoPE bases, query_pre_attn_scalar, final soft-capping).

The tiny model has six layers (five windowed, the sixth global: Gemma 3's pattern), a window of 4 and prompts longer
than it, a linear RoPE scaling on the global layer (as the 4B and larger have) and soft-capped logits. One set of
weights serves the folder and the GGUF: the matrices are rounded through Q8_0 first, so the file the packed path
multiplies as stored holds exactly the folder's fp32 values; the GGUF's norms are 1 + w, as llama.cpp's converter
writes them."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import parity
import pytest
import torch
from safetensors.torch import save_file
from test_qwen2 import _bundled_vocab, _write_tokenizer_json
from tiny_gguf import write_tiny_gguf

from llmtrace.tracer.core.config import ModelConfig
from llmtrace.tracer.core.contract import expected_shapes
from llmtrace.tracer.core.dtypes import FP32
from llmtrace.tracer.load.hf_loader import hf_state_dict_from_ours
from llmtrace.tracer.load.loader import load_model
from llmtrace.tracer.model import native_kernel
from llmtrace.tracer.model.transformer import Transformer
from llmtrace.tracer.run.backends import backend_for
from llmtrace.tracer.run.select import Request, select
from llmtrace.tracer.trace.records import MODULES, NATIVE, PACKED
from tests.stamp_count import stamp_count
from tests.torch_threads import torch_threads

transformers = pytest.importorskip("transformers")

Q8_0 = gguf.GGMLQuantizationType.Q8_0
WINDOW, PROMPT, STEPS = 4, 9, 8  # prompts longer than the window: the windowed layers drop their oldest keys
SOFTCAP = 10.0  # small enough that the soft-cap bends these logits (the largest by about a tenth), not so small that it flattens them


@pytest.fixture(autouse=True)
def _private_dirs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LLMTRACE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))


def _weights(config: ModelConfig, seed: int) -> dict[str, torch.Tensor]:
    """Our-named fp32 weights: norm weights w around 0 (the norms multiply by 1 + w), matrices std 0.15 rounded
    through Q8_0 (the values a Q8_0 file holds exactly)."""
    generator = torch.Generator().manual_seed(seed)
    weights = {}
    for name, shape in expected_shapes(config).items():
        if len(shape) == 1:
            weights[name] = 0.3 * torch.randn(shape, generator=generator)
        else:
            array = (0.15 * torch.randn(shape, generator=generator)).numpy().astype(np.float32)
            weights[name] = torch.from_numpy(gguf.quants.dequantize(gguf.quants.quantize(array, Q8_0), Q8_0).copy())
    return weights


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, ModelConfig]:
    """(a Gemma3ForCausalLM folder, the same weights as a Q8_0 'gemma3' GGUF, the config): width 64, 4 heads of 32
    over 2 KV heads, query_pre_attn_scalar = head_dim (what llama.cpp assumes below 27B), tied embeddings."""
    vocab = _bundled_vocab()
    folder = tmp_path_factory.mktemp("tiny-gemma3")
    data = {
        "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "vocab_size": len(vocab["tokens"]),
        "hidden_size": 64, "num_hidden_layers": 6, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 32, "intermediate_size": 96, "rms_norm_eps": 1e-6, "rope_theta": 1e6,
        "rope_local_base_freq": 10000.0, "rope_scaling": {"rope_type": "linear", "factor": 2.0},
        "sliding_window": WINDOW, "sliding_window_pattern": 6, "query_pre_attn_scalar": 32,
        "final_logit_softcapping": SOFTCAP, "attn_logit_softcapping": None, "hidden_activation": "gelu_pytorch_tanh",
        "max_position_embeddings": 128, "tie_word_embeddings": True, "attention_bias": False,
        "bos_token_id": vocab["bos"], "eos_token_id": vocab["eos"], "pad_token_id": 0, "torch_dtype": "float32",
    }
    (folder / "config.json").write_text(json.dumps(data), encoding="utf-8")
    config = ModelConfig.from_hf_json(folder)
    weights = _weights(config, seed=21)
    save_file({k: v.contiguous() for k, v in hf_state_dict_from_ours(weights, config).items()},
              str(folder / "model.safetensors"), metadata={"format": "pt"})
    _write_tokenizer_json(folder, vocab)
    # llama.cpp's converter (Gemma3Model.modify_tensors) writes every norm weight as 1 + w
    stored = {name: (1.0 + t if name.endswith(("norm.weight", "q_weight", "k_weight")) else t)
              for name, t in weights.items()}
    gguf_path = write_tiny_gguf(
        tmp_path_factory.mktemp("tiny-gemma3-gguf") / "gemma3.gguf", config, stored, vocab, matrix_type=Q8_0,
        arch="gemma3", tokenizer_model="gpt2",
        extra_metadata={"gemma3.attention.sliding_window": WINDOW, "gemma3.final_logit_softcapping": SOFTCAP,
                        "gemma3.rope.scaling.type": "linear", "gemma3.rope.scaling.factor": 2.0})
    return folder, gguf_path, config


@pytest.fixture(scope="module")
def hf(gemma3: tuple[Path, Path, ModelConfig]) -> torch.nn.Module:
    folder, _, _ = gemma3
    return transformers.Gemma3ForCausalLM.from_pretrained(folder, dtype=torch.float32,
                                                          attn_implementation="eager").eval()


def prompt_ids(config: ModelConfig) -> torch.Tensor:
    return parity.prompt_ids(config.vocab_size, PROMPT)


REQUESTS = {"modules": Request(backend=MODULES), "packed": Request(backend=PACKED),
            "staged": Request(staged=True)}


@torch.no_grad()
def greedy(model: Transformer, backend: str, prompt: torch.Tensor) -> tuple[list[int], torch.Tensor]:
    """STEPS greedy tokens after `prompt` through `backend`, and the logits (STEPS, V) they were chosen from."""
    model.setup_cache(1, PROMPT + STEPS)
    run = backend_for(model, REQUESTS[backend])
    return parity.greedy_run(run, prompt, STEPS)


def hf_greedy(hf: torch.nn.Module, prompt: torch.Tensor) -> tuple[list[int], torch.Tensor]:
    return parity.hf_greedy(hf, prompt, STEPS)


def test_config_reads_every_twist(gemma3: tuple[Path, Path, ModelConfig]) -> None:
    """Five windowed layers and a global sixth with its own RoPE base and linear scaling; the GGUF's header gives
    the same config as llama.cpp reads it (its swa pattern 6, windowed base 10,000, scale 1/sqrt(head_dim))."""
    folder, gguf_path, config = gemma3
    assert (config.norm_plus_one, config.post_norms, config.geglu, config.embed_scale, config.qk_norm) == (True,) * 5
    assert (config.sliding_window, config.full_layers, config.windowed_layers) == (WINDOW, (5,), 5)
    assert [config.layer_window(i) for i in range(6)] == [WINDOW] * 5 + [None]
    assert config.layer_rope(0) == (10000.0, None)
    theta, scaling = config.layer_rope(5)
    assert theta == 1e6 and (scaling.kind, scaling.factor) == ("linear", 2.0)
    assert (config.attention_scale, config.final_softcap, config.tie_embeddings) == (32**-0.5, SOFTCAP, True)
    from_gguf = load_model(str(gguf_path), dry_run=True).config
    for field in ("norm_plus_one", "post_norms", "geglu", "embed_scale", "qk_norm", "sliding_window", "full_layers",
                  "rope_theta", "rope_local_theta", "rope_scaling", "attention_scale", "final_softcap", "head_dim",
                  "tie_embeddings"):
        assert getattr(from_gguf, field) == getattr(config, field), field


def test_gguf_holds_the_folders_tensors(gemma3: tuple[Path, Path, ModelConfig]) -> None:
    """The GGUF's 1 + w norms come back as the folder's w (within fp32's rounding of (1 + w) - 1); the Q8_0
    matrices bit for bit; HF's post_attention_layernorm is the norm after attention, pre_feedforward_layernorm the
    FFN's."""
    folder, gguf_path, _ = gemma3
    from_folder = load_model(str(folder), dtype=FP32, use_cache=False).model.state_dict()
    from_gguf = load_model(str(gguf_path), dtype=FP32, use_cache=False, weights="dense").model.state_dict()
    assert set(from_gguf) == set(from_folder)
    assert "layers.0.post_attention_norm.weight" in from_folder and "layers.0.post_ffn_norm.weight" in from_folder
    for name, tensor in from_folder.items():
        if tensor.dim() == 1:
            torch.testing.assert_close(from_gguf[name], tensor, rtol=0, atol=1e-7)
        else:
            assert torch.equal(from_gguf[name], tensor), name


@pytest.mark.parametrize("source", ["hf", "gguf"])
@torch.no_grad()
def test_cache_free_logits_equal_gemma3_for_causal_lm(source: str, gemma3: tuple[Path, Path, ModelConfig],
                                                      hf: torch.nn.Module) -> None:
    folder, gguf_path, config = gemma3
    loaded = load_model(str(folder if source == "hf" else gguf_path), dtype=FP32, use_cache=False,
                        weights=None if source == "hf" else "dense")
    ids = torch.randint(3, config.vocab_size, (2, 13), generator=torch.Generator().manual_seed(4))
    expected = hf(input_ids=ids).logits
    assert expected.abs().max() > 1.0 and expected.abs().max() < SOFTCAP  # large enough to show, capped
    assert (loaded.model(ids) - expected).abs().max().item() <= 1e-4


# (backend, checkpoint): the GGUF dequantized (dense) and held as stored for the native library's kernels (its Q8_0
# products run by the packed path's PackedWeights)
CASES = [("modules", "hf"), ("packed", "hf"), ("staged", "hf"), ("modules", "gguf-dense"), ("packed", "gguf-stored")]


@pytest.mark.parametrize(("backend", "source"), CASES)
@torch.no_grad()
def test_backends_greedy_ids_and_logits_equal_hf(backend: str, source: str, gemma3: tuple[Path, Path, ModelConfig],
                                                 hf: torch.nn.Module) -> None:
    folder, gguf_path, config = gemma3
    weights = {"hf": None, "gguf-dense": "dense", "gguf-stored": "native"}[source]
    model = load_model(str(folder if source == "hf" else gguf_path), dtype=FP32, use_cache=False,
                       weights=weights).model
    prompt = prompt_ids(config)
    expected_ids, expected_logits = hf_greedy(hf, prompt)
    ids, logits = greedy(model, backend, prompt)
    assert ids == expected_ids and len(set(ids)) > 1
    assert (logits - expected_logits).abs().max().item() <= 1e-4


def test_the_folders_fp32_products_are_not_the_c_steps(gemma3: tuple[Path, Path, ModelConfig]) -> None:
    """The C decode step multiplies matrices held as a GGUF stores them (the native library's kernels): the HF folder's
    fp32 matrices are not, so select() takes the packed path (under --staged the stage modules) and says why not the
    C step in one line, as the run's header, summary and JSON show a route not taken."""
    folder, _, _ = gemma3
    model = load_model(str(folder), dtype=FP32, use_cache=False).model
    model.setup_cache(1, PROMPT + STEPS)
    for request, route_taken in ((Request(), (PACKED, PACKED)), (Request(staged=True), (MODULES, MODULES))):
        route = select(model, request).route
        assert (route.prefill, route.decode) == route_taken
        reasons = {r.backend: r.reason for r in route.not_taken}
        assert "not held for the native library's kernels" in reasons[NATIVE] and "\n" not in reasons[NATIVE]


# The C step's backends as a run asks for them, and the route (prefill, decode) each then takes
C_REQUESTS = {"native": (Request(backend=NATIVE), (PACKED, NATIVE)),
              "native-staged": (Request(staged=True), (MODULES, NATIVE))}


@torch.no_grad()
def c_greedy(model: Transformer, backend: str, prompt: torch.Tensor) -> tuple[list[int], torch.Tensor]:
    """`greedy` on the C step (decode_step.c), every one of its decode steps one C call (its logits, not None: no
    torch fallback)."""
    request, route_taken = C_REQUESTS[backend]
    model.setup_cache(1, PROMPT + STEPS)
    route = select(model, request).route
    assert (route.prefill, route.decode) == route_taken, route
    run = backend_for(model, request)
    # C's count of a traced step's readings (NativeStep sizes its buffer by it) against Gemma's stages counted apart
    counted = tuple(stamp_count(model.config.n_layers, staged, qk_norm=True, post_norms=True, embed_scale=True,
                                softcap=True) for staged in (False, True))
    assert (run.plan.native.stamp_count, run.plan.native.staged_stamp_count) == counted
    c_steps = parity.count_c_steps(run, backend)
    ids, logits = parity.greedy_run(run, prompt, STEPS)
    assert len(c_steps) == STEPS - 1
    return ids, logits


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("backend", list(C_REQUESTS))
@torch.no_grad()
def test_the_c_step_gives_transformers_and_the_stage_modules_ids_and_logits(
        backend: str, threads: int, gemma3: tuple[Path, Path, ModelConfig], hf: torch.nn.Module) -> None:
    """The Q8_0 GGUF held as stored for the exact native kernel: every decode step one C call, with every Gemma twist
    in C's one layer loop ((1 + w) norms, norms after attention and FFN, GeGLU, × √d, QK-norm, the scale, the
    windowed layers' keys and RoPE base beside the global layer's, the soft-cap), fused or staged, on one thread
    and two: transformers' greedy ids and logits on the folder, and the stage modules' on the same file."""
    if not native_kernel.available():
        pytest.skip(f"native kernel not available here: {native_kernel.unavailable_reason()}")
    _, gguf_path, config = gemma3
    model = load_model(str(gguf_path), dtype=FP32, use_cache=False, weights="native").model
    prompt = prompt_ids(config)
    expected_ids, expected_logits = hf_greedy(hf, prompt)
    module_ids, module_logits = greedy(model, "modules", prompt)
    with torch_threads(threads):
        ids, logits = c_greedy(model, backend, prompt)
    assert ids == expected_ids == module_ids and len(set(ids)) > 1
    assert (logits - expected_logits).abs().max().item() <= 1e-4
    assert (logits - module_logits).abs().max().item() <= 1e-4
    assert expected_logits.abs().max() > 0.5 * SOFTCAP  # where the soft-cap bends a logit by 8% and more


def test_a_run_ahead_generates_the_stage_modules_ids(gemma3: tuple[Path, Path, ModelConfig]) -> None:
    """A whole untraced run: its decode steps run ahead in C (several steps a call, each layer attending its own
    window's keys), and generate the stage modules' ids."""
    from llmtrace.tracer.run.generate import Generation
    from llmtrace.tracer.trace.records import RunSettings

    if not native_kernel.available():
        pytest.skip(f"native kernel not available here: {native_kernel.unavailable_reason()}")
    _, gguf_path, _ = gemma3
    loaded = load_model(str(gguf_path), weights="native")
    runs = {}
    for backend in (None, MODULES):
        settings = RunSettings(model=str(gguf_path), prompt="The capital of France is", max_new_tokens=12,
                               temperatures=(), trace=False)
        runs[backend] = Generation(loaded, settings, backend=backend).run()
    native, modules = runs[None], runs[MODULES]
    assert (native.route.decode, native.route.ahead) == (NATIVE, True) and modules.route.decode == MODULES
    assert native.run_ahead is not None and native.run_ahead.steps == 11
    assert native.generated_ids == modules.generated_ids and len(native.generated_ids) == 12


@pytest.mark.parametrize("staged", [False, True])
def test_the_c_steps_traced_records_are_the_torch_paths(staged: bool, gemma3: tuple[Path, Path, ModelConfig]) -> None:
    """Traced, the C step stamps each Gemma stage where the torch path marks it: a fused step's records (its readings
    taken by the packed path's marks) are the packed path's, a staged step's (taken by the "wrap" tracer) the
    wrapped stage modules', field by field but the times: names, order, shapes, FLOPs, bytes."""
    import dataclasses

    from llmtrace.tracer.trace.hooks import Tracer
    from llmtrace.tracer.trace.records import DECODE, PREFILL

    if not native_kernel.available():
        pytest.skip(f"native kernel not available here: {native_kernel.unavailable_reason()}")
    _, gguf_path, config = gemma3
    model = load_model(str(gguf_path), dtype=FP32, use_cache=False, weights="native").model
    torch_request = Request(staged=True, traced=True, backend=MODULES) if staged else Request(traced=True,
                                                                                              backend=PACKED)
    records = []
    for request in (Request(staged=staged, traced=True), torch_request):
        model.setup_cache(1, PROMPT + STEPS)
        assert select(model, request).route.decode == (NATIVE if request.backend is None else request.backend)
        with Tracer(model, mechanism="wrap" if staged else "fused") as tracer:
            run = backend_for(model, request).traced(tracer)
            for step in range(STEPS):
                tracer.begin_step(PREFILL if step == 0 else DECODE, step)
                with torch.no_grad():
                    run.prefill(prompt_ids(config)) if step == 0 else run.decode(torch.tensor([[7 + step]]))
                tracer.end_step()
        records.append([dataclasses.replace(r, start_ns=0, duration_ns=0) for r in tracer.records()])
    assert records[0] == records[1]
    decode = [r.short_name for r in records[0] if r.step == 1]
    assert decode[:2] == ["tok_embeddings", "embed_scale"] and decode[-3:] == ["norm", "output", "softcap"]
    assert decode.count("post_attention_norm") == decode.count("post_ffn_norm") == config.n_layers


def _traced(model: Transformer, config: ModelConfig, mechanism: str = "wrap") -> tuple[tuple, list[int]]:
    """Records of a PROMPT-token prefill and STEPS - 1 decode steps through the stage modules ("wrap") or the packed
    path ("fused"), and FlopCounterMode's total of each step (its module tracker's hooks send a step through the
    stage modules: counted on "wrap" only)."""
    from torch.utils.flop_counter import FlopCounterMode

    from llmtrace.tracer.trace.hooks import Tracer
    from llmtrace.tracer.trace.records import DECODE, PREFILL

    model.setup_cache(1, PROMPT + STEPS)
    generator = torch.Generator().manual_seed(0)
    counted = []
    with Tracer(model, mechanism=mechanism) as tracer:
        run = backend_for(model).traced(tracer)
        for step in range(STEPS):
            ids = torch.randint(3, config.vocab_size, (1, PROMPT if step == 0 else 1), generator=generator)
            tracer.begin_step(PREFILL if step == 0 else DECODE, step)
            counter = FlopCounterMode(display=False)
            with counter if mechanism == "wrap" else torch.no_grad():
                run.prefill(ids) if step == 0 else run.decode(ids)
            tracer.end_step()
            counted.append(counter.get_total_flops())
    return tracer.records(), counted


def test_each_twist_is_a_stage_and_the_flops_equal_flop_counter_and_the_estimate(
        gemma3: tuple[Path, Path, ModelConfig]) -> None:
    """Every Gemma stage in its place, in every layer; per step, the traced matmul FLOPs = FlopCounterMode's = the
    estimate's, and every stage of every layer (a windowed layer's attention over at most T + W - 1 keys, the
    global layer's over all) = the estimate's component for that layer; the weight and KV bytes in total too."""
    from llmtrace.tracer.analytic import estimate
    from llmtrace.tracer.trace.summary import stage_totals

    folder, _, config = gemma3
    model = load_model(str(folder), dtype=FP32, use_cache=False).model
    records, counted = _traced(model, config)
    layer0 = [r.short_name for r in records if r.step == 0 and r.layer == 0]
    assert layer0 == ["attention_norm", "attention.wq", "attention.wk", "attention.wv", "attention.qk_norm",
                      "attention.rope", "attention.kv_cache", "attention.scores", "attention.softmax", "attention.pv",
                      "attention.wo", "post_attention_norm", "attn_residual", "ffn_norm", "feed_forward.w1",
                      "feed_forward.w3", "feed_forward.gelu", "feed_forward.w2", "post_ffn_norm", "ffn_residual"]
    top = [r.short_name for r in records if r.step == 0 and r.layer is None]
    assert top == ["tok_embeddings", "embed_scale", "norm", "output", "softcap"]
    for step, stages, phase in _beside_the_estimate(records, config):
        ours = stage_totals(stages)
        assert ours.matmul_flops == counted[step] == phase.totals.matmul_flops
        assert (ours.flops, ours.weight_bytes_read) == (phase.totals.total_flops, phase.totals.weight_bytes)
        assert (ours.kv_bytes_read, ours.kv_bytes_written) == (phase.totals.kv_read_bytes,
                                                                phase.totals.kv_write_bytes)
        components = {c.name: c for c in phase.components}
        for record in stages:
            parts = estimate.stage_components(record.short_name, config, record.layer)
            assert record.flops == sum(components[part].flops for part in parts), (step, record.layer, record.short_name)
        keys = {r.layer: r.input_shapes[1][2] for r in stages if r.short_name == "attention.scores"}
        seen = PROMPT + step
        assert keys == {**{i: min(seen, WINDOW + (PROMPT - 1 if step == 0 else 0)) for i in range(5)}, 5: seen}


def test_presets_have_the_technical_reports_parameter_counts() -> None:
    """Gemma 3 technical report, Table 1: 1B 302M embedding + 698M non-embedding parameters; 4B 3,209M
    non-embedding (its 675M embedding figure counts more than the text model's 262,208 × 2,560 table, and its
    vision tower's 417M is not the text model's). By hand for the 1B (head_dim 256, 4 heads, 1 KV head, FFN 6,912):
    a layer is Q 1152·1024 + K, V 1152·256 each + O 1024·1152 = 2,949,120, GeGLU 3·1152·6912 = 23,887,872, four
    norms of 1,152 and the two Q/K-norm vectors of 256 = 5,120: 26,842,112; × 26 layers, + the final norm 1,152, + the
    (tied) embedding 262,144·1,152 = 301,989,888: 999,885,952 (the hub's 1,000M)."""
    from llmtrace.tracer.analytic.params import count_params
    from llmtrace.tracer.core.presets import get_preset

    small, large = count_params(get_preset("gemma3-1b")), count_params(get_preset("gemma3-4b"))
    assert (small.attention_per_layer, small.ffn_per_layer, small.norms_per_layer) == (2_949_120, 23_887_872, 5_120)
    assert small.embedding == 301_989_888 and small.tied and small.lm_head == 0
    assert small.total == 26 * 26_842_112 + 1_152 + 301_989_888 == 999_885_952
    assert round(small.embedding / 1e6) == 302 and round(small.non_embedding / 1e6) == 698
    # 4B: a layer 2560·2048·2 + 2560·1024·2 = 15,728,640, 3·2560·10240 = 78,643,200, 4·2560 + 2·256 = 10,752
    assert large.per_layer == 15_728_640 + 78_643_200 + 10_752
    assert large.non_embedding == 34 * large.per_layer + 2_560 == 3_209_010_688
    assert round(large.non_embedding / 1e6) == 3_209 and large.embedding == 262_208 * 2_560


def test_kvmem_holds_the_window_on_windowed_layers_and_every_position_on_global_ones() -> None:
    """gemma3-1b at 8,192 positions in fp32: 22 windowed layers hold 512 positions, 4 global layers 8,192; one
    position of one layer is 2 · 1 KV head · 256 · 4 B = 2,048 B. `run` allocating more is said."""
    from llmtrace.tracer.analytic.kvmem import kv_cache_bytes, kvmem_report
    from llmtrace.tracer.core.dtypes import FP32 as fp32
    from llmtrace.tracer.core.presets import get_preset

    config = get_preset("gemma3-1b")
    assert kv_cache_bytes(config, 8192, fp32) == 2_048 * (22 * 512 + 4 * 8192) == 90_177_536
    assert kv_cache_bytes(config, 300, fp32) == 2_048 * 26 * 300  # under the window every layer holds all
    report = kvmem_report(config, 8192, fp32, budget_bytes=2**30)
    assert report.size.total_bytes == 90_177_536 and report.size.global_layers == 4
    assert "22 windowed layers × 512 positions" in report.formula and "4 global layers × 8192" in report.formula
    assert report.run_note.startswith("`run` allocates every layer's cache") and "436,207,616 B" in report.run_note
    # 1 GiB: (2^30 // 53,248) positions of every layer, less the windowed layers' 512 each, over the 4 global layers
    assert report.budget.max_positions_kv_only == (2**30 // 53_248 * 26 - 22 * 512) // 4


@pytest.mark.parametrize("preset", ["gemma3-1b", "gemma3-4b"])
def test_dry_run_of_the_presets_traces_the_estimate(preset: str) -> None:
    """run --dry-run: every Gemma stage traced on the meta model, its FLOPs equal to the estimate's in the prefill
    (past the window) and the decode step."""
    from typer.testing import CliRunner

    from llmtrace.cli.app import app

    result = CliRunner().invoke(app, ["run", "--model", preset, "--dry-run", "--prompt-tokens", "1100",
                                      "--max-new-tokens", "2"], terminal_width=120)
    assert result.exit_code == 0, result.output
    out = result.output
    assert out.count("= equal") == 2
    assert "global" in out.splitlines()[0] and "norms before and after" in out and "× √" in out


@torch.no_grad()
def test_transformers_gguf_reading_gives_llmtraces_logits(gemma3: tuple[Path, Path, ModelConfig],
                                                          hf: torch.nn.Module) -> None:
    """The same GGUF through transformers' own GGUF loading (its dequantization, its names, its 1 + w less 1) and
    through llmtrace's reader. The folder's config is passed: transformers' gemma3 GGUF mapping reads neither the
    windowed layers' RoPE base, the linear scaling, query_pre_attn_scalar nor the soft-cap (its defaults would
    stand in), where llmtrace's reader takes them as llama.cpp does."""
    _, gguf_path, config = gemma3
    theirs = transformers.Gemma3ForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name,
                                                            config=hf.config, dtype=torch.float32,
                                                            attn_implementation="eager").eval()
    ours = load_model(str(gguf_path), dtype=FP32, use_cache=False, weights="dense").model
    ids = torch.randint(3, config.vocab_size, (2, 11), generator=torch.Generator().manual_seed(6))
    expected = theirs(input_ids=ids).logits
    assert expected.abs().max() > 1.0
    assert (ours(ids) - expected).abs().max().item() <= 1e-4


def test_the_packed_path_marks_every_gemma_stage_with_the_estimates_flops(
        gemma3: tuple[Path, Path, ModelConfig]) -> None:
    """The packed path marks the contract's fused stages (Q|K|V and gate|up packed) with Gemma's among them; each
    stage of every layer carries the estimate's FLOPs for that layer (a windowed or the global one), and a step's
    totals are the estimate's."""
    from llmtrace.tracer.analytic import estimate
    from llmtrace.tracer.trace.summary import stage_totals

    folder, _, config = gemma3
    model = load_model(str(folder), dtype=FP32, use_cache=False).model
    records, _ = _traced(model, config, "fused")
    assert [r.short_name for r in records if r.step == 0 and r.layer == 5] == [
        "attention_norm", "attention.wqkv", "attention.qk_norm", "attention.rope", "attention.kv_cache",
        "attention.scores", "attention.softmax", "attention.pv", "attention.wo", "post_attention_norm",
        "attn_residual", "ffn_norm", "feed_forward.w13", "feed_forward.gelu", "feed_forward.w2", "post_ffn_norm",
        "ffn_residual"]
    for step, stages, phase in _beside_the_estimate(records, config):
        ours = stage_totals(stages)
        assert (ours.flops, ours.matmul_flops, ours.weight_bytes_read, ours.kv_bytes_read) == (
            phase.totals.total_flops, phase.totals.matmul_flops, phase.totals.weight_bytes,
            phase.totals.kv_read_bytes)
        components = {c.name: c for c in phase.components}
        for record in stages:
            parts = estimate.stage_components(record.short_name, config, record.layer)
            assert record.flops == sum(components[part].flops for part in parts), (step, record.layer, record.short_name)


def _beside_the_estimate(records: list, config: ModelConfig) -> Iterator[tuple[int, list, Any]]:
    """(step, its stage records, the estimate's phase for it: the prompt's prefill, then each decode step)."""
    from llmtrace.tracer.analytic import estimate

    dtypes = estimate.Dtypes.for_weights(FP32)
    for step in range(STEPS):
        phase = (estimate.prefill(config, PROMPT, dtypes) if step == 0
                 else estimate.decode_step(config, PROMPT - 1 + step, dtypes))
        yield step, [r for r in records if r.step == step], phase


@pytest.mark.parametrize("backend", ["modules", "packed"])
@torch.no_grad()
def test_a_left_padded_batch_gives_each_rows_own_logits(backend: str, gemma3: tuple[Path, Path, ModelConfig]) -> None:
    """Prompts of 9 and 5 tokens in one batch, the shorter left-padded: the pad mask spans a global layer's keys and a
    windowed layer reads its last S of them; every step's logits of each row equal its run alone."""
    folder, _, config = gemma3
    model = load_model(str(folder), dtype=FP32, use_cache=False).model
    gaps = parity.left_padded_gaps(model, prompt_ids(config)[0], 4, backend)
    assert max(gaps) <= 1e-4, gaps


def test_run_refuses_to_split_gemma_over_ranks(gemma3: tuple[Path, Path, ModelConfig]) -> None:
    """The tensor-parallel model's embed and logits (tracer/model/tensor_parallel.py) apply neither × √d nor the
    soft-cap: `run --tp 2` says so in one line, exit 2, before any rank starts."""
    from typer.testing import CliRunner

    from llmtrace.cli.app import app

    folder, _, _ = gemma3
    result = CliRunner().invoke(app, ["run", "--model", str(folder), "hi", "--tp", "2"])
    assert result.exit_code == 2
    assert result.stderr.strip().endswith("scales its embeddings by √d (Gemma), which the ranks' split does not "
                                          "apply yet; run it on one device (`roofline --tp` costs the split)")
