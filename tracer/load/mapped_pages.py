"""Pages of this process's maps: given back once their bytes have been copied out, or faulted in ahead of use.

The HF loader reads a checkpoint through a private (copy-on-write) map of its files: reading a tensor faults its
pages into this process, where they count in its resident memory until the kernel reclaims them, which it does only
under pressure. A tensor the loader copies out (converted to another dtype, packed with the others of its fused
product) is never read from the map again, so without this its pages stay resident beside the copy: a bf16 7B
folder's 9 GB of Q|K|V and gate|up twice over. `release` drops them (madvise MADV_DONTNEED: for a
private map of an unchanged file, the next read would fault the file's same bytes back in, so views of the map stay
valid); pages a tensor shares with a neighbour that is still read (at its ends) are kept.

`populating_backwards` faults ranges in on a second thread, the last first, while the caller works through them
from the first: the weight arena's fresh pages (MADV_POPULATE_WRITE: tracer/load/weight_arena.py) and the file's
mapped ones (MADV_POPULATE_READ: tracer/load/file_map.py), each fault's work on the other core.
"""

from __future__ import annotations

import ctypes
import mmap
import sys
import threading
from contextlib import contextmanager
from typing import Any, Iterator, Sequence

_DONTNEED = getattr(mmap, "MADV_DONTNEED", None)  # Linux, macOS, BSDs; None on Windows (nothing released there)


def release(mapped: Any, start: int, nbytes: int) -> None:
    """Drop the whole pages of bytes start..start+nbytes of `mapped` (an mmap.mmap, or a numpy memmap whose base
    is one) from this process's resident memory."""
    base = mapped if isinstance(mapped, mmap.mmap) else getattr(mapped, "base", None)
    if _DONTNEED is None or not isinstance(base, mmap.mmap) or nbytes <= 0:
        return
    first = -(-start // mmap.PAGESIZE) * mmap.PAGESIZE  # the first page boundary at or after start
    end = (start + nbytes) // mmap.PAGESIZE * mmap.PAGESIZE
    if end > first:
        try:
            base.madvise(_DONTNEED, first, end - first)
        except (OSError, ValueError):  # a platform that refuses the advice: the pages stay, as before
            pass


def views(tensors: Any, mapped: Any) -> bool:
    """Whether any of `tensors` (torch tensors or numpy arrays) points into `mapped` (a numpy array over the map)."""
    low = mapped.ctypes.data
    high = low + mapped.nbytes
    for t in tensors:
        address = t.data_ptr() if hasattr(t, "data_ptr") else t.ctypes.data
        if low <= address < high:
            return True
    return False


MADV_POPULATE_READ = 22  # linux/mman.h (5.14): fault the range in, readable, as a read of each page would
MADV_POPULATE_WRITE = 23  # the same, writable, as a write to each page would
POPULATE_STEP = 32 << 20  # faulted per call: the thread stops within one step of being asked to


class Populating:
    """What a populating thread did: `bytes` faulted in (0 where the kernel lacks the advice)."""

    def __init__(self) -> None:
        self.bytes = 0


@contextmanager
def populating_backwards(ranges: Sequence[tuple[int, int]], advice: int) -> Iterator[Populating]:
    """For the block: a second thread faults `ranges` ((address, bytes) in this process's maps) in with madvise
    `advice`, the last range first and each from its end, POPULATE_STEP bytes a call (ctypes drops the GIL for
    it), while the caller works through them from the first. Contents never change: a page already there is left as
    it is, and after the block the thread walks the rest of the ranges (pages the caller touched: nothing to fault).
    The thread stops at its first failed call (not Linux, a kernel before 5.14: EINVAL; a file that shrank: EFAULT),
    the caller's own touches faulting the pages in instead, and within a step when the block raises."""
    done = Populating()
    if not ranges or not sys.platform.startswith("linux"):
        yield done
        return
    stop = threading.Event()
    thread = threading.Thread(target=_populate, args=(list(ranges), advice, stop, done), daemon=True,
                              name="llmtrace-populate")
    thread.start()
    try:
        yield done
    except BaseException:
        stop.set()  # the load failed: no more pages for memory about to be dropped
        raise
    finally:
        thread.join()


def _populate(ranges: list[tuple[int, int]], advice: int, stop: threading.Event, done: Populating) -> None:
    madvise = ctypes.CDLL(None, use_errno=True).madvise
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    page = mmap.PAGESIZE
    for address, nbytes in reversed(ranges):
        low = address // page * page
        high = -(-(address + nbytes) // page) * page
        while high > low:
            if stop.is_set():
                return
            at = max(low, (high - POPULATE_STEP) // page * page)
            if madvise(at, high - at, advice) != 0:
                return
            done.bytes += high - at
            high = at
