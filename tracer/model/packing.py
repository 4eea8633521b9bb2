"""Q|K|V and gate|up as one product each: how the model lays them out at load, and how a run's plan reads them.

The packed step (tracer/model/fused.py) multiplies each layer's wq|wk|wv and w1|w3 (and their biases) as one matrix.
The model's weights are laid out for it when they are loaded (`pack_layers`, from Transformer.load_weights and
load_stored): dense members become views of consecutive row blocks of one tensor (no extra memory; HF folders are
read that way already: tracer/load/hf_loader.py), and members held as a GGUF stores them get their concatenation
(concat_rows: the native kernel's blocks are not copied) kept on the first member as `fused_packed`. A run's plan
(`rows_of`) then takes a view, or, where a weight was replaced since the load, a concatenation of its own: the run
never edits the model."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from llmtrace.tracer.model.weight_formats import PackedWeight, concat_rows


def groups(layer: nn.Module) -> list[tuple[nn.Module, ...]]:
    """The product groups of one TransformerBlock: wq|wk|wv, and w1|w3 of a dense FFN (a mixture of experts' are per
    expert: moe.ExpertsPlan) or of a mixture's shared expert (Qwen2-MoE)."""
    attn, ffn = layer.attention, layer.feed_forward
    gate_up = (ffn.w1, ffn.w3) if isinstance(ffn._modules.get("w1"), nn.Linear) else (
        (ffn.shared_w1, ffn.shared_w3) if ffn._modules.get("shared_w1") is not None else None)
    return [(attn.wq, attn.wk, attn.wv), *((gate_up,) if gate_up is not None else ())]


def pack_layers(model: nn.Module) -> None:
    """Lay every layer's groups out as one product each (at load: the weights just adopted, nothing run yet)."""
    with torch.no_grad():
        for layer in model.layers:
            for group in groups(layer):
                stored = [_stored(linear) for linear in group]
                if any(stored) and not all(stored) or packed(*group):
                    continue  # a group mixing stored and dense matrices runs as rows_of's error says
                if all(stored):
                    try:
                        group[0].fused_packed = concat_rows([linear.packed for linear in group])
                    except ValueError:
                        continue  # formats one product cannot join: rows_of says so to the run that needs it
                    group[0].fused_members = tuple(linear.packed for linear in group)
                for attribute in ("bias",) if all(stored) else ("weight", "bias"):
                    params = [getattr(linear, attribute) for linear in group]
                    if params[0] is None or params[0].is_meta:
                        continue  # a stored matrix's placeholder, or a dry run's (a first cat on meta: ~70 MB)
                    whole, row = torch.cat([p.detach() for p in params], dim=0), 0
                    for linear, param in zip(group, params):
                        rows = param.shape[0]
                        setattr(linear, attribute, nn.Parameter(whole[row:row + rows], param.requires_grad))
                        row += rows


def rows_of(*linears: nn.Module) -> tuple[torch.Tensor | PackedWeight, torch.Tensor | None]:
    """(weight, bias) of the linears as one (rows, in) product: views of the layout `pack_layers` made, or a copy
    of the plan's own where a member was replaced since."""
    stored = [_stored(linear) for linear in linears]
    if any(stored) and not all(stored):
        raise ValueError("a packed stage mixes stored and dense matrices")
    biases = [linear.bias for linear in linears]
    bias = None if biases[0] is None else _rows(biases)
    if all(stored):
        if packed(*linears):
            return linears[0].fused_packed, bias
        return concat_rows([linear.packed for linear in linears]), bias
    return _rows([linear.weight for linear in linears]), bias


def weight_of(module: nn.Module) -> torch.Tensor | PackedWeight:
    """What a product multiplies by: the module's PackedWeight when it is held as stored, else its weight."""
    stored = getattr(module, "packed", None)
    return stored if stored is not None else module.weight.detach()


def detached(tensor: torch.Tensor | None) -> torch.Tensor | None:
    return None if tensor is None else tensor.detach()


def packed(*linears: nn.Module) -> bool:
    """Whether the linears' weights (and biases) are consecutive row blocks of one storage, each contiguous; for
    weights held as stored, whether the concatenation of exactly these PackedWeights exists (and the biases are
    consecutive)."""
    if _stored(linears[0]):
        members = getattr(linears[0], "fused_members", None)
        if members is None or len(members) != len(linears) or any(
                m is not linear.packed for m, linear in zip(members, linears)):
            return False
        attributes: tuple[str, ...] = ("bias",)
    else:
        attributes = ("weight", "bias")
    return all(_consecutive([getattr(linear, a) for linear in linears])
               for a in attributes if getattr(linears[0], a) is not None)


def _stored(linear: Any) -> bool:
    """Whether the linear's matrix is held as the GGUF stores it (its `packed`; its weight a meta placeholder)."""
    return getattr(linear, "packed", None) is not None


def _rows(tensors: list[torch.Tensor]) -> torch.Tensor:
    """The tensors' rows as one tensor: a view spanning them when they are consecutive, else a copy."""
    if not _consecutive(tensors):
        return torch.cat([t.detach() for t in tensors], dim=0)
    t, last = tensors[0].detach(), tensors[-1]
    row_numel = t[0].numel() if t.dim() > 1 else 1
    rows = (last.data_ptr() - t.data_ptr()) // (t.element_size() * row_numel) + last.shape[0]
    return torch.as_strided(t, (rows, *t.shape[1:]), t.stride())


def _consecutive(tensors: list[torch.Tensor]) -> bool:
    if not all(t.is_contiguous() for t in tensors) or tensors[0].device.type == "meta":
        return False
    base = tensors[0].untyped_storage().data_ptr()
    expected = tensors[0].data_ptr()
    for t in tensors:
        if t.untyped_storage().data_ptr() != base or t.data_ptr() != expected:
            return False
        expected += t.numel() * t.element_size()
    return True
