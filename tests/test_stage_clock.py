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


class HostTimedEvent:
    """A CUDA event's interface over the CPU: work runs synchronously, so an event's device time is the host time at
    which it is recorded."""

    def __init__(self) -> None:
        self.ns = 0

    def record(self) -> None:
        import time

        self.ns = time.perf_counter_ns()

    def elapsed_time(self, other: "HostTimedEvent") -> float:
        return (other.ns - self.ns) / 1e6


@pytest.mark.parametrize("mechanism", ["fused", "wrap", "hooks"])
def test_the_tracer_runs_its_cuda_event_path_on_the_cpu(mechanism: str) -> None:
    """The Tracer with an EventClock (the path a CUDA run takes) gives the same records as with the host clock, each
    stage timed inside its step, with one synchronize per step."""
    from llmtrace.tracer.core.config import ModelConfig
    from llmtrace.tracer.model.transformer import build_random_model
    from llmtrace.tracer.run.backends import backend_for
    from llmtrace.tracer.trace.hooks import Tracer
    from llmtrace.tracer.trace.records import DECODE, PREFILL

    config = ModelConfig("tiny", 128, 64, 2, 4, 2, 96, max_seq_len=32)
    records = {}
    for kind in ("host", "events"):
        syncs: list[int] = []
        clock = EventClock(HostTimedEvent, lambda: syncs.append(1)) if kind == "events" else None
        model = build_random_model(config, seed=1)
        model.setup_cache(1, 12)
        bounds = []
        with Tracer(model, mechanism=mechanism, clock=clock) as tracer:
            run = backend_for(model).traced(tracer)  # packed, or the stage modules the hooks or wrappers watch
            for step, ids in enumerate(([[5, 6, 7, 8]], [[9]], [[10]])):
                import time

                before = time.perf_counter_ns()
                tracer.begin_step(PREFILL if step == 0 else DECODE, step)
                (run.prefill if step == 0 else run.decode)(torch.tensor(ids))
                tracer.end_step()
                bounds.append((before, time.perf_counter_ns()))
        records[kind] = tracer.records()
        if kind == "events":
            assert len(syncs) == 2 * 3  # begin and end of each step, none per stage
        for r in records[kind]:
            start, end = bounds[r.step]
            assert start - tracer.origin_ns <= r.start_ns <= r.start_ns + r.duration_ns <= end - tracer.origin_ns
    strip = lambda rs: [(r.phase, r.step, r.stage, r.input_shapes, r.matmul_flops, r.weight_bytes_read) for r in rs]
    assert strip(records["events"]) == strip(records["host"])
