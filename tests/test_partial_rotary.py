"""Partial rotary (Phi-4-mini: HF Phi3ForCausalLM with partial_rotary_factor 0.75, GGUF 'phi3' whose
rope.dimension_count is below the head's width): RoPE turns the first R values of each q and k head (pairs i and
i + R/2, frequencies θ^(-2i/R), HF's rotate_half over them; llama.cpp's NEOX RoPE over n_rot) and passes the other
D - R through. Greedy ids and logits equal transformers' on a tiny random model (1e-4, fp32) on the stage modules,
the packed path and the C decode step (fused and staged), from the folder and from a Q8_0 GGUF of the same weights;
the GGUF through transformers' own GGUF reading gives llmtrace's logits; RoPE's FLOPs count the R values turned.

The tiny model is Phi-4-mini's shape scaled down: 4 heads of 16 over 2 KV heads, R = 12 (0.75 of 16), tied
embeddings, LongRoPE with 6 short and 6 long factors (one per frequency of the R turned: 16 / 2 would not load) and
an original context of 8, so that both sets of factors are exercised (test_longrope.py's reasoning)."""

from __future__ import annotations

import json
from pathlib import Path

import parity
import pytest
import torch
from estimate_check import assert_traced_equals_estimate
from test_gemma3 import PROMPT as TRACED_PROMPT
from test_gemma3 import STEPS as TRACED_STEPS
from test_gemma3 import _traced as traced
from test_longrope import longrope_checkpoints
from test_phi3 import _config_dict
from typer.testing import CliRunner

from llmtrace.cli.app import app
from llmtrace.tracer.core.config import ModelConfig
from llmtrace.tracer.core.dtypes import FP32
from llmtrace.tracer.core.errors import ConfigError, UnsupportedModelError
from llmtrace.tracer.load.loader import load_model
from llmtrace.tracer.model import native_kernel
from llmtrace.tracer.model.rope import RotaryEmbedding
from llmtrace.tracer.run.backends import backend_for
from llmtrace.tracer.run.select import Request, select
from llmtrace.tracer.trace.records import MODULES, NATIVE, PACKED

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.usefixtures("private_dirs")

HEAD, ROTARY, ORIGINAL, LONGEST = 16, 12, 8, 64
SHORT = [1.0 + 0.25 * i for i in range(ROTARY // 2)]
LONG = [4.0 + 2.0 * i for i in range(ROTARY // 2)]


def _config() -> dict:
    return {**_config_dict(0), "sliding_window": None, "tie_word_embeddings": True, "partial_rotary_factor": 0.75,
            "max_position_embeddings": LONGEST, "original_max_position_embeddings": ORIGINAL,
            "rope_scaling": {"type": "longrope", "short_factor": SHORT, "long_factor": LONG}}


@pytest.fixture(scope="module")
def phi4(tmp_path_factory: pytest.TempPathFactory, sp_model_bytes: bytes,
         sp_vocab_size: int) -> tuple[Path, Path, ModelConfig]:
    """(a Phi-4-mini-shaped Phi3ForCausalLM folder, a Q8_0 'phi3' GGUF of the same weights as llama.cpp's converter
    writes one: rope.dimension_count R, Q|K|V in HF's row order, the LongRoPE factors as F32 tensors, the config)."""
    return longrope_checkpoints(tmp_path_factory, "tiny-phi4-mini", {**_config(), "vocab_size": sp_vocab_size}, 17,
                                sp_model_bytes)


@pytest.fixture(scope="module")
def hf(phi4: tuple[Path, Path, ModelConfig]) -> torch.nn.Module:
    return transformers.Phi3ForCausalLM.from_pretrained(phi4[0], dtype=torch.float32,
                                                        attn_implementation="eager").eval()


def test_the_folder_and_the_gguf_read_the_same_rotary_part(phi4: tuple[Path, Path, ModelConfig]) -> None:
    """int(16 · 0.75) = 12 values from config.json, rope.dimension_count 12 from the GGUF; LongRoPE's 6 factors a
    set, one per frequency of the 12 turned."""
    _, gguf_path, config = phi4
    assert (config.rope_dim, config.rotary_dim, config.head_dim, config.tie_embeddings) == (ROTARY, ROTARY, HEAD, True)
    other = load_model(str(gguf_path), dry_run=True).config
    assert (other.rope_dim, other.rope_scaling.short_factor, other.rope_scaling.long_factor) == (
        ROTARY, tuple(SHORT), tuple(LONG))


def test_rope_turns_the_first_r_values_as_transformers_and_passes_the_rest() -> None:
    """The stage module against transformers' Phi3 apply_rotary_pos_emb on the same angles: equal, the last D - R
    values of every head untouched, the first R moved (the packed path's in-place rotation too)."""
    from transformers.models.phi3.modeling_phi3 import apply_rotary_pos_emb

    from llmtrace.tracer.model.functional import rotate
    from llmtrace.tracer.model.rope import rope_tables

    config = ModelConfig.from_hf_dict({**_config(), "vocab_size": 100})
    cos, sin = rope_tables(config, 10, torch.float32, "cpu")
    assert cos.shape == (10, 1, ROTARY)
    rope = RotaryEmbedding(HEAD, ROTARY)
    rope.set_tables(cos, sin)
    generator = torch.Generator().manual_seed(3)
    q, k = torch.randn(2, 10, 4, HEAD, generator=generator), torch.randn(2, 10, 2, HEAD, generator=generator)
    positions = torch.arange(10)
    ours_q, ours_k = rope(q, k, positions)
    plain_sin = torch.cat([-sin[..., :ROTARY // 2], sin[..., ROTARY // 2:]], dim=-1)  # transformers' unsigned sin
    theirs_q, theirs_k = apply_rotary_pos_emb(q.transpose(1, 2), k.transpose(1, 2), cos.view(1, 10, ROTARY),
                                              plain_sin.view(1, 10, ROTARY))
    assert torch.allclose(ours_q, theirs_q.transpose(1, 2), atol=1e-6)
    assert torch.allclose(ours_k, theirs_k.transpose(1, 2), atol=1e-6)
    assert torch.equal(ours_q[..., ROTARY:], q[..., ROTARY:]) and not torch.allclose(ours_q[..., 1:, :, :ROTARY],
                                                                                     q[..., 1:, :, :ROTARY])
    in_place = q.clone()
    assert rotate(in_place, cos[positions], sin[positions], out=in_place) is in_place
    assert torch.equal(in_place, ours_q)


@torch.no_grad()
def test_cache_free_logits_equal_phi3_for_causal_lm(phi4: tuple[Path, Path, ModelConfig],
                                                    hf: torch.nn.Module) -> None:
    """Within the original context and past it, from the folder and the GGUF (dequantized); and the same weights
    turning whole heads give other logits (the partial rotary is what the parity holds)."""
    folder, gguf_path, config = phi4
    for length in (6, 13):
        ids = torch.randint(3, config.vocab_size, (2, length), generator=torch.Generator().manual_seed(4))
        expected = hf(input_ids=ids).logits
        assert expected.abs().max() > 1.0
        for path, weights in ((folder, None), (gguf_path, "dense")):
            model = load_model(str(path), dtype=FP32, use_cache=False, weights=weights).model
            assert (model(ids) - expected).abs().max().item() <= 1e-4, (path, length)
    whole = transformers.Phi3ForCausalLM(transformers.Phi3Config(**{
        **hf.config.to_dict(), "partial_rotary_factor": 1.0,
        "rope_scaling": {"type": "longrope", "short_factor": SHORT + [1.0] * 2, "long_factor": LONG + [1.0] * 2}}))
    whole.load_state_dict(hf.state_dict())
    assert (whole.eval()(input_ids=ids).logits - expected).abs().max().item() > 1e-2


@torch.no_grad()
def test_transformers_gguf_reading_gives_llmtraces_logits(phi4: tuple[Path, Path, ModelConfig],
                                                          hf: torch.nn.Module) -> None:
    """The GGUF through transformers' GGUF loading and through llmtrace's reader (R from rope.dimension_count). The
    folder's config is passed: transformers' phi3 GGUF mapping drops rope.dimension_count and LongRoPE."""
    _, gguf_path, config = phi4
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
# the exact native kernel on the C step (fused and staged: the plan's `rotary` switch)
CASES = [("modules", "hf"), ("packed", "hf"), ("staged", "hf"), ("modules", "gguf-dense"), ("packed", "gguf-stored"),
         ("native", "gguf-stored"), ("native-staged", "gguf-stored")]


@pytest.mark.parametrize(("prompt", "steps"), [(9, 8), (3, 5)])  # past the original context; within it
@pytest.mark.parametrize(("backend", "source"), CASES)
@torch.no_grad()
def test_greedy_ids_and_logits_equal_hf(backend: str, source: str, prompt: int, steps: int,
                                        phi4: tuple[Path, Path, ModelConfig], hf: torch.nn.Module) -> None:
    folder, gguf_path, config = phi4
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
    run = backend_for(model, request)
    c_steps = parity.count_c_steps(run, backend) if backend.startswith("native") else None
    got_ids, logits = parity.greedy_run(run, ids, steps)
    assert got_ids == expected_ids and len(set(got_ids)) > 1
    assert (logits - expected_logits).abs().max().item() <= 1e-4
    if c_steps is not None:
        assert len(c_steps) == steps - 1  # every decode step ran in C, none fell back to torch


@pytest.mark.parametrize("mechanism", ["wrap", "fused"])
def test_ropes_flops_count_the_values_turned(mechanism: str, phi4: tuple[Path, Path, ModelConfig]) -> None:
    """Each RoPE record (the stage modules', the packed path's marks) carries 3 FLOPs per value turned, 3·T·(H+Hkv)·R
    by hand (FlopCounterMode counts no elementwise op), and reads the tables' R-wide rows; every stage of a step the
    estimate's, whose formula names R. 9 prompt tokens, then one a step."""
    from llmtrace.tracer.analytic import estimate

    folder, _, config = phi4
    model = load_model(str(folder), dtype=FP32, use_cache=False).model
    records, _ = traced(model, config, mechanism)  # test_gemma3's: a prompt of PROMPT tokens, STEPS steps in all
    prompt, steps = TRACED_PROMPT, TRACED_STEPS
    rope = [r for r in records if r.short_name == "attention.rope"]
    assert len(rope) == steps * config.n_layers
    for record in rope:
        tokens = prompt if record.step == 0 else 1
        assert record.flops == 3 * tokens * (4 + 2) * ROTARY  # not 3·T·6·16
    assert_traced_equals_estimate(config, records, prompt, steps - 1)
    row = next(c for c in estimate.decode_step(config, 9, estimate.Dtypes.for_weights(FP32)).components
               if c.name == "attention.rope")
    assert (row.formula, row.flops, row.total_flops) == ("3·BT·(H+Hkv)·R = 3·1·(4+2)·12", 3 * 6 * ROTARY,
                                                        2 * 3 * 6 * ROTARY)


def test_the_phi4_mini_preset_is_as_published_and_runs_dry() -> None:
    """microsoft/Phi-4-mini-instruct's config.json: d 3072, 32 layers of 24 heads over 8 KV heads (head 128), FFN
    8192, vocabulary 200,064 tied, RoPE on 96 of each head's 128 values. By hand: a layer is Q and O 3072² each, K
    and V 3072·1024 each (25,165,824), SwiGLU 3·3072·8192 (75,497,472) and two norms (6,144): 100,669,440; × 32, +
    the final norm 3,072, + the tied table 200,064·3072 = 614,596,608: 3,836,021,760 (the card's 3.8B). A decode
    step's RoPE: 3·(24+8)·96 = 9,216 FLOPs a layer, not 3·32·128."""
    from llmtrace.tracer.analytic.params import count_params
    from llmtrace.tracer.core.presets import PRESETS

    config = PRESETS["phi4-mini"]
    params = count_params(config)
    assert (params.attention_per_layer, params.ffn_per_layer, params.norms_per_layer) == (25_165_824, 75_497_472,
                                                                                            6_144)
    assert params.total == 32 * 100_669_440 + 3_072 + 200_064 * 3072 == 3_836_021_760
    assert (config.head_dim, config.rotary_dim, config.tie_embeddings) == (128, 96, True)
    flops = json.loads(CliRunner().invoke(app, ["flops", "--model", "phi4-mini", "--json"]).stdout)
    rope = next(c for c in flops["decode"]["components"] if c["name"] == "attention.rope")
    assert (rope["flops"], rope["total_flops"], rope["formula"]) == (9_216, 32 * 9_216,
                                                                     "3·BT·(H+Hkv)·R = 3·1·(24+8)·96")
    kvmem = json.loads(CliRunner().invoke(app, ["kvmem", "--model", "phi4-mini", "--json"]).stdout)
    # fp32, its 131,072 positions: RoPE's part of a head changes no cached byte (K is cached whole, turned or not)
    assert kvmem["size"]["total_bytes"] == 2 * 32 * 8 * 128 * 4 * 131_072
    models = CliRunner().invoke(app, ["models"])
    assert "Partial rotary (RoPE turns the first values of each head, the rest pass through): phi4-mini 96 of " \
           "128." in " ".join(models.stdout.split())
    result = CliRunner().invoke(app, ["run", "The sky", "--model", "phi4-mini", "--dry-run", "--max-new-tokens",
                                      "2", "--detail", "summary"])
    assert result.exit_code == 0, result.output
    assert "the first 96 of each head's 128 values = 48 pairs (the other 32 pass through unturned)" in \
        " ".join(result.stdout.replace("│", " ").split())


@pytest.mark.parametrize(("extra", "message"), [
    ({"partial_rotary_factor": 0.5625}, "partial_rotary_factor 0.5625 of a head of 16 turns 9 values; RoPE turns them "
                                        "in pairs, so it must be a positive even number"),
    ({"partial_rotary_factor": 1.5}, "'partial_rotary_factor' must be above 0 and at most 1, got 1.5"),
    ({"partial_rotary_factor": 0.75, "rope_scaling": {"type": "longrope", "short_factor": [1.0] * 8,
                                                      "long_factor": [1.0] * 8}},
     "LongRoPE has 8 factors, one per frequency of the 12 values RoPE turns in a head \\(6\\) needed"),
])
def test_partial_rotary_that_does_not_fit_is_one_line(extra: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        ModelConfig.from_hf_dict({**_config_dict(100), **extra})


def test_a_whole_factor_is_whole_heads() -> None:
    assert ModelConfig.from_hf_dict({**_config_dict(100), "partial_rotary_factor": 1.0}).rope_dim is None


def test_a_llama_gguf_turning_part_of_a_head_is_one_line() -> None:
    """llama.cpp's 'llama' RoPE pairs adjacent values (the converter permutes Q/K rows for it); llmtrace reads such
    files for whole heads only. A 'phi3' file's count past its head is corrupt."""
    meta = {"general.architecture": "llama", "llama.block_count": 2, "llama.attention.head_count": 4,
            "llama.embedding_length": 64, "llama.vocab_size": 100, "llama.feed_forward_length": 96,
            "llama.rope.dimension_count": 12}
    with pytest.raises(UnsupportedModelError, match="RoPE on 12 of each head's 16 values \\(llama.rope.dimension_"
                                                    "count\\) is not modelled for 'llama'"):
        ModelConfig.from_gguf_metadata(meta, "m", "m.gguf")
    phi3 = {k.replace("llama.", "phi3."): v for k, v in meta.items()} | {
        "general.architecture": "phi3", "phi3.rope.dimension_count": 18}
    with pytest.raises(ConfigError, match="phi3.rope.dimension_count is 18; RoPE turns a positive even number of "
                                          "each head's 16 values"):
        ModelConfig.from_gguf_metadata(phi3, "m", "m.gguf")


def test_a_runs_trace_holds_r_and_reads_back_equal(phi4: tuple[Path, Path, ModelConfig]) -> None:
    """The saved trace's config carries rope_dim (schema-valid), reads back equal, and its RoPE record's slowest pair
    is the R-wide tables' (θ^(-10/12) under the long factors' last, 9 positions past an original context of 8)."""
    import jsonschema

    from llmtrace.tracer.run.generate import generate
    from llmtrace.tracer.trace.records import RunSettings
    from llmtrace.tracer.trace.run_trace import Trace, load_schema

    _, gguf_path, _ = phi4
    settings = RunSettings(model=str(gguf_path), prompt="The sky", max_new_tokens=8, temperatures=())
    trace = generate(load_model(str(gguf_path)), settings)
    data = json.loads(trace.to_json())
    jsonschema.validate(data, load_schema())
    assert data["config"]["rope_dim"] == ROTARY
    assert trace.rope.inv_freq_last == pytest.approx(1 / (LONG[-1] * 10000.0 ** (10 / 12)), rel=1e-6)
    assert Trace.from_json(trace.to_json()) == trace


@pytest.mark.parametrize("backend", [MODULES, PACKED])
@torch.no_grad()
def test_a_left_padded_batch_gives_each_rows_own_logits(backend: str, phi4: tuple[Path, Path, ModelConfig]) -> None:
    """Each row turns by its own positions (the tables' rows gathered per row, R wide): prompts of 9 and 5 tokens in
    one batch, the shorter left-padded, give every step the logits of each row run alone."""
    folder, _, config = phi4
    model = load_model(str(folder), dtype=FP32, use_cache=False).model
    gaps = parity.left_padded_gaps(model, parity.prompt_ids(config.vocab_size, 9)[0], 4, backend)
    assert max(gaps) <= 1e-4, gaps
