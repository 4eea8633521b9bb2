"""Phi-3's LongRoPE (its 128k models: HF rope_scaling type "longrope", GGUF 'phi3' with rope_factors_long/_short):
frequency i divided by a short factor up to the original context and by a long one past it, cos and sin times the
attention factor. Greedy ids and logits equal transformers' Phi3ForCausalLM on a tiny random model (1e-4, fp32) on
every backend that runs it, from the folder and from a Q8_0 GGUF of the same weights, past the original context
(long factors) and within it (short ones).

The tiny model's original context is 8 positions of 64 (its stretch 8, its attention factor sqrt(1 + ln 8 / ln 8) =
sqrt(2), as transformers derives it); the factors are multiples of 1/4 (the GGUF's F32 holds them exactly) and far
apart, so a wrong choice of factors moves the logits by far more than 1e-4. transformers picks the factors per
forward by its last position, llama.cpp once by its context's size, llmtrace by its tables' length (the run's cache):
the cases here are those where all three agree (every position past the original context, or every one within it)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import gguf
import numpy as np
import parity
import pytest
import torch
from safetensors.torch import save_file
from test_phi3 import _UNPACKED, _config_dict, _packed
from tiny_gguf import sentencepiece_vocab, write_tiny_gguf
from tiny_llama import random_weights

from llmtrace.tracer.core.config import ModelConfig
from llmtrace.tracer.core.contract import ours_to_hf
from llmtrace.tracer.core.dtypes import FP32
from llmtrace.tracer.core.errors import ConfigError
from llmtrace.tracer.load.loader import load_model
from llmtrace.tracer.model import native_kernel
from llmtrace.tracer.model.rope import rope_inv_freq
from llmtrace.tracer.run.backends import backend_for
from llmtrace.tracer.run.select import Request, select
from llmtrace.tracer.trace.records import MODULES, NATIVE, PACKED

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.usefixtures("private_dirs")

ORIGINAL, LONGEST, HEAD = 8, 64, 16
SHORT = [1.0 + 0.25 * i for i in range(HEAD // 2)]
LONG = [4.0 + 2.0 * i for i in range(HEAD // 2)]
Q8_0 = gguf.GGMLQuantizationType.Q8_0


def _config() -> dict:
    return {**_config_dict(0), "sliding_window": None, "max_position_embeddings": LONGEST,
            "original_max_position_embeddings": ORIGINAL,
            "rope_scaling": {"type": "longrope", "short_factor": SHORT, "long_factor": LONG}}


def longrope_checkpoints(tmp_path_factory: pytest.TempPathFactory, name: str, config_dict: dict, seed: int,
                         sp_model_bytes: bytes) -> tuple[Path, Path, ModelConfig]:
    """(a LongRoPE Phi3ForCausalLM folder of `config_dict`, a Q8_0 'phi3' GGUF of the same weights as llama.cpp's
    converter writes one: its factors as F32 tensors, its attention factor (sqrt(2), the tiny models') and original
    context in the metadata, the config). The matrices are rounded through Q8_0 first, so the file holds the folder's
    values exactly. test_partial_rotary.py's Phi-4-mini-shaped model is written here too."""
    folder = tmp_path_factory.mktemp(name)
    (folder / "config.json").write_text(json.dumps(config_dict), encoding="utf-8")
    config = ModelConfig.from_hf_json(folder)
    weights = random_weights(config, seed=seed)
    for key, tensor in weights.items():
        if tensor.dim() == 2:
            array = tensor.numpy().astype(np.float32)
            weights[key] = torch.from_numpy(gguf.quants.dequantize(gguf.quants.quantize(array, Q8_0), Q8_0).copy())
    hf = {ours_to_hf(n): t.contiguous() for n, t in weights.items() if not any(f".{u}." in n for u in _UNPACKED)}
    packed = {}
    for layer in range(config.n_layers):
        qkv, gate_up = _packed(weights, layer)
        hf[f"model.layers.{layer}.self_attn.qkv_proj.weight"] = qkv
        hf[f"model.layers.{layer}.mlp.gate_up_proj.weight"] = gate_up
        packed[f"blk.{layer}.attn_qkv.weight"], packed[f"blk.{layer}.ffn_up.weight"] = qkv, gate_up
    save_file(hf, str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / "tokenizer.model").write_bytes(sp_model_bytes)
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "add_bos_token": True,
        "tokenizer_class": "LlamaTokenizer", "legacy": False}), encoding="utf-8")
    members = {n: t for n, t in weights.items() if not any(f".{u}." in n for u in _UNPACKED)}
    scaling = config_dict["rope_scaling"]
    packed["rope_factors_short.weight"] = torch.tensor(scaling["short_factor"])
    packed["rope_factors_long.weight"] = torch.tensor(scaling["long_factor"])
    gguf_path = write_tiny_gguf(
        tmp_path_factory.mktemp(f"{name}-gguf") / "phi3.gguf", config, members,
        sentencepiece_vocab(sp_model_bytes), matrix_type=Q8_0, arch="phi3", extra_tensors=packed,
        extra_metadata={"phi3.rope.scaling.attn_factor": math.sqrt(2.0),
                        "phi3.rope.scaling.original_context_length": config_dict["original_max_position_embeddings"]})
    return folder, gguf_path, config


@pytest.fixture(scope="module")
def longrope(tmp_path_factory: pytest.TempPathFactory, sp_model_bytes: bytes,
             sp_vocab_size: int) -> tuple[Path, Path, ModelConfig]:
    """(a LongRoPE Phi3ForCausalLM folder, a Q8_0 'phi3' GGUF of the same weights, the config)."""
    return longrope_checkpoints(tmp_path_factory, "tiny-phi3-longrope", {**_config(), "vocab_size": sp_vocab_size},
                                13, sp_model_bytes)


@pytest.fixture(scope="module")
def hf(longrope: tuple[Path, Path, ModelConfig]) -> torch.nn.Module:
    return transformers.Phi3ForCausalLM.from_pretrained(longrope[0], dtype=torch.float32,
                                                        attn_implementation="eager").eval()


def test_the_folder_and_the_gguf_read_the_same_longrope(longrope: tuple[Path, Path, ModelConfig]) -> None:
    """The factors, the original context and the attention factor transformers derives (sqrt(1 + ln 8 / ln 8)),
    from config.json and from the GGUF's tensors and metadata; the tables' frequencies are 1 / (factor · θ^(2i/D)),
    the short factors' up to 8 positions and the long ones' past them."""
    folder, gguf_path, config = longrope
    scaling = config.rope_scaling
    assert (scaling.kind, scaling.original_max_position, scaling.factor) == ("longrope", ORIGINAL, 8.0)
    assert (list(scaling.short_factor), list(scaling.long_factor)) == (SHORT, LONG)
    assert scaling.attention_factor == math.sqrt(2.0)
    other = load_model(str(gguf_path), dry_run=True).config.rope_scaling
    assert (other.kind, other.original_max_position, other.factor, other.short_factor, other.long_factor) == (
        "longrope", ORIGINAL, 8.0, scaling.short_factor, scaling.long_factor)
    assert other.attention_factor == pytest.approx(math.sqrt(2.0), rel=1e-7)  # an F32 in the file
    plain = 1.0 / 10000.0 ** (torch.arange(0, HEAD, 2).float() / HEAD)
    for length, factors in ((ORIGINAL, SHORT), (ORIGINAL + 1, LONG)):
        assert torch.allclose(rope_inv_freq(HEAD, 10000.0, scaling, length), plain / torch.tensor(factors), rtol=1e-6)


@pytest.mark.parametrize("length", [6, 13])
@torch.no_grad()
def test_cache_free_logits_equal_phi3_for_causal_lm(length: int, longrope: tuple[Path, Path, ModelConfig],
                                                    hf: torch.nn.Module) -> None:
    """Within the original context (the short factors) and past it (the long ones), from the folder and the GGUF."""
    folder, gguf_path, config = longrope
    ids = torch.randint(3, config.vocab_size, (2, length), generator=torch.Generator().manual_seed(4))
    expected = hf(input_ids=ids).logits
    assert expected.abs().max() > 1.0
    for path, weights in ((folder, None), (gguf_path, "dense")):
        model = load_model(str(path), dtype=FP32, use_cache=False, weights=weights).model
        assert (model(ids) - expected).abs().max().item() <= 1e-4, path


@torch.no_grad()
def test_a_cache_free_pass_leaves_the_caches_tables(longrope: tuple[Path, Path, ModelConfig]) -> None:
    """A short cache-free pass (the short factors) after a cache set up past the original context (the long ones)
    leaves the cache's tables as they were: the cached steps then give what they gave before it."""
    model = load_model(str(longrope[0]), dtype=FP32).model
    ids = torch.randint(3, model.config.vocab_size, (1, 5), generator=torch.Generator().manual_seed(6))
    model.setup_cache(1, LONGEST)
    expected = [model.prefill(ids), model.decode_one(ids[:, :1])]
    model.setup_cache(1, LONGEST)
    model(ids[:, :3])  # inside the original context: tables of the short factors for this pass only
    got = [model.prefill(ids), model.decode_one(ids[:, :1])]
    assert all(torch.equal(a, b) for a, b in zip(got, expected))


@torch.no_grad()
def test_transformers_gguf_reading_gives_llmtraces_logits(longrope: tuple[Path, Path, ModelConfig],
                                                          hf: torch.nn.Module) -> None:
    """The same GGUF through transformers' own GGUF loading (its dequantization, its split of attn_qkv and ffn_up)
    and through llmtrace's reader (its factors from the file's tensors), within and past the original context. The
    folder's config is passed: transformers' phi3 GGUF mapping reads no LongRoPE (neither the factors' tensors nor
    the attention factor), where llmtrace's reader takes them as llama.cpp does."""
    _, gguf_path, config = longrope
    theirs = transformers.Phi3ForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name, config=hf.config,
                                                          dtype=torch.float32, attn_implementation="eager").eval()
    ours = load_model(str(gguf_path), dtype=FP32, use_cache=False, weights="dense").model
    for length in (6, 13):
        ids = torch.randint(3, config.vocab_size, (2, length), generator=torch.Generator().manual_seed(6))
        expected = theirs(input_ids=ids).logits
        assert expected.abs().max() > 1.0
        assert (ours(ids) - expected).abs().max().item() <= 1e-4, length


REQUESTS = {"modules": (Request(backend=MODULES), MODULES), "packed": (Request(backend=PACKED), PACKED),
            "staged": (Request(staged=True), None), "native": (Request(backend=NATIVE), NATIVE),
            "native-staged": (Request(staged=True), NATIVE)}
# (backend, checkpoint): the folder on the torch backends, the GGUF dequantized on the modules and held as stored for
# the exact native kernel on the C step (fused and staged)
CASES = [("modules", "hf"), ("packed", "hf"), ("staged", "hf"), ("modules", "gguf-dense"), ("native", "gguf-stored"),
         ("native-staged", "gguf-stored")]


@pytest.mark.parametrize(("prompt", "steps"), [(9, 8), (3, 5)])  # past the original context; within it
@pytest.mark.parametrize(("backend", "source"), CASES)
@torch.no_grad()
def test_greedy_ids_and_logits_equal_hf(backend: str, source: str, prompt: int, steps: int,
                                        longrope: tuple[Path, Path, ModelConfig], hf: torch.nn.Module) -> None:
    folder, gguf_path, config = longrope
    if source == "gguf-stored" and not native_kernel.available():
        pytest.skip(f"native kernel not available here: {native_kernel.unavailable_reason()}")
    weights = {"hf": None, "gguf-dense": "dense", "gguf-stored": "native"}[source]
    model = load_model(str(folder if source == "hf" else gguf_path), dtype=FP32, use_cache=False,
                       weights=weights).model
    ids = parity.prompt_ids(config.vocab_size, prompt)
    expected_ids, expected_logits = parity.hf_greedy(hf, ids, steps)
    request, decode = REQUESTS[backend]
    model.setup_cache(1, prompt + steps)
    if decode is not None:
        assert select(model, request).route.decode == decode
    got_ids, logits = parity.greedy_run(backend_for(model, request), ids, steps)
    assert got_ids == expected_ids and len(set(got_ids)) > 1
    assert (logits - expected_logits).abs().max().item() <= 1e-4


def test_a_longrope_gguf_without_its_factors_is_one_line() -> None:
    meta = {"general.architecture": "phi3", "phi3.rope.scaling.attn_factor": 1.19, "phi3.block_count": 2,
            "phi3.rope.scaling.original_context_length": 4096, "phi3.attention.head_count": 4,
            "phi3.embedding_length": 64, "phi3.vocab_size": 100}
    with pytest.raises(ConfigError, match="without the F32 tensors rope_factors_short.weight and "
                                          "rope_factors_long.weight; the file is incomplete"):
        ModelConfig.from_gguf_metadata(meta, "m", "m.gguf")


@pytest.mark.parametrize(("scaling", "message"), [
    ({"type": "longrope", "short_factor": [1.0] * 3, "long_factor": [1.0] * 3}, "LongRoPE has 3 factors"),
    ({"type": "longrope", "short_factor": [1.0] * 8}, "rope_scaling.long_factor must be a list of numbers"),
])
def test_longrope_factors_that_do_not_fit_are_one_line(scaling: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        ModelConfig.from_hf_dict({**_config(), "vocab_size": 100, "rope_scaling": scaling})


def test_longrope_factors_without_the_attention_factor_are_one_line() -> None:
    """The loader skips rope_factors_* (the config holds them): read without LongRoPE, they would be dropped unseen."""
    meta = {"general.architecture": "phi3", "phi3.block_count": 2, "phi3.attention.head_count": 4,
            "phi3.embedding_length": 64, "phi3.vocab_size": 100, "_llmtrace.rope_factors_long": (2.0,) * 8}
    with pytest.raises(ConfigError, match="rope_factors_short/_long tensors \\(LongRoPE\\) without "
                                          "phi3.rope.scaling.attn_factor; the file is incomplete"):
        ModelConfig.from_gguf_metadata(meta, "m", "m.gguf")


@pytest.mark.parametrize("original", [0, 1])
def test_an_original_context_below_two_is_one_line(original: int) -> None:
    """The stretch divides by the original context and the attention factor by its log (ZeroDivisionError before)."""
    with pytest.raises(ConfigError, match=f"original_max_position_embeddings must be a whole number above 1, got "
                                          f"{original}; the file is malformed"):
        ModelConfig.from_hf_dict({**_config(), "vocab_size": 100, "original_max_position_embeddings": original})


def test_a_longrope_gguf_with_no_original_context_is_one_line() -> None:
    meta = {"general.architecture": "phi3", "phi3.rope.scaling.attn_factor": 1.19, "phi3.block_count": 2,
            "phi3.rope.scaling.original_context_length": 0, "phi3.attention.head_count": 4,
            "phi3.embedding_length": 64, "phi3.vocab_size": 100,
            "_llmtrace.rope_factors_short": (1.0,) * 8, "_llmtrace.rope_factors_long": (2.0,) * 8}
    with pytest.raises(ConfigError, match="phi3.rope.scaling.original_context_length must be a positive whole "
                                          "number, got 0; the file is malformed"):
        ModelConfig.from_gguf_metadata(meta, "m", "m.gguf")


@pytest.mark.parametrize(("new", "first"), [(2, 1 / SHORT[0]), (12, 1 / LONG[0])])
def test_a_runs_rope_record_has_its_tables_frequencies(new: int, first: float,
                                                       longrope: tuple[Path, Path, ModelConfig]) -> None:
    """The run's RoPE record (the prefill's frequencies, shown by `run`) is its tables': the short factors' for a
    prompt and new tokens within the original context, the long ones' past it."""
    from llmtrace.tracer.run.generate import Generation, PrefillDone
    from llmtrace.tracer.trace.records import RunSettings

    _, gguf_path, _ = longrope
    settings = RunSettings(model=str(gguf_path), prompt="The sky", max_new_tokens=new, temperatures=(), trace=False)
    done = [e for e in Generation(load_model(str(gguf_path)), settings).events() if isinstance(e, PrefillDone)]
    prompt = len(done[0].rope.positions)
    assert prompt + 2 <= ORIGINAL < prompt + 12  # the two cases: within the original context, past it
    assert done[0].rope.inv_freq_first == pytest.approx(first, rel=1e-6)


def test_a_longrope_runs_trace_reads_back_equal(longrope: tuple[Path, Path, ModelConfig]) -> None:
    """The saved trace's config holds the factors as tuples again: equal to the run's, and hashable (read back as
    JSON lists, they were neither)."""
    from llmtrace.tracer.run.generate import generate
    from llmtrace.tracer.trace.records import RunSettings
    from llmtrace.tracer.trace.run_trace import Trace

    _, gguf_path, _ = longrope
    settings = RunSettings(model=str(gguf_path), prompt="The sky", max_new_tokens=2, temperatures=())
    trace = generate(load_model(str(gguf_path)), settings)
    back = Trace.from_json(trace.to_json())
    assert back.config.rope_scaling.long_factor == tuple(LONG)
    assert back == trace and hash(back.config) == hash(trace.config)


def test_a_trace_written_with_llama3s_factors_for_longrope_reads_back_the_same(
        longrope: tuple[Path, Path, ModelConfig]) -> None:
    """The low and high frequency factors are llama3 scaling's alone (None for LongRoPE and linear): a trace written
    before, which held llama3's 1.0 and 4.0 for every kind, reads back as the config a run makes now; a trace of
    now validates against the schema (LongRoPE's factors and the null ones in it)."""
    import jsonschema

    from llmtrace.tracer.run.generate import generate
    from llmtrace.tracer.trace.records import RunSettings
    from llmtrace.tracer.trace.run_trace import Trace, load_schema

    _, gguf_path, _ = longrope
    settings = RunSettings(model=str(gguf_path), prompt="The sky", max_new_tokens=2, temperatures=())
    trace = generate(load_model(str(gguf_path)), settings)
    data = json.loads(trace.to_json())
    scaling = data["config"]["rope_scaling"]
    assert (scaling["kind"], scaling["low_freq_factor"], scaling["high_freq_factor"]) == ("longrope", None, None)
    jsonschema.validate(data, load_schema())
    scaling.update(low_freq_factor=1.0, high_freq_factor=4.0)  # as traces were written before
    back = Trace.from_json(json.dumps(data))
    assert back.config == trace.config and back.config.rope_scaling.low_freq_factor is None


@pytest.mark.parametrize("kind", ["linear", "longrope"])
def test_llama3s_frequency_factors_are_refused_on_another_kind(kind: str) -> None:
    from llmtrace.tracer.core.config import RopeScaling

    factors = {"short_factor": (1.0,), "long_factor": (2.0,)} if kind == "longrope" else {}
    RopeScaling(8.0, 8192, kind=kind, **factors).check("m")  # none: its own fields suffice
    with pytest.raises(ConfigError, match=f"are 'llama3' scaling's; '{kind}' has none"):
        RopeScaling(8.0, 8192, kind=kind, low_freq_factor=1.0, high_freq_factor=4.0, **factors).check("m")
