"""The fused plan's validity before every step (Transformer.fusable): kept in O(1) of the model's size by the model's
edit counter (tracer/model/edit_watch.py), yet voided by every way the plan can go stale, and the fast answer is
always the full look's (FusedPlan.valid, plus the hook and wrapper checks)."""

from __future__ import annotations

import copy
from typing import Callable

import pytest
import torch
from torch import nn

from llmtrace.tracer.core.config import ModelConfig
from llmtrace.tracer.core.errors import BadArgumentError
from llmtrace.tracer.model.edit_watch import CountingDict
from llmtrace.tracer.model.transformer import Transformer, TransformerBlock, build_random_model

CONFIG = ModelConfig("tiny", 96, 64, 2, 4, 2, 96, max_seq_len=32)


def planned() -> Transformer:
    model = build_random_model(CONFIG, seed=3)
    model.setup_cache(1, 16)
    return model


def full_look(model: Transformer) -> bool:
    """What `fusable()` answers with nothing kept from earlier calls."""
    model._hook_free_stamp = -1
    return model.fusable()


def replace_norm_weight(model: Transformer) -> None:
    norm = model.layers[0].ffn_norm
    norm.weight = nn.Parameter(norm.weight.detach().clone())


def replace_kv_buffer(model: Transformer) -> None:
    cache = model.layers[1].attention.kv_cache
    cache.kv = cache.kv.clone()


def replace_layer(model: Transformer) -> None:
    model.layers[1] = TransformerBlock(CONFIG)


def to_double(model: Transformer) -> None:
    model.to(torch.float64)  # nn.Module._apply writes the dicts directly


def to_half_through_one_layer(model: Transformer) -> None:
    model.layers[0].half()


def in_place_norm_edit(model: Transformer) -> None:
    with torch.no_grad():
        model.layers[0].ffn_norm.weight.mul_(2.0)


def in_place_final_norm_edit(model: Transformer) -> None:
    with torch.no_grad():
        model.norm.weight.add_(1.0)  # the last of the norm weights the plan packs into one vector


def in_place_packed_edit(model: Transformer) -> None:
    with torch.no_grad():
        model.layers[1].attention.wv.weight.add_(1.0)  # a view of the packed Q|K|V: its version is the pack's


def load_state_dict_assign(model: Transformer) -> None:
    state = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    model.load_state_dict(state, strict=True, assign=True)


def rope_tables_replaced(model: Transformer) -> None:
    model._rope_cos = model._rope_cos.clone()


def register_parameter(model: Transformer) -> None:
    model.layers[0].attention_norm.register_parameter("extra", nn.Parameter(torch.ones(1)))


def wrap_forward(model: Transformer) -> None:
    rope = model.layers[0].attention.rope
    rope.forward = lambda *args, **kwargs: type(rope).forward(rope, *args, **kwargs)


def wrap_module_list_forward(model: Transformer) -> None:
    model.layers.forward = lambda *args: None  # nn.ModuleList does not count its own wrappers: looked at directly


def forward_hook(model: Transformer) -> None:
    model.layers[1].feed_forward.act.register_forward_hook(lambda *args: None)


def global_hook(model: Transformer) -> None:
    model.__dict__["_test_handle"] = nn.modules.module.register_module_forward_pre_hook(lambda *args: None)


STALE: dict[str, Callable[[Transformer], None]] = {
    "parameter replaced": replace_norm_weight,
    "buffer replaced": replace_kv_buffer,
    "layer replaced": replace_layer,
    "model.to(float64)": to_double,
    "one layer .half()": to_half_through_one_layer,
    "in-place edit of a norm": in_place_norm_edit,
    "in-place edit of the final norm": in_place_final_norm_edit,
    "in-place edit of a packed matrix": in_place_packed_edit,
    "load_state_dict(assign=True)": load_state_dict_assign,
    "rope tables replaced": rope_tables_replaced,
}
WATCHED: dict[str, Callable[[Transformer], None]] = {
    "forward wrapper": wrap_forward,
    "ModuleList forward wrapper": wrap_module_list_forward,
    "forward hook": forward_hook,
    "global forward pre-hook": global_hook,
}


@pytest.mark.parametrize("edit", list(STALE), ids=list(STALE))
@torch.no_grad()
def test_every_way_the_plan_goes_stale_voids_it_until_setup_cache(edit: str) -> None:
    model = planned()
    assert model.fusable() and model.fusable()  # the second answer is the kept one
    STALE[edit](model)
    assert not model.fusable()
    assert not full_look(model)
    assert not model.fusable()
    if edit in ("model.to(float64)", "one layer .half()"):
        model.to(torch.float32)
    model.setup_cache(1, 16)
    assert model.fusable() and model.fusable()
    ids = torch.tensor([[1, 2, 3]])
    fused = model.prefill(ids)
    model.use_fused = False
    model.setup_cache(1, 16)
    assert torch.allclose(fused, model.prefill(ids), atol=1e-5)  # the new plan reads what the model holds


@pytest.mark.parametrize("edit", list(WATCHED), ids=list(WATCHED))
@torch.no_grad()
def test_an_observer_sends_steps_stage_by_stage_until_it_is_gone(edit: str) -> None:
    model = planned()
    assert model.fusable() and model.fusable()
    WATCHED[edit](model)
    assert not model.fusable() and not model.fusable()
    model.setup_cache(1, 16)  # a new plan does not forget an observer set before it
    assert not model.fusable()
    # gone again: the plan is still good
    if edit == "forward wrapper":
        del model.layers[0].attention.rope.forward
    elif edit == "ModuleList forward wrapper":
        del model.layers.forward
    elif edit == "forward hook":
        model.layers[1].feed_forward.act._forward_hooks.clear()
    else:
        model.__dict__.pop("_test_handle").remove()
    assert model.fusable() and model.fusable()


@torch.no_grad()
def test_a_wrapper_set_before_the_plan_is_seen() -> None:
    model = build_random_model(CONFIG, seed=3)
    rope = model.layers[1].attention.rope
    rope.forward = lambda *args, **kwargs: type(rope).forward(rope, *args, **kwargs)
    model.setup_cache(1, 16)
    assert not model.fusable()


@torch.no_grad()
def test_a_wrapper_set_before_the_plan_is_seen_after_a_look_that_lets_wrappers_be() -> None:
    """The native staged step's look (`_watcher` with wrappers that take C stamps, the "wrap" tracer's) keeps the
    hook-free stamp `fusable()` shares; its fast answer must still wait for a full look of its own."""
    model = build_random_model(CONFIG, seed=3)
    rope = model.layers[1].attention.rope
    rope.forward = lambda *args, **kwargs: type(rope).forward(rope, *args, **kwargs)
    model.setup_cache(1, 16)
    assert model._watcher(model._fused_plan, wrappers_take_stamps=True) == ""
    assert not model.fusable() and not model.fusable()


@torch.no_grad()
def test_steps_and_harmless_changes_keep_the_plan() -> None:
    model = planned()
    model.prefill(torch.tensor([[1, 2, 3]]))
    for _ in range(3):
        assert model.fusable()
        model.decode_one(torch.tensor([[4]]))
    model.layers[0].attention_norm.eps_note = "a plain attribute"  # neither a tensor nor a module nor forward
    register_parameter(model)  # counted as an edit, but nothing the plan reads: the full look re-arms it
    assert model.fusable() and model._fused_plan.unchanged(model)
    model.keep_rows([0])
    model.reset_cache()
    assert model.fusable()
    assert model.fusable() == full_look(model)


def test_watching_keeps_the_dicts_contents_and_a_copy_is_its_own_model() -> None:
    model = build_random_model(CONFIG, seed=3)
    before = {name: (list(m._parameters), list(m._buffers), list(m._modules)) for name, m in model.named_modules()}
    state = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    model.setup_cache(1, 16)
    after = {name: (list(m._parameters), list(m._buffers), list(m._modules)) for name, m in model.named_modules()}
    assert after == before
    assert all(isinstance(m._parameters, CountingDict) and isinstance(m._modules, CountingDict)
               for m in model.modules())
    assert all(torch.equal(model.state_dict()[n], t) for n, t in state.items())
    twin = copy.deepcopy(model)
    assert not isinstance(twin.layers[0]._parameters, CountingDict)  # watched when it is planned
    twin.setup_cache(1, 16)
    assert twin.fusable() and model.fusable()
    twin.layers[0].ffn_norm.weight = nn.Parameter(torch.ones(CONFIG.dim))
    assert not twin.fusable() and model.fusable()


def test_every_write_to_a_watched_dict_counts() -> None:
    from llmtrace.tracer.model.edit_watch import EditCounter

    counter = EditCounter()
    d = CountingDict({"a": 1}, counter)
    writes: list[Callable[[], object]] = [
        lambda: d.__setitem__("b", 2), lambda: d.__delitem__("b"), lambda: d.pop("a"), lambda: d.setdefault("c", 3),
        lambda: d.update(e=5), lambda: d.__ior__({"f": 6}), lambda: d.popitem(), lambda: d.clear()]
    for count, write in enumerate(writes, start=1):
        write()
        assert counter.generation == count
    assert d == {} and type(copy.copy(d)) is dict


@pytest.mark.parametrize("window", [None, 4])
@torch.no_grad()
def test_live_kv_bytes_are_every_cache_s_whatever_path_ran(window: int | None) -> None:
    """kv_live_bytes takes layers x one cache's when the caches are one tensor: the sum it stands for, after
    prefills and decode steps of every path, batches, kept rows and a failed step."""
    from dataclasses import replace

    model = build_random_model(replace(CONFIG, sliding_window=window), seed=3)

    def check() -> None:
        caches = model._kv_caches()
        assert model.kv_live_bytes == sum(cache.live_bytes for cache in caches)
        assert len({(c.length, c.batch) for c in caches}) == 1

    for fused in (True, False):
        model.use_fused = fused
        model.setup_cache(3, 16)
        check()
        model.prefill(torch.tensor([[1, 2, 3], [4, 5, 6], [7, 8, 9]]))
        check()
        for token in range(6):
            model.decode_one(torch.tensor([[token]] * 3))
            check()
        model.keep_rows([0, 2])
        check()
        with pytest.raises(Exception):
            model.decode_one(torch.tensor([[1]] * 5))  # a batch the cache does not hold
        check()
        model.reset_cache()
        check()
    model.use_fused = True
    model.setup_cache(1, 16)
    model.prefill(torch.tensor([[1, 2, 3]]))
    model.layers[1].attention.kv_cache.length = 2  # by hand, between steps: no longer what the formula assumes
    model.layers[0].ffn_norm.weight = nn.Parameter(torch.ones(CONFIG.dim))  # an edit: the sum is taken again
    assert model.kv_live_bytes == sum(cache.live_bytes for cache in model._kv_caches())


@torch.no_grad()
def test_step_checks_take_the_cache_size_from_the_plan_only_while_the_tree_is_unchanged() -> None:
    """Transformer._cached_step reads the cache's size and batch from the plan's plain values: the same refusals as
    the caches' own, and after a cache is replaced the caches themselves are asked again."""
    model = build_random_model(CONFIG, seed=3)
    model.setup_cache(2, 5)
    assert model._fused_plan.max_seq == 5
    model.prefill(torch.tensor([[1, 2, 3]]))
    with pytest.raises(BadArgumentError, match="batch size changed from 1 to 2 mid-sequence"):
        model.decode_one(torch.tensor([[4], [5]]))
    with pytest.raises(BadArgumentError, match=r"\(B, 1\)"):
        model.decode_one(torch.tensor([4]))  # 1-D: refused, not an IndexError
    model.decode_one(torch.tensor([[4]]))
    model.decode_one(torch.tensor([[5]]))
    with pytest.raises(BadArgumentError, match="5 cached \\+ 1 new tokens exceed the cache of 5 positions"):
        model.decode_one(torch.tensor([[6]]))
    assert model.pos == 5 and model.kv_live_bytes == sum(c.live_bytes for c in model._kv_caches())
    model.layers[0].attention.kv_cache.kv = None  # a replaced buffer: the plan no longer describes the caches
    model.reset_cache()
    with pytest.raises(BadArgumentError, match="KV cache is not set up"):
        model.prefill(torch.tensor([[1, 2, 3]]))


def test_the_norm_weights_are_one_vector_whose_version_the_plan_reads() -> None:
    model = planned()
    norms = [n for layer in model.layers for n in (layer.attention_norm, layer.ffn_norm)] + [model.norm]
    base = norms[0].weight.untyped_storage().data_ptr()
    assert all(n.weight.untyped_storage().data_ptr() == base for n in norms)
    plan = model._fused_plan
    assert not any(p is n.weight for p in plan._params for n in norms)  # one spanning view instead of 2L + 1
    model.setup_cache(1, 16)  # packed already: the same parameters
    assert all(n.weight.untyped_storage().data_ptr() == base for n in norms)
