"""Backends are built per run from the model as it stands (tracer/run/select.py, tracer/run/backends.py): every way of
editing the model before a run (a weight replaced or edited in place, a layer replaced, a `.to()`, a reload) is seen
by the next run's backend, whose logits are then the stage modules' (the reference) on the edited model; an observer
(a hook or a forward wrapper) sends the run to the stage modules, and once it is gone the next run is packed again."""

from __future__ import annotations

from dataclasses import replace
from typing import Callable

import pytest
import torch
from torch import nn

from llmtrace.tracer.core.config import ModelConfig
from llmtrace.tracer.core.errors import BadArgumentError
from llmtrace.tracer.model.transformer import Transformer, TransformerBlock, build_random_model
from llmtrace.tracer.run.backends import ModulesBackend, PackedBackend, backend_for
from llmtrace.tracer.run.select import Request, select
from llmtrace.tracer.trace.records import MODULES, PACKED

CONFIG = ModelConfig("tiny", 96, 64, 2, 4, 2, 96, max_seq_len=32)


def replace_norm_weight(model: Transformer) -> None:
    norm = model.layers[0].ffn_norm
    norm.weight = nn.Parameter(norm.weight.detach().clone() * 1.5)


def replace_kv_buffer(model: Transformer) -> None:
    cache = model.layers[1].attention.kv_cache
    cache.kv = cache.kv.clone()


def replace_layer(model: Transformer) -> None:
    model.layers[1] = TransformerBlock(CONFIG)


def to_double_and_back(model: Transformer) -> None:
    model.to(torch.float64)
    model.to(torch.float32)  # new tensors, none of them the packed views the last run's plan read: packed again


def in_place_norm_edit(model: Transformer) -> None:
    with torch.no_grad():
        model.layers[0].ffn_norm.weight.mul_(2.0)


def in_place_packed_edit(model: Transformer) -> None:
    with torch.no_grad():
        model.layers[1].attention.wv.weight.add_(1.0)  # a view of the packed Q|K|V


def load_state_dict_assign(model: Transformer) -> None:
    state = {name: tensor.clone() * 1.1 for name, tensor in model.state_dict().items()}
    model.load_state_dict(state, strict=True, assign=True)


EDITS: dict[str, Callable[[Transformer], None]] = {
    "parameter replaced": replace_norm_weight,
    "buffer replaced": replace_kv_buffer,
    "layer replaced": replace_layer,
    "model.to(float64) and back": to_double_and_back,
    "in-place edit of a norm": in_place_norm_edit,
    "in-place edit of a packed matrix": in_place_packed_edit,
    "load_state_dict(assign=True)": load_state_dict_assign,
}


def wrap_forward(model: Transformer) -> Callable[[], None]:
    rope = model.layers[0].attention.rope
    rope.forward = lambda *args, **kwargs: type(rope).forward(rope, *args, **kwargs)
    return lambda: delattr(rope, "forward")


def wrap_module_list_forward(model: Transformer) -> Callable[[], None]:
    model.layers.forward = lambda *args: None
    return lambda: delattr(model.layers, "forward")


def forward_hook(model: Transformer) -> Callable[[], None]:
    return model.layers[1].feed_forward.act.register_forward_hook(lambda *args: None).remove


def global_hook(model: Transformer) -> Callable[[], None]:
    return nn.modules.module.register_module_forward_pre_hook(lambda *args: None).remove


OBSERVERS = {"forward wrapper": (wrap_forward, "forward wrappers that take no C stamps watch the stage modules"),
             "ModuleList forward wrapper": (wrap_module_list_forward,
                                            "forward wrappers that take no C stamps watch the stage modules"),
             "forward hook": (forward_hook, "forward hooks watch the stage modules (--lens, --attention or "
                                            "FlopCounterMode)"),
             "global forward pre-hook": (global_hook, "forward hooks watch the stage modules (--lens, --attention or "
                                                      "FlopCounterMode)")}


def packed_and_reference(model: Transformer, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The prefill's logits on the backend a run takes now, and on the stage modules (the reference)."""
    model.setup_cache(1, 16)
    backend = backend_for(model)
    assert isinstance(backend, PackedBackend)
    packed = backend.prefill(ids)
    model.setup_cache(1, 16)
    return packed, model.prefill(ids)


@pytest.mark.parametrize("edit", list(EDITS), ids=list(EDITS))
@torch.no_grad()
def test_a_run_started_after_an_edit_sees_it(edit: str) -> None:
    model = build_random_model(CONFIG, seed=3)
    ids = torch.tensor([[1, 2, 3]])
    before, _ = packed_and_reference(model, ids)
    EDITS[edit](model)
    after, reference = packed_and_reference(model, ids)
    assert torch.allclose(after, reference, atol=1e-5)  # the new backend reads what the model holds
    if edit not in ("buffer replaced", "model.to(float64) and back"):  # the edits that change no value it reads
        assert not torch.allclose(after, before, atol=1e-3)


@pytest.mark.parametrize("observer", list(OBSERVERS), ids=list(OBSERVERS))
@torch.no_grad()
def test_an_observer_sends_the_run_to_the_stage_modules_until_it_is_gone(observer: str) -> None:
    model = build_random_model(CONFIG, seed=3)
    model.setup_cache(1, 16)
    attach, reason = OBSERVERS[observer]
    remove = attach(model)
    try:
        selection = select(model, Request())
        assert (selection.route.prefill, selection.route.decode) == (MODULES, MODULES)
        assert {r.backend: r.reason for r in selection.route.not_taken}[PACKED] == reason
        assert isinstance(backend_for(model), ModulesBackend)
    finally:
        remove()
    assert isinstance(backend_for(model), PackedBackend)


@pytest.mark.parametrize("window", [None, 4])
@pytest.mark.parametrize("backend", [PACKED, MODULES])
@torch.no_grad()
def test_live_kv_bytes_are_every_cache_s_whatever_backend_ran(window: int | None, backend: str) -> None:
    """A backend's kv_live_bytes (the packed plan's: layers x one cache's) is the sum over the caches, after
    prefills and decode steps, batches, kept rows and a failed step (which moves no cache)."""
    model = build_random_model(replace(CONFIG, sliding_window=window), seed=3)
    model.setup_cache(3, 16)
    run = backend_for(model, Request(batch=3, backend=backend))

    def check() -> None:
        caches = model._kv_caches()
        assert run.kv_live_bytes() == model.kv_live_bytes == sum(cache.live_bytes for cache in caches)
        assert len({(c.length, c.batch) for c in caches}) == 1

    check()
    run.prefill(torch.tensor([[1, 2, 3], [4, 5, 6], [7, 8, 9]]))
    check()
    for token in range(6):
        run.decode(torch.tensor([[token]] * 3))
        check()
    model.keep_rows([0, 2])
    check()
    with pytest.raises(BadArgumentError, match="batch size changed"):
        run.decode(torch.tensor([[1]] * 5))  # a batch the cache does not hold
    check()
    model.reset_cache()
    check()


@pytest.mark.parametrize("backend", [PACKED, MODULES])
@torch.no_grad()
def test_step_checks_are_the_same_on_every_backend(backend: str) -> None:
    """Transformer._cached_step's refusals, whether the cache's size comes from the plan's plain values (packed) or
    from the caches themselves (modules); a failed step leaves the position where it was."""
    model = build_random_model(CONFIG, seed=3)
    model.setup_cache(2, 5)
    run = backend_for(model, Request(backend=backend))
    run.prefill(torch.tensor([[1, 2, 3]]))
    with pytest.raises(BadArgumentError, match="batch size changed from 1 to 2 mid-sequence"):
        run.decode(torch.tensor([[4], [5]]))
    with pytest.raises(BadArgumentError, match=r"\(B, 1\)"):
        run.decode(torch.tensor([4]))  # 1-D: refused, not an IndexError
    run.decode(torch.tensor([[4]]))
    run.decode(torch.tensor([[5]]))
    with pytest.raises(BadArgumentError, match="5 cached \\+ 1 new tokens exceed the cache of 5 positions"):
        run.decode(torch.tensor([[6]]))
    assert model.pos == 5 and run.kv_live_bytes() == sum(c.live_bytes for c in model._kv_caches())
    model.layers[0].attention.kv_cache.kv = None  # a dropped buffer: the next run must set the cache up again
    model._caches = None
    with pytest.raises(BadArgumentError, match="KV cache is not set up"):
        model.prefill(torch.tensor([[1, 2, 3]]))
