"""Stage clocks: the CUDA-event clock's arithmetic on the CPU with a stand-in event, and the choice of clock; a real
CUDA run of the same path where a GPU exists."""

from __future__ import annotations

import pytest
import torch

from llmtrace.tracer.trace.stage_clock import EventClock, HostClock, clock_for


class FakeDevice:
    """A device whose queued work runs when synchronised: an event records the device time at which it executes,
    which is the host time of the synchronize that ran it plus the work queued before it."""

    def __init__(self) -> None:
        self.host_ns = 1_000_000
        self.queued: list[tuple["FakeEvent", int]] = []  # (event, work ns queued before it)
        self.work_ns = 0
        self.synchronizes = 0

    def clock(self) -> int:
        return self.host_ns

    def run(self, ns: int) -> None:
        """Queue `ns` of device work (a stage's kernels)."""
        self.work_ns += ns

    def synchronize(self) -> None:
        self.synchronizes += 1
        for event, before in self.queued:
            event.device_ns = self.host_ns + before
        self.host_ns += self.work_ns
        self.queued.clear()
        self.work_ns = 0


class FakeEvent:
    def __init__(self, device: FakeDevice) -> None:
        self.device = device
        self.device_ns: int | None = None

    def record(self) -> None:
        self.device.queued.append((self, self.device.work_ns))

    def elapsed_time(self, other: "FakeEvent") -> float:
        assert self.device_ns is not None and other.device_ns is not None, "read before the device ran it"
        return (other.device_ns - self.device_ns) / 1e6  # milliseconds, as torch.cuda.Event says


def test_event_stamps_become_host_nanoseconds_with_one_synchronize_per_step() -> None:
    device = FakeDevice()
    clock = EventClock(lambda: FakeEvent(device), device.synchronize, device.clock)
    for step in range(2):  # events are reused from the second step on
        clock.begin_step()
        start = device.host_ns
        stamps = [0]
        for ns in (3000, 500, 12000):
            device.run(ns)
            stamps.append(clock.stamp())
        before = device.synchronizes
        times = clock.resolve(stamps)
        assert device.synchronizes == before + 1
        assert times == [start, start + 3000, start + 3500, start + 15500]
    assert len(clock._pool) == 4


def test_host_clock_resolves_to_its_readings() -> None:
    ticks = iter(range(100, 200, 10))
    synced: list[int] = []
    clock = HostClock(lambda: synced.append(1), lambda: next(ticks))
    clock.begin_step()
    stamps = [clock.stamp(), clock.stamp()]
    assert clock.resolve(stamps) == [100, 110] and len(synced) == 2
    assert HostClock().on_device is False and EventClock(object, object).on_device is True


def test_clock_for_the_device() -> None:
    assert type(clock_for("cpu")) is HostClock and clock_for("cpu").sync is None
    assert type(clock_for(torch.device("meta"))) is HostClock


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_events_time_real_kernels() -> None:
    clock = clock_for("cuda")
    assert isinstance(clock, EventClock)
    a = torch.randn(2048, 2048, device="cuda")
    clock.begin_step()
    stamps = [0]
    for _ in range(3):
        a = a @ a.t() / 2048
        stamps.append(clock.stamp())
    times = clock.resolve(stamps)
    assert all(later > earlier for earlier, later in zip(times, times[1:]))
