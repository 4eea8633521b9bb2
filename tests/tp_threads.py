"""Tensor-parallel ranks as threads of one process, exchanging through a barrier: the sharded model's arithmetic
checked without a process group (tracer/model/tensor_parallel.py's Collectives, in memory)."""

from __future__ import annotations

import threading
from typing import Any, Callable

import torch


class _Exchange:
    def __init__(self, world: int) -> None:
        self.world = world
        self.barrier = threading.Barrier(world, timeout=30)
        self.slots: list[Any] = [None] * world


class ThreadCollectives:
    """One rank's view of an in-memory exchange; `log` lists (kind, layer, after, payload bytes) per call."""

    def __init__(self, exchange: _Exchange, rank: int) -> None:
        self.exchange, self.rank, self.world = exchange, rank, exchange.world
        self.log: list[tuple[str, int | None, str, int]] = []

    def _everyone(self, x: torch.Tensor) -> list[torch.Tensor]:
        ex = self.exchange
        ex.slots[self.rank] = x.clone()
        ex.barrier.wait()
        parts = list(ex.slots)
        ex.barrier.wait()  # nobody overwrites a slot before everyone has read them all
        return parts

    def all_reduce(self, x: torch.Tensor, layer: int | None, after: str) -> torch.Tensor:
        self.log.append(("all_reduce", layer, after, x.numel() * x.element_size()))
        parts = self._everyone(x)
        total = parts[0].clone()
        for p in parts[1:]:
            total += p
        return total

    def all_gather(self, x: torch.Tensor, layer: int | None, after: str) -> torch.Tensor:
        self.log.append(("all_gather", layer, after, x.numel() * x.element_size()))
        return torch.cat(self._everyone(x), dim=-1)


def run_ranks(world: int, body: Callable[[int, ThreadCollectives], Any]) -> list[Any]:
    """body(rank, comm) on `world` threads at once; their results in rank order (an exception re-raised)."""
    exchange = _Exchange(world)
    results: list[Any] = [None] * world
    errors: list[BaseException] = []

    def target(rank: int) -> None:
        try:
            results[rank] = body(rank, ThreadCollectives(exchange, rank))
        except BaseException as exc:  # noqa: BLE001 - handed to the caller
            errors.append(exc)
            exchange.barrier.abort()

    threads = [threading.Thread(target=target, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return results
