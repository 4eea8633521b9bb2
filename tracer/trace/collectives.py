"""The collectives of a tensor-parallel model (tracer/model/tensor_parallel.py's `Collectives`), each one timed and kept.

`TracedCollectives` runs them on torch.distributed's default process group (gloo on CPU, NCCL on CUDA). Each call is
bracketed by two clock reads, the device synchronised before each on CUDA, so a record's time is the exchange
itself: the wait for the slowest rank to arrive is part of it (that is what the other ranks lose). `ShapeCollectives`
is the meta device's stand-in for a dry run: shapes and bytes, nothing exchanged.

The raw events hold absolute clock readings; `collective_records` files each under the step whose forward it fell in
(the warm-up's and the link measurement's fall in none and are dropped).
"""

from __future__ import annotations

import time
from typing import Iterable, Protocol

import torch

from llmtrace.tracer.analytic.tensor_parallel import ring_allreduce_bytes
from llmtrace.tracer.trace.hooks import device_synchronizer
from llmtrace.tracer.trace.records import StepRecord
from llmtrace.tracer.trace.tp_records import ALL_GATHER, ALL_REDUCE, CollectiveRecord

# (kind, layer, after, payload bytes, start ns, end ns): clock readings are time.perf_counter_ns()
RawCollective = tuple[str, int | None, str, int, int, int]


class _Recording:
    def __init__(self, rank: int, world: int) -> None:
        self.rank, self.world = rank, world
        self.events: list[RawCollective] = []


class LocalLink(Protocol):
    """Collectives between ranks on one host without torch.distributed (tracer/run/shm_link.py)."""

    def fits(self, x: torch.Tensor) -> bool: ...

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor: ...

    def all_gather(self, x: torch.Tensor) -> list[torch.Tensor]: ...


class TracedCollectives(_Recording):
    """Collectives over torch.distributed's default group, or over `local` where it takes the payload (every rank
    decides alike: the same shapes), each timed; `events` lists them in call order."""

    def __init__(self, rank: int, world: int, device: torch.device, local: LocalLink | None = None) -> None:
        super().__init__(rank, world)
        self.sync = device_synchronizer(device)
        self.local = local

    def all_reduce(self, x: torch.Tensor, layer: int | None, after: str) -> torch.Tensor:
        import torch.distributed as dist

        sync = self.sync
        if sync is not None:
            sync()
        start = time.perf_counter_ns()
        if self.local is not None and self.local.fits(x):
            self.local.all_reduce(x)
        else:
            dist.all_reduce(x)  # in place: x is the fresh output of wo, w2 or the embedding
        if sync is not None:
            sync()
        self.events.append((ALL_REDUCE, layer, after, x.numel() * x.element_size(), start, time.perf_counter_ns()))
        return x

    def all_gather(self, x: torch.Tensor, layer: int | None, after: str) -> torch.Tensor:
        import torch.distributed as dist

        x = x.contiguous()
        sync = self.sync
        if sync is not None:
            sync()
        start = time.perf_counter_ns()
        if self.local is not None and self.local.fits(x):
            parts = self.local.all_gather(x)
        else:
            parts = [torch.empty_like(x) for _ in range(self.world)]
            dist.all_gather(parts, x)
        if sync is not None:
            sync()
        self.events.append((ALL_GATHER, layer, after, x.numel() * x.element_size(), start, time.perf_counter_ns()))
        return torch.cat(parts, dim=-1)


class ShapeCollectives(_Recording):
    """A dry run's collectives (meta device): every rank's tensor taken to be this one's; bytes, no exchange."""

    def all_reduce(self, x: torch.Tensor, layer: int | None, after: str) -> torch.Tensor:
        now = time.perf_counter_ns()
        self.events.append((ALL_REDUCE, layer, after, x.numel() * x.element_size(), now, now))
        return x

    def all_gather(self, x: torch.Tensor, layer: int | None, after: str) -> torch.Tensor:
        now = time.perf_counter_ns()
        self.events.append((ALL_GATHER, layer, after, x.numel() * x.element_size(), now, now))
        return torch.cat([x] * self.world, dim=-1)


def bytes_sent(kind: str, payload: int, world: int) -> int:
    """What a ring algorithm makes one rank send: all-reduce 2(N-1)/N x payload, all-gather (N-1) x payload."""
    return ring_allreduce_bytes(payload, world) if kind == ALL_REDUCE else (world - 1) * payload


def collective_records(events: Iterable[RawCollective], rank: int, world: int, origin_ns: int,
                       steps: Iterable[StepRecord]) -> tuple[CollectiveRecord, ...]:
    """The events that fell inside a step's forward, as records on the run's clock (`origin_ns` = the Generation's
    origin; the steps' times are relative to it)."""
    windows = [(s.start_ns, s.start_ns + s.forward_ns, s) for s in steps]
    ranks = tuple(range(world))
    out: list[CollectiveRecord] = []
    for kind, layer, after, payload, start, end in events:
        t0, t1 = start - origin_ns, end - origin_ns
        step = next((s for lo, hi, s in windows if lo <= t0 and t1 <= hi), None)
        if step is None:
            continue  # the warm-up's or the link measurement's
        out.append(CollectiveRecord(
            rank=rank, phase=step.phase, step=step.step, kind=kind, layer=layer,
            after=after if layer is None else f"layers.{layer}.{after}", ranks=ranks, payload_bytes=payload,
            bytes_sent=bytes_sent(kind, payload, world), start_ns=t0, duration_ns=t1 - t0,
        ))
    return tuple(out)
