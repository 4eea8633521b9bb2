"""One rank of a tensor-parallel run: join the process group, load this rank's shard, time the link, generate.

Every rank runs the ordinary generation loop (tracer/run/generate.py) on its TensorParallelTransformer: the LM head's
all-gather gives every rank the same logits, so with the same seed every rank samples the same token and the loops
stay in step without exchanging tokens. Between steps a rank asks the StopGate (tracer/run/tp_launch.py) whether
to go on, so that a Ctrl-C stops every rank after the same step, never mid-collective.

A rank never prints: what it did goes into its RankOutcome (the parent reads it from a JSON file, or rank 0 gathers
it under torchrun), including the one line of an exception that ended it, after which its partial trace is kept.
"""

from __future__ import annotations

import os
import statistics
import threading
import time
from dataclasses import asdict, dataclass, replace
from datetime import timedelta
from typing import Any, Protocol

import torch

from llmtrace.tracer.core.atomic_file import write_atomic
from llmtrace.tracer.core.dtypes import AutoDtype, DType
from llmtrace.tracer.load.tensor_parallel import load_shard
from llmtrace.tracer.run.generate import Generation, PrefillDone, Tokenized, TokenStep
from llmtrace.tracer.run import shm_link
from llmtrace.tracer.trace.collectives import LocalLink, TracedCollectives, collective_records
from llmtrace.tracer.trace.records import RunSettings
from llmtrace.tracer.trace.run_trace import Trace
from llmtrace.tracer.trace.tp_records import CollectiveRecord, LinkMeasurement

LARGE_PAYLOAD_BYTES = 4 * 2**20  # the link measurement's bandwidth payload (4 MiB: past gloo's latency-bound sizes)
FAULTS = ("die", "hang")  # tests' fault injection: RankJob.fault = "die:<rank>:<step>" or "hang:<rank>:<step>"
FAULT_EXIT_CODE = 17


@dataclass(frozen=True, slots=True)
class RankJob:
    """Everything one rank needs (plain values: it crosses into a spawned process)."""

    rank: int
    tp: int
    model: str | None  # --model as given; None = the bundled model
    dtype: DType | AutoDtype
    device: str  # "cpu", or "cuda" (each rank takes cuda:<local rank>)
    settings: RunSettings
    threads: int
    timeout_s: float
    result_path: str  # where the RankOutcome goes (spawn launcher); "" = nowhere (torchrun: gathered instead)
    dry_run: bool = False
    fault: str | None = None


@dataclass(frozen=True, slots=True)
class RankOutcome:
    rank: int
    origin_ns: int  # the Generation's origin on this machine's monotonic clock (0 when it never started)
    trace: Trace | None
    collectives: tuple[CollectiveRecord, ...]
    link: LinkMeasurement | None
    error: str | None  # the one line of what ended this rank early; None when it finished

    def to_dict(self) -> dict[str, Any]:
        return {"rank": self.rank, "origin_ns": self.origin_ns,
                "trace": None if self.trace is None else self.trace.to_dict(),
                "collectives": [asdict(c) for c in self.collectives],
                "link": None if self.link is None else asdict(self.link), "error": self.error}


class Gate(Protocol):
    def may_start(self, rank: int, step: int) -> bool:
        """False: stop before step `step` (every rank stops before the same one)."""


class OpenGate:
    """No parent to ask (torchrun, a dry run): always go on."""

    def may_start(self, rank: int, step: int) -> bool:
        return True


def backend_for(device: str) -> str:
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


SHM = "shm"  # the spawn launcher's CPU ranks: shared memory on this host, gloo beneath for payloads past a slot


def spawn_backend(device: str) -> str:
    """What the spawn launcher's ranks exchange through: shared memory where it is safe (CPU ranks, all on this
    host, on x86-64: tracer/run/shm_link.py), else backend_for's."""
    return SHM if torch.device(device).type == "cpu" and shm_link.available() else backend_for(device)


def rank_device(device: str, local_rank: int) -> str:
    return f"cuda:{local_rank}" if torch.device(device).type == "cuda" else device


def one_line(exc: BaseException) -> str:
    """An exception as one line, its first, whole (gloo and NCCL errors run to many lines of C++ context; ours are
    one line, which says what to do at its end: never cut)."""
    text = (str(exc).strip().splitlines() or [""])[0]
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def init_group(job: RankJob, store: Any | None, local_rank: int) -> str:
    """Join the group (the given store, or torchrun's env:// variables); the device this rank computes on."""
    import torch.distributed as dist

    device = rank_device(job.device, local_rank)
    if torch.device(device).type == "cuda":
        torch.cuda.set_device(device)
    kwargs: dict[str, Any] = {"timeout": timedelta(seconds=job.timeout_s)}
    if store is not None:
        kwargs.update(store=store, rank=job.rank, world_size=job.tp)
    dist.init_process_group(backend_for(job.device), **kwargs)
    return device


def measure_link(comm: TracedCollectives, payload_bytes: int, dtype: torch.dtype, device: str) -> LinkMeasurement:
    """Medians of timed all-reduces over the group: one decode payload (latency), then LARGE_PAYLOAD_BYTES
    (bandwidth). Collective: every rank calls it at the same point."""
    def timed(nbytes: int, reps: int) -> float:
        x = torch.ones(max(1, nbytes // dtype.itemsize), dtype=dtype, device=device)
        times = []
        for i in range(reps + 1):
            before = len(comm.events)
            comm.all_reduce(x, None, "link measurement")
            _, _, _, _, start, end = comm.events[before]
            if i:  # the first call sets up the connection's buffers
                times.append((end - start) / 1e9)
        del comm.events[-(reps + 1):]
        return statistics.median(times)

    small = timed(payload_bytes, 9)
    large = timed(LARGE_PAYLOAD_BYTES, 3)
    ring = 2 * (comm.world - 1) * LARGE_PAYLOAD_BYTES / comm.world
    return LinkMeasurement(small_payload_bytes=payload_bytes, small_seconds=small,
                           large_payload_bytes=LARGE_PAYLOAD_BYTES, large_seconds=large,
                           bus_bandwidth=ring / large if large > 0 else 0.0)


def _fault(job: RankJob, step: int) -> None:
    if not job.fault:
        return
    kind, rank, at = job.fault.split(":")
    if int(rank) == job.rank and int(at) == step:
        if kind == "die":
            os._exit(FAULT_EXIT_CODE)
        time.sleep(3600)  # "hang": the others' collectives time out; the parent kills this one


def run_rank(job: RankJob, device: str, gate: Gate, local: LocalLink | None = None) -> RankOutcome:
    """This rank's whole run in a joined group (its collectives over `local` where it takes them); its outcome,
    partial when an exception ended it."""
    comm = TracedCollectives(job.rank, job.tp, torch.device(device), local)
    generation: Generation | None = None
    link: LinkMeasurement | None = None
    error: str | None = None
    try:
        loaded = load_shard(job.model, job.dtype, device, job.rank, job.tp, comm, weights=job.settings.weights)
        param = next(loaded.model.parameters())
        link = measure_link(comm, loaded.config.dim * param.element_size(), param.dtype, device)
        generation = Generation(loaded, job.settings)
        for event in generation.events():
            if isinstance(event, Tokenized):
                step = 0
            elif isinstance(event, (PrefillDone, TokenStep)):
                step = event.step.step + 1
            else:
                continue
            if not gate.may_start(job.rank, step):
                break
            _fault(job, step)
    except Exception as exc:  # noqa: BLE001 - the outcome carries it; the partial trace is kept
        error = one_line(exc)
    finally:
        if generation is not None:
            generation.close()
    if generation is None:
        return RankOutcome(job.rank, 0, None, (), link, error)
    trace = generation.trace()
    # every stage record names its rank, the base rank's too (the merged trace keeps those as its own stages)
    trace = replace(trace, stages=tuple(replace(s, rank=job.rank) for s in trace.stages))
    records = collective_records(comm.events, job.rank, job.tp, generation.origin_ns, trace.steps)
    return RankOutcome(job.rank, generation.origin_ns, trace, records, link, error)


def _exit_with_parent() -> None:
    """End this rank if the launcher goes (killed outright, it cannot stop its ranks itself)."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(3)

    threading.Thread(target=watch, daemon=True).start()


def spawned_rank(job: RankJob, store_path: str, gate: Gate) -> None:
    """The body of a process the launcher spawned: the outcome goes to job.result_path; exit 0, or 1 after an
    exception. Stop signals are the launcher's to handle (it stops every rank through the gate)."""
    import signal

    import torch.distributed as dist

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _exit_with_parent()
    torch.set_num_threads(job.threads)
    outcome = RankOutcome(job.rank, 0, None, (), None, "did not start")
    try:
        device = init_group(job, dist.FileStore(store_path, job.tp), job.rank)
        local = None
        if spawn_backend(job.device) == SHM:  # every rank on this host: no TCP for a step's small payloads
            local = shm_link.SharedMemoryLink(f"{store_path}.shm", job.rank, job.tp, job.timeout_s)
        outcome = run_rank(job, device, gate, local)
    except Exception as exc:  # noqa: BLE001 - joining the group failed
        outcome = RankOutcome(job.rank, 0, None, (), None, one_line(exc))
    finally:
        write_atomic(job.result_path, _json(outcome))
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001 - a broken group cannot be torn down cleanly; the process ends anyway
                pass
    os._exit(0 if outcome.error is None else 1)  # no interpreter teardown: a broken gloo pair can hang it


def _json(outcome: RankOutcome) -> str:
    import json

    return json.dumps(outcome.to_dict(), ensure_ascii=False)
