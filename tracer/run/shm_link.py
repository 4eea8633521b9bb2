"""The collectives of a CPU tensor-parallel run's ranks, all on this host, exchanged through one shared memory file
instead of gloo's TCP loopback.

A decode step makes two all-reduces a layer of one hidden vector (LLaMA-7B: 16 KB) and one all-gather of the
logits. Over gloo each costs ~0.4 ms alone and ~1.5 ms in a step on a 2-core host (its I/O thread competes with the
rank's compute thread); here a rank copies its tensor into its slot, publishes the collective's sequence number in
its own cache line, waits until every rank has published it (spinning, then yielding the core), and reads the slots:
~8 µs alone (benchmarks/bench_tp_scale.py measures it in a step; BENCHMARKS.md has both).

Layout of the file: one 64-byte line per rank (its last sequence number), then two buffers of `world` slots of
SLOT_BYTES each, used by odd and even sequence numbers in turn. A rank reuses a buffer two collectives later, which
it reaches only after every rank has published the one in between, i.e. after every rank has finished reading this
buffer: no second barrier is needed. Every rank sums the slots in rank order, so all hold the same bits.

A payload larger than a slot (a long prompt's prefill) goes over gloo: every rank decides alike, from the same
shape. A rank that does not arrive within the run's timeout ends this one with a one-line error, as gloo's would.
"""

from __future__ import annotations

import mmap
import os
import platform
import time
from pathlib import Path

import numpy as np
import torch

SLOT_BYTES = 1 << 20  # a decode step's payloads (16 KB hidden vectors, a vocabulary slice's logits) fit many times
_LINE = 64  # one cache line per rank's sequence number: no false sharing between the ranks' flags
_SPINS = 100  # busy checks (~1 µs each) before yielding the core at each check (the other rank is usually
# microseconds away; on a host with more ranks than cores it needs the core to get there)


def available() -> bool:
    """x86-64 only: a store there is never seen before an earlier one (so a rank that sees a flag sees its slot);
    elsewhere the ranks keep to gloo."""
    return platform.machine().lower() in ("x86_64", "amd64")


class SharedMemoryLink:
    """Rank `rank` of `world`'s view of the shared file at `path` (created by whichever rank comes first)."""

    def __init__(self, path: str | Path, rank: int, world: int, timeout_s: float) -> None:
        self.rank, self.world, self.timeout_s = rank, world, timeout_s
        size = _LINE * world + 2 * world * SLOT_BYTES
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            if os.fstat(fd).st_size < size:
                os.ftruncate(fd, size)  # the same size from every rank; a fresh file reads as zeros
            self._map = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self._flags = np.frombuffer(self._map, dtype=np.int64, count=_LINE // 8 * world)[:: _LINE // 8]
        self._slots = torch.frombuffer(self._map, dtype=torch.uint8, offset=_LINE * world).view(2, world, SLOT_BYTES)
        self._sequence = 0
        # the slots as (world, *shape) of a dtype, per buffer: made once per run's few payload shapes, not each
        # collective (two a layer a step)
        self._views: dict[tuple[int, torch.dtype, torch.Size], torch.Tensor] = {}

    def fits(self, x: torch.Tensor) -> bool:
        return x.device.type == "cpu" and x.numel() * x.element_size() <= SLOT_BYTES

    def _publish(self, x: torch.Tensor) -> torch.Tensor:
        """Post `x` as this rank's part of the next collective and wait for every rank's; the buffer's world slots
        as (world, *x.shape) in x's dtype."""
        self._sequence += 1
        key = (self._sequence & 1, x.dtype, x.shape)
        buffer = self._views.get(key)
        if buffer is None:
            nbytes = x.numel() * x.element_size()
            buffer = self._views[key] = self._slots[key[0], :, :nbytes].view(x.dtype).view(self.world, *x.shape)
        buffer[self.rank].copy_(x)
        self._flags[self.rank] = self._sequence  # an aligned 8-byte store, after the slot's (x86-64 keeps the order)
        self._wait()
        return buffer

    def _wait(self) -> None:
        flags, want = self._flags, self._sequence
        spins, deadline = 0, 0.0
        while int(flags.min()) < want:
            spins += 1
            if spins < _SPINS:
                continue
            now = time.monotonic()
            if not deadline:
                deadline = now + self.timeout_s
            elif now > deadline:
                late = [r for r in range(self.world) if flags[r] < want]
                raise TimeoutError(f"shared-memory collective {want}: rank {late[0]} did not arrive within "
                                   f"{self.timeout_s:g} s")
            os.sched_yield()

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """x summed over the ranks, in place (in rank order: every rank gets the same bits)."""
        parts = self._publish(x)
        x.copy_(parts[0])
        for r in range(1, self.world):
            x.add_(parts[r])
        return x

    def all_gather(self, x: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's x, in rank order (copies: the buffer is reused two collectives later)."""
        return list(self._publish(x).clone().unbind(0))
