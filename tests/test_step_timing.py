"""The kernel choice's decode cost of a native-step candidate is whole native C steps (tracer/load/step_timing.py);
every other candidate's is the sum of its products (tracer/hardware/product_timing.py). On a tiny GGUF laid out as
the bundled file is (Q4_1 matrices, a Q8_0 LM head): which candidates are timed whole, that the C step is what runs
while they are, that the figures reach the choice unchanged, and that a model without the C step keeps its products.
No timed assertions: only which path measured what."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from tiny_gguf import write_tiny_gguf

from llmtrace.tracer.checkpoint.resolve import ResolvedModel, resolve_model
from llmtrace.tracer.core.config import ModelConfig
from llmtrace.tracer.hardware import kernel_choice as rule, product_timing
from llmtrace.tracer.load import kernel_pick, step_timing
from llmtrace.tracer.load.step_timing import MIN_ROUND_STEPS, ROUND_STEPS, ROUNDS, low_quantile
from llmtrace.tracer.model import native_kernel
from llmtrace.tracer.model.native_step import NativeStep
from llmtrace.tracer.model.transformer import random_weights

Q = gguf.GGMLQuantizationType
CONFIG = ModelConfig(name="tiny-steps", vocab_size=96, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=96,
                     max_seq_len=64)
PLAN = "Q4_1:i8dot,Q8_0:native"
PLAN16 = "Q4_1:i8dot,Q8_0:i16dot"
NAMES = ["int4pack", "blocks", "native", "i8dot", PLAN, PLAN16, "Q4_1:int4pack,Q8_0:blocks"]
STEPPED = {"native", "i8dot", PLAN, PLAN16}  # every kernel the native library's: the model's step is one C call


@pytest.fixture(autouse=True)
def native() -> None:
    if not native_kernel.available():
        pytest.skip(f"native kernel not available here: {native_kernel.unavailable_reason()}")


@pytest.fixture(scope="module")
def mixed(tmp_path_factory: pytest.TempPathFactory) -> ResolvedModel:
    """Q4_1 matrices and a Q8_0 LM head, untied (the bundled file's types)."""
    state = random_weights(CONFIG, torch.float32, seed=0)
    head = gguf.quants.quantize(state["output.weight"].numpy().astype(np.float32), Q.Q8_0)
    path = tmp_path_factory.mktemp("steps") / "tiny.gguf"
    write_tiny_gguf(path, CONFIG, state, None, matrix_type=Q.Q4_1, raw_blocks={"output.weight": (head, Q.Q8_0)})
    return resolve_model(str(path))


def test_only_native_step_candidates_are_timed_whole_and_the_c_step_runs(mixed: ResolvedModel,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """int4pack, blocks and a plan with them are left out; the others' models run the C step, at the first
    positions of an empty cache, alternated in rounds, every timed step one C call."""
    calls: list[tuple[NativeStep, int]] = []  # (the model's step, held so no other takes its id; position)
    real = NativeStep.__call__

    def spy(self: NativeStep, token: int, position: int, *args, **kwargs) -> torch.Tensor:  # noqa: ANN002, ANN003
        calls.append((self, position))
        return real(self, token, position, *args, **kwargs)

    monkeypatch.setattr(NativeStep, "__call__", spy)
    steps = step_timing.time_native_steps(mixed.gguf_header, mixed.config, NAMES)
    assert set(steps) == STEPPED
    assert all(0 < seconds < 1 for seconds in steps.values())
    per_round = [sum(1 for _ in group) for group in _runs([model for model, _ in calls])]
    assert len(per_round) == ROUNDS * len(STEPPED)  # the models alternate: one run of calls per model and round
    assert all(1 + MIN_ROUND_STEPS <= n <= 1 + ROUND_STEPS for n in per_round)  # an untimed step, then timed ones
    assert max(position for _, position in calls) <= ROUND_STEPS


def test_models_that_do_not_fit_together_are_timed_one_at_a_time(mixed: ResolvedModel,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Each candidate's model holds its own copy of the file's matrices: where three would take more than their
    share of the memory available, one model at a time (its rounds back to back), the same candidates timed."""
    matrices = sum(t.n_bytes for t in mixed.gguf_header.tensors if len(t.shape) >= 2)
    assert step_timing.fit_together(mixed.gguf_header, 3, available=6 * matrices)
    assert not step_timing.fit_together(mixed.gguf_header, 3, available=6 * matrices - 1)
    models: list[NativeStep] = []  # held: a freed model's id could be another's
    real = NativeStep.__call__
    monkeypatch.setattr(NativeStep, "__call__", lambda self, *a, **k: (models.append(self), real(self, *a, **k))[1])
    monkeypatch.setattr(step_timing, "available_memory_bytes", lambda: 6 * matrices - 1)
    steps = step_timing.time_native_steps(mixed.gguf_header, mixed.config, NAMES)
    assert set(steps) == STEPPED
    assert len(_runs(models)) == len(STEPPED)  # one model's rounds, then the next's


def _runs(items: list[NativeStep]) -> list[list[NativeStep]]:
    """Consecutive calls of one step grouped."""
    groups: list[list[NativeStep]] = []
    for item in items:
        if groups and groups[-1][0] is item:
            groups[-1].append(item)
        else:
            groups.append([item])
    return groups


def test_a_model_without_the_c_step_is_not_timed_whole(mixed: ResolvedModel, monkeypatch: pytest.MonkeyPatch) -> None:
    """Native-library kernels whose model still cannot run the C step (NativeStep.build says why) keep the sum of
    their products: no whole-step figure."""
    monkeypatch.setattr(NativeStep, "build", classmethod(lambda cls, plan: (None, "a test's refusal")))
    assert step_timing.time_native_steps(mixed.gguf_header, mixed.config, NAMES) == {}


def test_pick_uses_whole_steps_for_native_step_candidates_only(mixed: ResolvedModel, tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Through pick with the real timers: the stored candidates (not the dense ones) go to the step timing; the
    whole-step figure is the decode_s of exactly the native-step candidates; the others' come from their products
    (dense candidates timed through mv and mm, stored ones through their kernel)."""
    seen: dict[str, object] = {}

    def whole(header, config, names, progress=None):  # noqa: ANN001, ANN202 - time_native_steps' signature
        seen["names"] = list(names)
        seen["steps"] = step_timing.time_native_steps(header, config, names, progress)
        return seen["steps"]

    monkeypatch.setattr(kernel_pick, "time_native_steps", whole)
    monkeypatch.setattr(kernel_pick, "time_kernels", product_timing.time_kernels)
    heard: list[str] = []
    choice = kernel_pick.pick(mixed, torch.device("cpu"), progress=heard.append,
                              store_path=tmp_path / "kernels.json").choice
    names = {c.name for c in choice.candidates}
    stored = {c.name for c in choice.candidates if c.weights == rule.STORED}
    assert set(seen["names"]) == stored and "fp32" in names and "fp32" not in seen["names"]
    stepped = seen["steps"]
    # the plans when i8dot (and i16dot, for the Q8_0 matrices) pass their probes
    assert {"native", "i8dot"} <= set(stepped) and set(stepped) <= STEPPED | {"Q4_1:native,Q8_0:i16dot"}
    assert set(stepped) == {n for n in stored if step_timing.native_library_plan(n)}
    for c in choice.candidates:
        if c.name in stepped:
            assert c.decode_s == stepped[c.name] and c.decode_kernel == c.name
        else:
            assert c.decode_s not in stepped.values()
    assert any(line.startswith("native decode steps of ") for line in heard)
    assert any(line == "native products" for line in heard)  # its prefill (and head) still timed as products


def test_a_whole_step_figure_replaces_only_the_decode_products(mixed: ResolvedModel) -> None:
    """product_timing with `steps`: the candidate's decode_s is the figure given, its prefill still measured; a
    candidate without one is timed as before."""
    from llmtrace.tracer.load.stored_candidates import StoredKernel

    kernels = [StoredKernel(mixed.gguf_header, mixed.config, "native"), product_timing.DenseKernel("fp32")]
    timings, _ = product_timing.time_kernels(kernels, mixed.config, steps={"native": 0.25})
    by_name = {t.name: t for t in timings}
    assert by_name["native"].decode_s == 0.25 and by_name["native"].prefill_s > 0
    assert by_name["fp32"].decode_s != 0.25 and by_name["fp32"].decode_kernel in ("mv", "mm")


def test_low_quantile() -> None:
    assert low_quantile([5.0, 1.0, 4.0, 2.0, 3.0]) == 1.0  # ceil(0.2 * 5) = 1st fastest
    assert low_quantile([float(i) for i in range(40, 0, -1)]) == 8.0  # the 8th fastest of 40
    assert low_quantile([7.0]) == 7.0
