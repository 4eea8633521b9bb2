"""The clocks a traced step reads: when each stage started and ended, on the host or on the device.

Both tracing mechanisms (tracer/trace/fused_marks.py's marks, tracer/trace/hooks.py's wrappers) take a stamp at each
stage boundary and turn a step's stamps into nanoseconds on the run's host clock once the step is over:
- `HostClock` (cpu; mps): a stamp is time.perf_counter_ns(), read after synchronising the device where one queues
  work asynchronously (mps). Resolving is the identity: the CPU hot path is one clock read, as before.
- `EventClock` (cuda): a stamp records a CUDA event on the current stream and returns its index. Nothing waits for the
  GPU between stages, so the kernels queue back to back as in an untraced run (a synchronize before every host
  reading serialises launch and execution and adds the launch latency to every stage). At the end of the step one
  synchronize, then each stamp is the GPU time elapsed since the step's first event, placed on the host clock at
  the host time of that first event (read right after a synchronize, so the GPU was idle and the event ran at once).
The event and synchronize functions are parameters, so the CUDA path runs in CPU tests with a stand-in event
(tests/test_stage_clock.py); `clock_for(device)` picks the right clock.
"""

from __future__ import annotations

import time
from typing import Any, Callable

Stamp = int  # HostClock: nanoseconds; EventClock: an event index within the step


def reads_host_clock(clock: object) -> bool:
    """Whether `clock`'s stamps are plain time.perf_counter_ns() readings (a HostClock with no device to
    synchronise): then readings the native decode step takes in C on the same clock (CLOCK_MONOTONIC on Linux,
    native_step.host_clock_matches) can stand for its stamps."""
    return isinstance(clock, HostClock) and clock.sync is None and clock.stamp is time.perf_counter_ns


class HostClock:
    """Host clock readings, the device synchronised first when `sync` is given (mps)."""

    on_device = False

    def __init__(self, sync: Callable[[], Any] | None = None, clock: Callable[[], int] = time.perf_counter_ns) -> None:
        self.sync = sync
        if sync is None:
            self.stamp: Callable[[], Stamp] = clock
        else:
            def stamp() -> Stamp:
                sync()
                return clock()
            self.stamp = stamp

    def begin_step(self) -> None:
        """Nothing to set up: every stamp is already a time."""

    def resolve(self, stamps: list[Stamp]) -> list[int]:
        return stamps


class EventClock:
    """CUDA events as stage stamps (see the module docstring). `event` makes a timing event (torch.cuda.Event with
    enable_timing=True), `synchronize` waits for the device (torch.cuda.synchronize)."""

    on_device = True

    def __init__(self, event: Callable[[], Any], synchronize: Callable[[], Any],
                 clock: Callable[[], int] = time.perf_counter_ns) -> None:
        self._new_event = event
        self._synchronize = synchronize
        self._clock = clock
        self._pool: list[Any] = []  # events reused step after step: creating one per stage would cost more
        self._used = 0
        self._anchor_ns = 0

    def begin_step(self) -> None:
        """Start a step: the device idle, the host time read, the step's first event (index 0) recorded."""
        self._synchronize()
        self._used = 0
        self._anchor_ns = self._clock()
        self.stamp()

    def stamp(self) -> Stamp:
        if self._used == len(self._pool):
            self._pool.append(self._new_event())
        event = self._pool[self._used]
        event.record()
        self._used += 1
        return self._used - 1

    def resolve(self, stamps: list[Stamp]) -> list[int]:
        """The stamps as host nanoseconds: one synchronize, then each event's time after the step's first."""
        self._synchronize()
        first = self._pool[0]
        elapsed = [round(first.elapsed_time(self._pool[i]) * 1e6) for i in range(self._used)]  # ms -> ns
        return [self._anchor_ns + elapsed[s] for s in stamps]


def cuda_event_clock() -> EventClock:
    import torch

    return EventClock(lambda: torch.cuda.Event(enable_timing=True), torch.cuda.synchronize)


def clock_for(device: Any) -> HostClock | EventClock:
    """CUDA events on cuda; the host clock after a synchronize on mps; the plain host clock on cpu."""
    import torch

    kind = torch.device(device).type
    if kind == "cuda":
        return cuda_event_clock()
    if kind == "mps":
        return HostClock(torch.mps.synchronize)
    return HostClock()
