"""The native decode step (tracer/model/native/decode_step.c, tracer/model/native_step.py) against the torch fused
path it replaces, on the same native weights.

Tolerance. Both paths compute every value in fp32 from the same weights; only the order of each sum differs (the
products' blocks, the norms' squares, the attention dots and the softmax's total). Two orders of one fp32 sum of n
terms differ by at most 2(n-1)u·sum|terms| (Higham's bound, u = 2^-24); here n <= 96, so one product's outputs agree
to ~1.1e-5 of their sum of |terms|. The RMSNorms rescale each layer's input, so that relative error reaches the
logits amplified only by the two layers' gain: we allow 2^-14 (6.1e-5) of the logits' scale (max |logit|, ~5x the
one-sum bound), and the greedy token must not change. Measured differences are ~2e-7 of the scale.
"""

from __future__ import annotations

import dataclasses
import time
from types import SimpleNamespace
from typing import Any

import gguf
import numpy as np
import pytest
import torch

from llmtrace.tracer.core import contract
from llmtrace.tracer.core.config import ModelConfig
from llmtrace.tracer.model import native_kernel
from llmtrace.tracer.model.native_step import host_clock_matches
from llmtrace.tracer.model.transformer import Transformer
from llmtrace.tracer.model.weight_formats import INT4PACK, NATIVE, pack_gguf
from llmtrace.tracer.run.backends import backend_for
from llmtrace.tracer.run.select import Request
from llmtrace.tracer.trace.fused_marks import FusedMarks, fused_stages
from llmtrace.tracer.trace.records import MODULES, PACKED
from tests.stamp_count import STAGES_AFTER_LAYERS, STAGES_PER_LAYER, stamp_count
from tests.tiny_gguf import random_blocks
from tests.torch_threads import torch_threads

Q = gguf.GGMLQuantizationType
QUANTIZABLE = (Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0)
TOLERANCE = 2**-14  # of max |logit|: see the module docstring
BASE = ModelConfig(name="tiny-native", vocab_size=96, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=96,
                   max_seq_len=64)


@pytest.fixture(autouse=True)
def native() -> None:
    if not native_kernel.available():
        pytest.skip(f"native kernel not available here: {native_kernel.unavailable_reason()}")


def native_model(config: ModelConfig, qtype: Q = Q.Q8_0, seed: int = 0, kernel: str = NATIVE,
                 dense_embedding: bool = False, head: tuple[Q, str] | None = None) -> Transformer:
    """A random fp32 model of `config` whose matrices gguf quantized to `qtype`, held for `kernel` (the embedding
    table dense fp32 if `dense_embedding`; the embedding table / LM head quantized to head[0] for head[1] when
    `head` is given: a per-type plan); norm weights and biases random too (not ones and zeros, which would hide a
    skipped one)."""
    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    dense = Transformer(config)
    state = {name: t.detach().clone() for name, t in dense.state_dict().items()}
    packed = {}
    for name, tensor in list(state.items()):
        if name.endswith("norm.weight"):
            state[name] = 1.0 + 0.2 * torch.randn_like(tensor)
        elif name.endswith(".bias"):
            state[name] = 0.1 * torch.randn_like(tensor)
        elif tensor.dim() == 2 and not (dense_embedding and name == "tok_embeddings.weight"):
            its_type, its_kernel = (head if head is not None and name in ("tok_embeddings.weight", "output.weight")
                                    else (qtype, kernel))
            if its_type in QUANTIZABLE:
                raw = gguf.quants.quantize(tensor.numpy().astype(np.float32), its_type)
            else:  # k-quants gguf cannot quantize: random blocks of small, finite scales
                raw = random_blocks(its_type, tensor.shape[0], tensor.shape[1], rng)
            packed[name] = pack_gguf(raw, int(its_type), tensor.shape[1], its_kernel)
            del state[name]
    model = Transformer(config)
    model.load_stored(state, packed)
    return model.eval()


def generate(model: Transformer, native: bool, steps: int = 6, prompt: int = 5,
             backend: str | None = None) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Logits of `steps` greedy decode steps after a `prompt`-token prefill, and the KV cache tensor after them: on
    the native backend, or the packed one (`native` False), or the one `backend` asks for."""
    model.setup_cache(1, prompt + steps + 1)
    run = backend_for(model, Request(backend=backend or (None if native else PACKED)))
    assert backend or (run.plan.native is not None) or not native, run.plan.native_reason
    tokens = torch.arange(3, 3 + prompt).view(1, -1) % model.config.vocab_size
    logits = run.prefill(tokens)
    out = []
    for _ in range(steps):
        logits = run.decode(logits.argmax(-1, keepdim=True))
        out.append(logits.clone())
    return out, model._kv_all.clone()


def assert_same_steps(model: Transformer, steps: int = 6) -> None:
    native_logits, native_kv = generate(model, True, steps)
    torch_logits, torch_kv = generate(model, False, steps)
    for got, want in zip(native_logits, torch_logits):
        assert got.shape == want.shape
        scale = float(want.abs().max())
        assert float((got - want).abs().max()) <= TOLERANCE * scale
        assert int(got.argmax()) == int(want.argmax())
    scale = float(torch_kv.abs().max())
    assert float((native_kv - torch_kv).abs().max()) <= TOLERANCE * scale
    assert bool(native_kv.ne(0).any(dim=-1).any())  # something was written


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("variant", [
    {},  # GQA (4 heads over 2 KV heads), untied
    {"n_kv_heads": 4},  # one KV head per query head
    {"tie_embeddings": True},  # the LM head is the embedding table
    {"qkv_bias": True, "wo_bias": True, "mlp_bias": True},  # every projection adds a bias (Qwen2 has Q, K, V's)
    {"sliding_window": 4},  # a window smaller than the sequence: keys before it are never read
])
def test_native_step_matches_the_torch_fused_path(variant: dict[str, Any], threads: int) -> None:
    with torch_threads(threads):
        assert_same_steps(native_model(dataclasses.replace(BASE, **variant)))


def test_native_step_with_a_dense_embedding_table() -> None:
    model = native_model(BASE, dense_embedding=True)
    assert model.tok_embeddings.packed is None
    assert_same_steps(model)


@pytest.mark.parametrize("qtype", [Q.Q4_1, Q.Q5_0, Q.Q4_K, Q.Q6_K])
def test_native_step_on_other_block_types(qtype: Q) -> None:
    config = dataclasses.replace(BASE, dim=256, ffn_dim=256, n_heads=4, n_kv_heads=1)  # k-quants: K % 256 == 0
    assert_same_steps(native_model(config, qtype), steps=4)


LONG = dataclasses.replace(BASE, max_seq_len=256)  # caches past the attention's 64-position chunks (decode_step.c)


def generate_threads(model: Transformer, threads: int, steps: int,
                     prompt: int) -> tuple[list[torch.Tensor], torch.Tensor]:
    """`generate` natively on `threads` threads."""
    with torch_threads(threads):
        return generate(model, True, steps, prompt)


@pytest.mark.parametrize("variant", [
    {"dim": 256, "n_heads": 4, "n_kv_heads": 2},  # D = 64: whole 32-lane pieces of the value rows
    {"n_heads": 6, "n_kv_heads": 2, "explicit_head_dim": 16},  # GQA repeat 3 (the bundled SmolLM2's)
    {"n_heads": 8, "n_kv_heads": 2, "explicit_head_dim": 12},  # D = 12: each row's last 8 lanes masked
    {"n_heads": 8, "n_kv_heads": 1},  # repeat 8: the query heads of one KV head in two groups of 4
    {"dim": 256, "n_heads": 4, "n_kv_heads": 2, "sliding_window": 100},  # first > 0: 100 keys, two chunks
])
def test_long_cache_attention(variant: dict[str, Any]) -> None:
    """Past 64 cached positions the values' sums run in pieces that two threads share, and scores by position
    ranges: the logits stay within the torch path's tolerance, and 1 thread's step is 2 threads' bit for bit."""
    model = native_model(dataclasses.replace(LONG, **variant))
    native_logits, native_kv = generate_threads(model, 2, steps=3, prompt=150)
    torch_logits, torch_kv = generate(model, False, steps=3, prompt=150)
    for got, want in zip(native_logits, torch_logits):
        assert float((got - want).abs().max()) <= TOLERANCE * float(want.abs().max())
        assert int(got.argmax()) == int(want.argmax())
    assert float((native_kv - torch_kv).abs().max()) <= TOLERANCE * float(torch_kv.abs().max())
    one_logits, one_kv = generate_threads(model, 1, steps=3, prompt=150)
    assert all(torch.equal(a, b) for a, b in zip(one_logits, native_logits)) and torch.equal(one_kv, native_kv)


def test_long_cache_attention_reads_every_key() -> None:
    """At 150 cached positions every key counts (none skipped at a chunk or thread boundary): poisoning any one of
    keys 63, 64, 75 (the two threads' boundary) or 149 changes the step."""
    model = native_model(dataclasses.replace(LONG, dim=256, n_heads=4, n_kv_heads=2))
    model.setup_cache(1, 160)
    run = backend_for(model)
    logits = run.prefill(torch.arange(150).view(1, -1) % 96)  # positions 0..149; the next token is at 150
    token = logits.argmax(-1, keepdim=True)
    state = model._kv_all.clone()
    clean = run.decode(token)
    for row in (0, 63, 64, 75, 149, 150):
        for half in (0, 2):  # a K head, then a V head (the cache holds K heads then V heads)
            model._kv_all.copy_(state)
            model._kv_all[:, 0, half, row] = 1e3 if row < 150 else 0.0  # row 150: rewritten by the step, no change
            model.fill.length = 150
            changed = bool((run.decode(token) - clean).abs().max() > 1e-3)
            assert changed == (row < 150), (row, half)


def test_window_keys_outside_it_are_not_read() -> None:
    """Under a sliding window the step reads only the window's keys: poisoning an older cache row changes
    nothing, while poisoning one inside the window does."""
    model = native_model(dataclasses.replace(BASE, sliding_window=3))
    model.setup_cache(1, 12)
    run = backend_for(model)
    logits = run.prefill(torch.arange(3, 11).view(1, -1))  # positions 0..7; the next token is at 8
    token = logits.argmax(-1, keepdim=True)
    state = model._kv_all.clone()
    clean = run.decode(token)
    for row, changes in ((5, False), (6, True)):  # window 3 at position 8: keys 6, 7, 8
        model._kv_all.copy_(state)
        model._kv_all[:, 0, :, row] = 1e6
        model.fill.length = 8
        assert run.plan.native is not None
        assert bool((run.decode(token) - clean).abs().max() > 1) == changes


def test_not_eligible_runs_the_torch_path() -> None:
    """A dense model (or one whose products are not all native) keeps the torch fused path, and says why."""
    dense = Transformer(BASE).eval()
    dense.setup_cache(1, 8)
    plan = backend_for(dense).plan
    assert plan.native is None and "native" in plan.native_reason
    model = native_model(BASE, kernel=INT4PACK)  # what --weights int4pack loads
    model.setup_cache(1, 8)
    run = backend_for(model)
    assert run.plan.native is None and "not held for the native library's kernels" in run.plan.native_reason
    logits = run.prefill(torch.arange(3, 8).view(1, -1))
    assert run.decode(logits.argmax(-1, keepdim=True)).shape == (1, BASE.vocab_size)


def test_a_run_after_an_in_place_edit_reads_it() -> None:
    """An in-place edit of a norm weight is read by the next run's native step (its plan is built as the run
    starts): its logits are the stage modules' on the edited model, within the native step's tolerance."""
    model = native_model(BASE)
    before, _ = generate(model, True, steps=2)
    with torch.no_grad():
        model.layers[0].ffn_norm.weight.mul_(2.0)
    native, _ = generate(model, True, steps=2)
    reference, _ = generate(model, True, steps=2, backend=MODULES)
    for got, want, old in zip(native, reference, before):
        assert float((got - want).abs().max()) <= TOLERANCE * float(want.abs().max())
        assert float((got - old).abs().max()) > 1e-3


def test_traced_step_stamps_every_stage() -> None:
    """A traced native step leaves exactly the expected readings, non-decreasing, so stage times add up to the step
    (the first reading is the step's start, the last its end)."""
    model = native_model(BASE)
    stages = fused_stages(model)
    marks = FusedMarks(model, len(stages))
    assert len(stages) == 1 + STAGES_PER_LAYER * BASE.n_layers + STAGES_AFTER_LAYERS  # the embedding, then C's
    assert STAGES_PER_LAYER == sum(spec.in_layer for spec in contract.fused_stages(BASE))
    model.setup_cache(1, 12)
    run = backend_for(model)
    logits = run.prefill(torch.arange(3, 8).view(1, -1))
    run = run.traced(marks)  # its mark: a clock reading that takes C's readings
    for _ in range(3):
        marks.begin_step()
        logits = run.decode(logits.argmax(-1, keepdim=True))
        readings, dims = marks.end_step()
        assert len(readings) == marks.expected
        assert readings == sorted(readings)
        times = [b - a for a, b in zip(readings, readings[1:])]
        assert sum(times) == readings[-1] - readings[0] and len(times) == len(stages)
        assert dims.new == 1 and dims.batch == 1


def test_traced_without_stamp_taker_runs_the_torch_path() -> None:
    """A mark that cannot take C's readings gets its mark() calls: the one-token step then runs its torch ops."""
    model = native_model(BASE)
    model.setup_cache(1, 8)
    run = backend_for(model)
    logits = run.prefill(torch.arange(3, 8).view(1, -1))
    calls = []
    run.traced(SimpleNamespace(mark=lambda: calls.append(1))).decode(logits.argmax(-1, keepdim=True))
    assert len(calls) == 2 + STAGES_PER_LAYER * BASE.n_layers + STAGES_AFTER_LAYERS


def test_bundled_model_greedy_ids_match_the_torch_path() -> None:
    """The bundled SmolLM2 Q4_1 file with the native kernel: 16 greedy tokens, the same ids either way."""
    from llmtrace.tracer.load.loader import load_model

    loaded = load_model(None, weights=NATIVE)
    model = loaded.model
    ids = torch.tensor([list(loaded.tokenizer.encode("The capital of France is"))])
    runs = []
    for native in (True, False):
        model.setup_cache(1, ids.shape[1] + 17)
        run = backend_for(model, Request(backend=None if native else PACKED))
        assert run.plan.native is not None, run.plan.native_reason
        logits = run.prefill(ids)
        out = []
        for _ in range(16):
            token = logits.argmax(-1, keepdim=True)
            out.append(int(token))
            logits = run.decode(token)
        runs.append(out)
    assert runs[0] == runs[1]


def test_decode_ceilings_time_the_native_step_whole() -> None:
    """At batch 1 the native step runs its products in C, where the ceilings' stand-ins cannot reach: the rest is the
    real step minus the products' pass, and the operations counted are the few the step dispatches."""
    from llmtrace.tracer.run.decode_measure import measure_decode_ceilings

    model = native_model(BASE)
    loaded = type("Loaded", (), {"model": model, "config": BASE})()
    ceilings = measure_decode_ceilings(loaded, [3, 4, 5, 6], (1, 2), 20e9, steps=2, repeats=1)
    one, two = ceilings.batches
    assert one.other_seconds >= 0 and one.context == 6
    assert one.ops < 20 < two.ops  # the native step's few ops (embedding row, logits) against the torch path's


def test_token_outside_the_table_is_refused_before_any_write() -> None:
    model = native_model(BASE)
    model.setup_cache(1, 8)
    run = backend_for(model)
    run.prefill(torch.arange(3, 8).view(1, -1))
    before = model._kv_all.clone()
    with pytest.raises(native_kernel.NativeKernelError, match="token id outside the embedding table"):
        run.decode(torch.tensor([[BASE.vocab_size]]))
    assert model.pos == 5 and torch.equal(model._kv_all, before)


def test_a_failed_step_leaves_no_readings() -> None:
    """A traced step that fails leaves no readings: not the last step's, which a reader would take for its own."""
    model = native_model(BASE)
    model.setup_cache(1, 8)
    run = backend_for(model)
    run.prefill(torch.arange(3, 8).view(1, -1))
    step = run.plan.native
    # C's count of a traced step's readings (NativeStep sizes its buffer by it) against the stages counted apart
    assert (step.stamp_count, step.staged_stamp_count) == tuple(stamp_count(BASE.n_layers, staged)
                                                                for staged in (False, True))
    before = time.perf_counter_ns()
    step(4, 5, stamps=True)
    readings = step.readings()
    assert len(readings) == step.stamp_count and readings == step._stamps[: step.stamp_count].tolist()
    assert readings == sorted(readings)
    if host_clock_matches():  # the C stamps read perf_counter_ns's clock
        assert before <= readings[0] and readings[-1] <= time.perf_counter_ns()
    with pytest.raises(native_kernel.NativeKernelError, match="token id outside the embedding table"):
        step(BASE.vocab_size, 6, stamps=True)
    assert step.readings() == []
    step(4, 6, stamps=True, staged=True)
    assert len(step.readings()) == step.staged_stamp_count
    step(4, 7)  # untraced: no readings either
    assert step.readings() == []
