"""The shared-memory collectives of a spawned CPU run's ranks (tracer/run/shm_link.py): three processes exchange
sums and gathers of several sizes and dtypes, each checked against the exact sum and against every other rank's
bits; a payload past a slot is left to gloo; a rank that never arrives ends the wait in one line."""

from __future__ import annotations

import multiprocessing
from pathlib import Path

import pytest
import torch

from llmtrace.tracer.run import shm_link
from llmtrace.tracer.run.shm_link import SLOT_BYTES, SharedMemoryLink

pytestmark = pytest.mark.skipif(not shm_link.available(), reason="shared-memory collectives run on x86-64 only")
WORLD = 3
CASES = [(torch.float32, (4096,)), (torch.float32, (1, 7, 576)), (torch.bfloat16, (1, 1, 4096)),
         (torch.float32, (SLOT_BYTES // 4,))]  # the last fills a slot exactly


def _values(rank: int, dtype: torch.dtype, shape: tuple[int, ...], round_: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * round_ + 10 * rank + len(shape))
    return torch.randn(shape, generator=g).to(dtype)


def _rank(path: str, rank: int, out: str) -> None:
    link = SharedMemoryLink(path, rank, WORLD, timeout_s=60.0)
    results = []
    for round_ in range(3):  # both buffers, each reused
        for dtype, shape in CASES:
            x = _values(rank, dtype, shape, round_)
            assert link.fits(x)
            gathered = link.all_gather(x)
            results.append((torch.stack(gathered), link.all_reduce(x.clone())))
    torch.save(results, out)


def test_three_ranks_sum_and_gather_alike(tmp_path: Path) -> None:
    context = multiprocessing.get_context("spawn")
    path = str(tmp_path / "link")
    outs = [str(tmp_path / f"rank{r}.pt") for r in range(WORLD)]
    processes = [context.Process(target=_rank, args=(path, r, outs[r])) for r in range(WORLD)]
    for p in processes:
        p.start()
    for p in processes:
        p.join(timeout=120)
        assert p.exitcode == 0
    per_rank = [torch.load(o) for o in outs]
    i = 0
    for round_ in range(3):
        for dtype, shape in CASES:
            parts = [_values(r, dtype, shape, round_) for r in range(WORLD)]
            want = parts[0].clone()
            for p in parts[1:]:
                want += p  # rank order, in the payload's dtype
            for gathered, reduced in (results[i] for results in per_rank):
                assert torch.equal(gathered, torch.stack(parts))
                assert reduced.dtype == dtype and torch.equal(reduced, want)
            i += 1


def test_a_payload_past_a_slot_is_not_taken_and_a_missing_rank_times_out(tmp_path: Path) -> None:
    link = SharedMemoryLink(tmp_path / "link", 0, 2, timeout_s=0.2)
    assert not link.fits(torch.zeros(SLOT_BYTES // 4 + 1))
    assert not link.fits(torch.zeros(4, device="meta"))
    with pytest.raises(TimeoutError, match=r"^shared-memory collective 1: rank 1 did not arrive within 0.2 s$"):
        link.all_reduce(torch.ones(8))
