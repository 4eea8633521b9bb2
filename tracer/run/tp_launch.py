"""`llmtrace run --tp N`: start N ranks, watch them, stop them, and merge what they traced into one Trace.

Two ways to start the ranks:
- llmtrace itself (`run_tensor_parallel`): N processes by torch.multiprocessing's "spawn", meeting through a
  FileStore in a temporary folder (no port to find or collide on). The ranks ignore SIGINT; a Ctrl-C or SIGTERM of
  the launcher closes the StopGate, and every rank stops before the same step (the one after the furthest any rank
  has begun), so no collective is left half-entered. Each rank writes its outcome (trace, collectives, error) to a
  JSON file in that folder, partial when it failed.
- torchrun (`run_under_torchrun`): each process torchrun started runs one rank; at the end rank 0 gathers the others'
  outcomes over a gloo group and merges them. torchrun handles signals and failed ranks itself (it stops the rest).

Failure stays bounded: the process group has a timeout (a collective waits at most that long for a missing rank,
then raises), and the launcher's watchdog gives the ranks that long plus a grace period once any rank has failed or
a stop was asked, then kills what is left. A rank that dies or hangs ends the run with one line (`status`) and the
steps the other ranks completed.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from llmtrace.tracer.checkpoint.resolve import ResolvedModel
from llmtrace.tracer.core.errors import BadArgumentError, FileFormatError, LlmtraceError
from llmtrace.tracer.core.json_input import parse_json
from llmtrace.tracer.run.tp_worker import (OpenGate, RankJob, backend_for, init_group, run_rank, spawn_backend,
                                           spawned_rank)
from llmtrace.tracer.trace.run_trace import Trace, read_collective, read_link
from llmtrace.tracer.trace.tp_merge import RankTrace, merge_rank_traces
from llmtrace.tracer.trace.tp_records import STATUS_OK, TensorParallelRun

DEFAULT_TIMEOUT_S = 60.0
GRACE_S = 3.0  # after the process-group timeout: time for the ranks to write their outcomes
_NOT_STARTED = -1
_NEVER = 2**31 - 1


class StopGate:
    """Shared by the launcher and its ranks: each rank records the step it begins; `stop()` makes every rank stop
    before the step after the furthest one begun (a rank behind still finishes the steps the others are in)."""

    def __init__(self, tp: int, context: Any) -> None:
        self.lock = context.Lock()
        self.begun = context.Array("i", [_NOT_STARTED] * tp, lock=False)
        self.stop_at = context.Value("i", _NEVER, lock=False)

    def may_start(self, rank: int, step: int) -> bool:
        with self.lock:
            if step >= self.stop_at.value:
                return False
            self.begun[rank] = step
            return True

    def stop(self) -> None:
        with self.lock:
            if self.stop_at.value == _NEVER:
                self.stop_at.value = max(self.begun) + 1

    def furthest(self) -> int:
        return max(self.begun)

    def step_of(self, rank: int) -> int:
        return self.begun[rank]


@dataclass(frozen=True, slots=True)
class TensorParallelResult:
    trace: Trace | None  # None when no rank got as far as a trace
    status: str  # "ok" or the one line of what failed


def _where(step: int) -> str:
    """Where a rank was, from the step it last began: "while loading", "in the prefill", "in decode step 3"."""
    if step < 0:
        return "while loading"
    return "in the prefill" if step == 0 else f"in decode step {step}"


def check_tensor_parallel(model: str | None, tp: int, device: str, dtype: Any = None, weights: str | None = None
                          ) -> None:
    """Before any process starts: the model's heads split over `tp` (the one-line error names the valid N), the
    device has `tp` GPUs for NCCL, and a GGUF's shards (as `dtype` and `weights` hold them: the ranks' own load
    plan) split at block boundaries and fit in this machine's memory together."""
    from llmtrace.tracer.checkpoint.resolve import bundled_source, resolve_model
    from llmtrace.tracer.model.tensor_parallel import check_tp_split

    if tp < 1:
        raise BadArgumentError(f"--tp must be at least 1, got {tp}")
    resolved = resolve_model(bundled_source() if not model else model)
    config = resolved.config
    if (config.embed_scale or config.final_softcap) and tp > 1:  # the ranks' embed and logits apply neither yet
        raise BadArgumentError(f"run --tp {tp}: {config.name} scales its embeddings by √d (Gemma), which the ranks' "
                               "split does not apply yet; run it on one device (`roofline --tp` costs the split)")
    check_tp_split(config, tp)
    if device.startswith("cuda"):
        import torch

        have = torch.cuda.device_count()
        if have < tp:
            raise BadArgumentError(f"--tp {tp} on CUDA needs {tp} GPUs (one per rank), this machine has {have}; "
                                   f"use --tp {have} or fewer, or --device cpu")
        return
    if dtype is not None:
        check_shards_fit(resolved, tp, device, dtype, weights)


def check_shards_fit(resolved: ResolvedModel, tp: int, device: str, dtype: Any, weights: str | None) -> None:
    """A GGUF's `tp` shards held as stored, or an HF folder's (the `resolved` model): refused in one line (what they
    need together, what the machine has) when they exceed memory_fit.SHARE of the memory available, or when a split
    falls inside a block."""
    from llmtrace.tracer.checkpoint.resolve import HF
    from llmtrace.tracer.core.errors import HardwareError
    from llmtrace.tracer.hardware.memory import available_memory_bytes
    from llmtrace.tracer.load.gguf_shard import block_split_refusal
    from llmtrace.tracer.load.loader import plan_load
    from llmtrace.tracer.load.memory_fit import SHARE
    from llmtrace.tracer.load.stored_weights import STORED
    from llmtrace.tracer.load.tensor_parallel import shard_bytes

    plan = plan_load(resolved.source, dtype, device, weights=weights, resolved=resolved)
    header = plan.resolved.gguf_header
    hf = plan.resolved.kind == HF and plan.target.type == "cpu"
    if not hf and (header is None or plan.weights.mode != STORED):
        return  # dense ranks: each checks its own load (loader.check_fits)
    if header is not None:
        refusal = block_split_refusal(header, plan.resolved.config, tp)
        if refusal:
            raise BadArgumentError(refusal)
    need = [shard_bytes(plan, rank, tp) for rank in range(tp)]
    free = available_memory_bytes()
    if free is None or sum(need) <= free * SHARE:
        return
    name = Path(plan.resolved.path or "").name
    how = f"in {plan.compute.name}" if hf else f"as stored ({plan.weights.kernel})"
    raise HardwareError(f"--tp {tp}: the {tp} ranks' shards of {name} {how} need "
                        f"{sum(need) / 1e9:.1f} GB of memory together ({need[0] / 1e9:.2f} GB a rank), this machine "
                        f"has {free / 1e9:.1f} GB available; use a smaller model, or close what else is using the "
                        "memory")


def run_tensor_parallel(settings: Any, dtype: Any, tp: int, threads: int = 1, timeout_s: float = DEFAULT_TIMEOUT_S,
                        progress: Callable[[str], None] | None = None, fault: str | None = None) -> TensorParallelResult:
    """Run `settings`' generation over `tp` spawned ranks; the merged Trace (partial after a failure) and a status.

    `threads`: torch CPU threads per rank (N ranks x threads should not exceed the CPUs). `fault` is for tests
    ("die:<rank>:<step>" or "hang:<rank>:<step>", tracer/run/tp_worker.py)."""
    context = multiprocessing.get_context("spawn")
    gate = StopGate(tp, context)
    with tempfile.TemporaryDirectory(prefix="llmtrace-tp-") as folder:
        jobs = [RankJob(rank=r, tp=tp, model=settings.model or None, dtype=dtype, device=settings.device,
                        settings=settings, threads=threads, timeout_s=timeout_s,
                        result_path=str(Path(folder) / f"rank{r}.json"), fault=fault) for r in range(tp)]
        store = str(Path(folder) / "store")
        processes = [context.Process(target=spawned_rank, args=(job, store, gate), name=f"llmtrace-rank{job.rank}",
                                     daemon=True) for job in jobs]
        for p in processes:
            p.start()
        try:
            killed = _watch(processes, gate, timeout_s, progress)
        finally:
            for p in processes:  # nothing outlives the launcher, whatever happened
                if p.is_alive():
                    p.kill()
                p.join(timeout=5)
        outcomes = [_read_outcome(Path(job.result_path)) for job in jobs]
    codes = tuple(None if r in killed else p.exitcode for r, p in enumerate(processes))
    status = _status(outcomes, codes, killed, lambda rank: _where(gate.step_of(rank)), timeout_s)
    traces = [o.ranked for o in outcomes if o is not None and o.ranked is not None]
    link = next((o.link for o in outcomes if o is not None and o.link is not None), None)
    if not traces:
        errors = [o.error for o in outcomes if o is not None and o.error]
        raise TensorParallelFailed(errors[0] if errors and status == STATUS_OK else status)
    setup = TensorParallelRun(tp=tp, backend=spawn_backend(settings.device), launcher="spawn", threads_per_rank=threads,
                              timeout_s=timeout_s, link=link, status=status, exit_codes=codes)
    return TensorParallelResult(merge_rank_traces(traces, setup), status)


class TensorParallelFailed(LlmtraceError):
    """No rank of a tensor-parallel run got as far as a trace (the message is the first rank's error)."""


def _watch(processes: list[Any], gate: StopGate, timeout_s: float,
           progress: Callable[[str], None] | None) -> set[int]:
    """Wait for every rank; once one failed or a stop was asked, give the rest timeout + grace, then kill them.
    A second Ctrl-C kills at once. The ranks killed."""
    deadline: float | None = None
    interrupts = 0
    shown = None
    while True:
        try:
            alive = [p for p in processes if p.is_alive()]
            if not alive:
                return set()
            if deadline is None and any(p.exitcode not in (None, 0) for p in processes):
                deadline = time.monotonic() + timeout_s + GRACE_S
            if deadline is not None and time.monotonic() > deadline:
                break
            if progress is not None:
                step = gate.furthest()
                if step != shown:
                    shown = step
                    progress("loading the shards, timing the link" if step < 0 else f"ranks {_where(step)}")
            alive[0].join(timeout=0.1)
        except KeyboardInterrupt:
            interrupts += 1
            gate.stop()
            if interrupts > 1:
                break
            if deadline is None:
                deadline = time.monotonic() + timeout_s + GRACE_S
    killed = set()
    for rank, p in enumerate(processes):
        if p.is_alive():
            p.kill()
            killed.add(rank)
    return killed


@dataclass(frozen=True, slots=True)
class _Outcome:
    rank: int
    ranked: RankTrace | None  # None when the rank ended before its generation began
    link: Any
    error: str | None


def _read_outcome(path: Path) -> _Outcome | None:
    """A rank's outcome file, or None when it wrote none."""
    try:
        return _outcome(path.read_text(encoding="utf-8"))
    except OSError:
        return None


def _outcome(text: str) -> _Outcome:
    """A rank's outcome from its JSON (our own, read with the trace reader's checks: JSON, never pickle)."""
    data = parse_json(text, "rank outcome", FileFormatError, "this is a bug; report it")
    trace = None if data["trace"] is None else Trace.from_dict(data["trace"])
    collectives = tuple(read_collective(c) for c in data["collectives"])
    link = None if data["link"] is None else read_link(data["link"])
    ranked = None if trace is None else RankTrace(data["rank"], data["origin_ns"], trace, collectives)
    return _Outcome(data["rank"], ranked, link, data["error"])


def _status(outcomes: list[_Outcome | None], codes: tuple[int | None, ...], killed: set[int],
            where: Callable[[int], str], timeout_s: float) -> str:
    """"ok", or one line: the rank that failed first (died, hung, or raised), where, and what the others did."""
    for rank, outcome in enumerate(outcomes):
        if rank in killed and outcome is None:
            return (f"rank {rank} hung {where(rank)}: the others' collectives waited the "
                    f"{timeout_s:g} s process-group timeout; it was killed and the steps before are kept")
    for rank, outcome in enumerate(outcomes):
        if outcome is None:
            how = (f"died (exit code {codes[rank]})" if codes[rank] is not None
                   else "left no outcome (it died, or its launcher stopped it)")
            return f"rank {rank} {how} {where(rank)}; the steps the other ranks completed are kept"
    errors = [(o.rank, o.error) for o in outcomes if o is not None and o.error]
    if errors:
        rank, error = errors[0]
        return f"rank {rank} failed {where(rank)}: {error}"
    return STATUS_OK


# ---- torchrun ---------------------------------------------------------------------------------------------------


def torchrun_world() -> tuple[int, int, int] | None:
    """(rank, world size, local rank) when this process was started by torchrun (its environment), else None."""
    try:
        return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ.get("LOCAL_RANK", "0"))
    except (KeyError, ValueError):
        return None


def run_under_torchrun(settings: Any, dtype: Any, tp: int, threads: int = 1,
                       timeout_s: float = DEFAULT_TIMEOUT_S) -> TensorParallelResult | None:
    """This process's rank of a torchrun-started run (one process per rank; --tp must equal the world size).
    Rank 0 gathers every rank's outcome at the end and returns the merged result; the other ranks return None."""
    import torch
    import torch.distributed as dist

    where = torchrun_world()
    if where is None:
        raise BadArgumentError("not started by torchrun (RANK and WORLD_SIZE are not set)")
    rank, world, local_rank = where
    if world != tp:
        raise BadArgumentError(f"--tp {tp} but torchrun started {world} processes; pass --nproc-per-node {tp}")
    torch.set_num_threads(threads)
    job = RankJob(rank=rank, tp=tp, model=settings.model or None, dtype=dtype, device=settings.device,
                  settings=settings, threads=threads, timeout_s=timeout_s, result_path="")
    device = init_group(job, None, local_rank)
    outcome = run_rank(job, device, OpenGate())
    mine = json.dumps(outcome.to_dict(), ensure_ascii=False).encode("utf-8")
    try:
        payloads = _gather_bytes(mine, rank, world, timeout_s)
    except Exception:  # noqa: BLE001 - a rank is gone: rank 0 keeps its own outcome
        payloads = [mine] if rank == 0 else []
    finally:
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - a broken group cannot be torn down cleanly
            pass
    if rank != 0:
        return None
    outcomes: list[_Outcome | None] = [None] * world
    for payload in payloads:
        o = _outcome(payload.decode("utf-8"))
        outcomes[o.rank] = o
    steps = {o.rank: len(o.ranked.trace.steps) - 1 if o.ranked else -1 for o in outcomes if o is not None}
    status = _status(outcomes, (None,) * world, set(), lambda r: _where(steps.get(r, -1)), timeout_s)
    traces = [o.ranked for o in outcomes if o is not None and o.ranked is not None]
    if not traces:
        raise TensorParallelFailed(outcome.error or status)
    setup = TensorParallelRun(tp=tp, backend=backend_for(settings.device), launcher="torchrun",
                              threads_per_rank=threads, timeout_s=timeout_s, link=outcome.link, status=status,
                              exit_codes=(None,) * world)
    return TensorParallelResult(merge_rank_traces(traces, setup), status)


def _gather_bytes(payload: bytes, rank: int, world: int, timeout_s: float) -> list[bytes]:
    """Every rank's `payload` on rank 0 (others get []), over a gloo group (NCCL runs too: bytes stay on the CPU)."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
    size = torch.tensor([len(payload)], dtype=torch.int64)
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(sizes, size, group=group)
    longest = int(max(s.item() for s in sizes))
    mine = torch.zeros(longest, dtype=torch.uint8)
    mine[: len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    parts = [torch.zeros(longest, dtype=torch.uint8) for _ in range(world)]
    dist.all_gather(parts, mine, group=group)
    if rank != 0:
        return []
    return [p[: int(n.item())].numpy().tobytes() for p, n in zip(parts, sizes)]
