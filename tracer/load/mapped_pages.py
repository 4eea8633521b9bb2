"""Giving a memory-mapped checkpoint's pages back once their bytes have been copied out.

The HF loader reads a checkpoint through a private (copy-on-write) map of its files: reading a tensor faults its
pages into this process, where they count in its resident memory until the kernel reclaims them, which it does only
under pressure. A tensor the loader copies out (converted to another dtype, packed with the others of its fused
product) is never read from the map again, so without this its pages stay resident beside the copy: a bf16 7B
folder's 9 GB of Q|K|V and gate|up twice over. (GGUF files are read with pread into their final memory:
tracer/load/gguf_source.py.) `release` drops them (madvise MADV_DONTNEED: for a
private map of an unchanged file, the next read would fault the file's same bytes back in, so views of the map stay
valid); pages a tensor shares with a neighbour that is still read (at its ends) are kept.
"""

from __future__ import annotations

import mmap
from typing import Any

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
