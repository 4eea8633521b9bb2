"""Whether a measurement was taken on a busy machine: the share of the CPUs' time other processes took meanwhile.

A measurement (`llmtrace tune`'s timings, tracer/load/kernel_pick.py; the roofline's ceilings,
tracer/hardware/measure.py) is saved and served to later runs, so one taken while something else ran (a
compiler build on both cores of a fresh machine: every candidate timed 2-8x slow, the wrong one chosen, the ceilings
low) would be served as if it were the machine's. Its timings cannot tell: a best-of or a low quantile filters short
spells of the neighbours, not a build that runs throughout.

What is read (Linux; elsewhere nothing is, and a measurement is taken as it is):
- /proc/stat before and after, the lines of the CPUs this process may run on (its affinity mask): their busy time
  (user, nice, system, irq, softirq and steal: a virtual machine's host running someone else counts) and their
  whole time, in clock ticks;
- this process's CPU time (all its threads) and its finished children's (a C compiler the measurement ran, the
  native kernel's first build), from os.times.
OTHERS' SHARE = (busy ticks - this process's ticks) / whole ticks over the interval: 0 on a quiet machine however
busy the measurement kept the CPUs itself, ~0.5 when a build shares two cores with it. Above BUSY_SHARE the
measurement is "busy": the caller says so (tune saves its pick with a note to tune again on a quieter machine; a
quick roofline profile serves the run that made it and is not saved, so the next run measures again).

BUSY_SHARE can be set with LLMTRACE_BUSY_SHARE (a number from 0 to 1; 1: never busy, for a machine that is always
shared, where measuring again every run costs more than a choice made under load), read before a measurement.
Pure Python, no torch; the reading comes through a `Sampler`, so tests inject one.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Callable

from llmtrace.tracer.core.errors import BadArgumentError

BUSY_SHARE = 0.10  # other processes' share of the CPUs' time above which a measurement is busy
BUSY_SHARE_ENV = "LLMTRACE_BUSY_SHARE"
MIN_TICKS_PER_CPU = 20  # an interval shorter than this (0.2 s at 100 ticks/s) says nothing: no verdict


@dataclass(frozen=True, slots=True)
class CpuSample:
    """One reading: the CPUs' counters since boot and this process's CPU time."""

    busy_ticks: int  # busy time of the CPUs this process may run on, every process (clock ticks)
    total_ticks: int  # their whole time, idle included (clock ticks)
    own_seconds: float  # this process's CPU time, all threads, and its finished children's
    ticks_per_second: float  # the clock tick (USER_HZ)
    cpus: int = 1  # how many CPUs the ticks are summed over


Sampler = Callable[[], "CpuSample | None"]


def read_sample(stat_path: str = "/proc/stat") -> CpuSample | None:
    """The reading now (see the module docstring); None where /proc/stat is absent or unreadable."""
    try:
        cpus = os.sched_getaffinity(0)
        hz = float(os.sysconf("SC_CLK_TCK"))
        with open(stat_path, encoding="ascii") as fh:
            lines = fh.read().splitlines()
    except (AttributeError, OSError, ValueError):
        return None
    busy = total = counted = 0
    for line in lines:
        name, _, rest = line.partition(" ")
        if not (name.startswith("cpu") and name[3:].isdigit() and int(name[3:]) in cpus):
            continue
        try:
            values = [int(v) for v in rest.split()]
        except ValueError:
            return None
        if len(values) < 4:
            return None
        idle = values[3] + (values[4] if len(values) > 4 else 0)  # idle + iowait
        work = sum(values[:8]) - idle  # user nice system irq softirq steal (guest is inside user)
        busy, total, counted = busy + work, total + work + idle, counted + 1
    if total <= 0 or hz <= 0:
        return None
    t = os.times()
    return CpuSample(busy, total, t.user + t.system + t.children_user + t.children_system, hz, counted)


def others_share(before: CpuSample | None, after: CpuSample | None) -> float | None:
    """Other processes' share of the CPUs' time between two readings, in [0, 1]; None when either is missing or the
    interval is too short to say (under MIN_TICKS_PER_CPU ticks a CPU)."""
    if before is None or after is None:
        return None
    total = after.total_ticks - before.total_ticks
    if total <= 0 or total < MIN_TICKS_PER_CPU * max(1, after.cpus):
        return None
    own = (after.own_seconds - before.own_seconds) * after.ticks_per_second
    others = (after.busy_ticks - before.busy_ticks) - own
    return min(1.0, max(0.0, others / total))


def busy_share() -> float:
    """BUSY_SHARE, or LLMTRACE_BUSY_SHARE when set (BadArgumentError naming the variable when it is not a number
    from 0 to 1)."""
    text = os.environ.get(BUSY_SHARE_ENV, "").strip()
    if not text:
        return BUSY_SHARE
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0.0 <= value <= 1.0:
        raise BadArgumentError(f"{BUSY_SHARE_ENV}={text!r}: give the share of the CPUs' time other processes may "
                               f"take during a measurement, a number from 0 to 1 (default {BUSY_SHARE}; 1 = never "
                               "busy)")
    return value


def is_busy(share: float | None, limit: float | None = None) -> bool:
    """Whether a measurement during which others took `share` of the CPUs was taken on a busy machine (over `limit`,
    busy_share() when not given); an unknown share (None) is not."""
    return share is not None and share > (busy_share() if limit is None else limit)


class LoadWatch:
    """Readings around a measurement: `with LoadWatch(sampler) as watch: ...`, then `watch.share`."""

    def __init__(self, sampler: Sampler | None = None) -> None:
        self.sampler = sampler or read_sample
        self.before: CpuSample | None = None
        self.share: float | None = None

    def __enter__(self) -> "LoadWatch":
        self.before = self.sampler()
        return self

    def __exit__(self, *exc: object) -> None:
        self.share = others_share(self.before, self.sampler())
