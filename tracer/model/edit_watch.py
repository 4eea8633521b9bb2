"""A model's edit counter: one integer that every structural change to its module tree bumps, so a plan built from
the tree (tracer/model/fused.py) can tell in O(1) per step that nothing it read was replaced.

A decode step of the bundled model is one C call of ~7-10 ms that streams ~100 MB of weights; every cache line and
TLB entry the Python around it touches afterwards is cold. Walking the ~300 parameters and buffers and ~600 modules
of a 30-layer model to confirm the plan still describes it (identities, version counters, forward wrappers) took
~0.45 ms a token that way. Instead the model's modules write through counting dicts and count their own forward
wrappers:

- every module's `_parameters`, `_buffers` and `_modules` become `CountingDict`s (same contents, same order), so any
  replacement, addition or removal bumps the counter, whatever made it: `module.weight = ...`, `register_buffer`,
  `load_state_dict(assign=True)`, `.to()`/`.float()` (nn.Module._apply writes the dicts directly), `del`, a layer
  replaced in a ModuleList;
- a module class that derives from `ForwardWatched` bumps it when an instance-level `forward` is set or deleted (the
  tracer's wrappers, a user's monkeypatch); modules of other classes (nn.ModuleList) are few and looked at directly.

What the counter cannot see, and the plan still checks itself: in-place edits of a parameter's values (its version
counter), the rope tables (plain attributes), hooks (RemovableHandle.next_id). What nothing sees, now or before:
writes that bypass nn.Module and autograd (`p.data = other`, `p.data.mul_(2)`, `module.__dict__["forward"] = f`).
"""

from __future__ import annotations

from typing import Any

from torch import nn

EDIT_COUNTER = "_edit_counter"  # where a watched module keeps its model's counter (a plain instance attribute)
_DICTS = ("_parameters", "_buffers", "_modules")


class EditCounter:
    """The generation of one model's module tree: bumped by every counted edit, never decreased."""

    __slots__ = ("generation",)

    def __init__(self) -> None:
        self.generation = 0


class CountingDict(dict):
    """A module's parameter, buffer or submodule dict that bumps its model's counter on every write."""

    __slots__ = ("counter",)

    def __init__(self, contents: dict, counter: EditCounter) -> None:
        super().__init__(contents)
        self.counter = counter

    def __setitem__(self, key: Any, value: Any) -> None:
        self.counter.generation += 1
        super().__setitem__(key, value)

    def __delitem__(self, key: Any) -> None:
        self.counter.generation += 1
        super().__delitem__(key)

    def pop(self, *args: Any) -> Any:
        self.counter.generation += 1
        return super().pop(*args)

    def popitem(self) -> Any:
        self.counter.generation += 1
        return super().popitem()

    def clear(self) -> None:
        self.counter.generation += 1
        super().clear()

    def update(self, *args: Any, **kwargs: Any) -> None:
        self.counter.generation += 1
        super().update(*args, **kwargs)

    def setdefault(self, key: Any, default: Any = None) -> Any:
        self.counter.generation += 1
        return super().setdefault(key, default)

    def __ior__(self, other: Any) -> CountingDict:
        self.counter.generation += 1
        return super().__ior__(other)

    def __reduce__(self) -> Any:
        # copy/deepcopy/pickle rebuild a plain dict: a copied module is another model, watched when it is planned
        return dict, (dict(self),)


class ForwardWatched(nn.Module):
    """A module that counts setting or deleting an instance-level `forward` (a wrapper) as an edit of its model."""

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "forward":
            _bump(self)
        super().__setattr__(name, value)

    def __delattr__(self, name: str) -> None:
        if name == "forward":
            _bump(self)
        super().__delattr__(name)


def _bump(module: nn.Module) -> None:
    counter = module.__dict__.get(EDIT_COUNTER)
    if counter is not None:
        counter.generation += 1


def watch(model: nn.Module) -> EditCounter:
    """The model's counter (made on the first call), with every module of its tree counting into it from now on.
    Returns the counter and the __dict__s of the modules that cannot count their own forward wrappers."""
    counter = model.__dict__.get(EDIT_COUNTER)
    if not isinstance(counter, EditCounter):
        counter = EditCounter()
    for module in model.modules():
        module.__dict__[EDIT_COUNTER] = counter  # a plain attribute: not a parameter, buffer or submodule
        for name in _DICTS:
            held = module.__dict__[name]
            if not (isinstance(held, CountingDict) and held.counter is counter):
                module.__dict__[name] = CountingDict(held, counter)
    return counter


def unwatched_dicts(model: nn.Module) -> list[dict]:
    """The instance dicts of the modules whose class does not count its forward wrappers (nn.ModuleList and any
    module not of this package): where such a wrapper would sit, to be looked at directly."""
    return [module.__dict__ for module in model.modules() if not isinstance(module, ForwardWatched)]
