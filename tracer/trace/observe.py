"""The Observer: what the logit lens and the attention view need from inside a forward, captured by forward hooks.

- the residual stream at the predicted position (the last one fed) after the embedding and after every layer
  (forward hooks on `tok_embeddings` and `layers.{i}`);
- the attention weights of that position's query over every cached position, per layer and head (forward hooks on
  `layers.{i}.attention.softmax`: exactly the staged model's softmax stage output, row by row).

Each hook copies one row (dim floats, or H x S), nothing more; the projections through the LM head and the
summaries are worked out after the step's clocks stop (tracer/trace/lens.py, tracer/trace/attention_view.py), so
the stages' FLOPs and times hold only the model's work. A hooked module is a watched module, so while an Observer is
attached a run takes the stage modules (tracer/run/select.py: hooks watch them), as `--staged` does. Hooks exist only
between `attach()` and `remove()` (also a context manager), and are removed in `finally`.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


class Observer:
    """Forward hooks that keep the predicted position's residual rows and attention rows of the last forward."""

    def __init__(self, model: nn.Module, *, lens: bool, attention: bool) -> None:
        self.model = model
        self.lens = lens
        self.attention = attention
        self._handles: list[Any] = []
        n_layers = len(model.layers)
        self._residual: list[torch.Tensor | None] = [None] * (n_layers + 1)  # [0]: after the embedding
        self._weights: list[torch.Tensor | None] = [None] * n_layers

    def attach(self) -> None:
        if self._handles:
            return
        try:
            if self.lens:
                self._handles.append(self.model.tok_embeddings.register_forward_hook(self._keep_residual(0)))
                for i, layer in enumerate(self.model.layers):
                    self._handles.append(layer.register_forward_hook(self._keep_residual(i + 1)))
            if self.attention:
                for i, layer in enumerate(self.model.layers):
                    self._handles.append(layer.attention.softmax.register_forward_hook(self._keep_weights(i)))
        except BaseException:
            self.remove()
            raise

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def __enter__(self) -> "Observer":
        self.attach()
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()

    def take(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The last forward's captures, and forget them: residual rows (n_layers + 1, dim) after the embedding and
        each layer, and attention weights (n_layers, H, S) of the predicted position; None for what is not
        observed (or when the forward did not run every layer)."""
        residual = _stack(self._residual) if self.lens else None
        weights = _stack(self._weights) if self.attention else None
        self._residual = [None] * len(self._residual)
        self._weights = [None] * len(self._weights)
        return residual, weights

    def _keep_residual(self, index: int) -> Any:
        def hook(module: nn.Module, args: Any, output: torch.Tensor) -> None:
            self._residual[index] = output[0, -1].detach().clone()  # (dim,): the first sequence, last position
        return hook

    def _keep_weights(self, index: int) -> Any:
        def hook(module: nn.Module, args: Any, output: torch.Tensor) -> None:
            self._weights[index] = output[0, :, -1].detach().clone()  # (H, S): the last query over every key
        return hook


def _stack(rows: list[torch.Tensor | None]) -> torch.Tensor | None:
    if any(r is None for r in rows):
        return None
    return torch.stack(rows)  # type: ignore[arg-type]
