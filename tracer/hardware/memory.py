"""How much memory this machine can still give: the ceiling a preallocation is checked against before torch is
asked for it (torch's allocator fails with a RuntimeError, or the kernel's OOM killer ends the process)."""

from __future__ import annotations


def available_memory_bytes() -> int | None:
    """MemAvailable from /proc/meminfo (Linux), else None (no check)."""
    try:
        with open("/proc/meminfo", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None
