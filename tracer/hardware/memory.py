"""How much memory this machine can still give: the ceiling a preallocation is checked against before torch is
asked for it (torch's allocator fails with a RuntimeError, or the kernel's OOM killer ends the process), and what a
prefill's attention takes (it grows with the square of the prompt: refused before it starts when it cannot fit)."""

from __future__ import annotations

from llmtrace.tracer.core.errors import HardwareError


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


# Bytes per attention score a prefill holds at its peak in one layer: the (B, H, T, S) scores and their softmax side
# by side, 4 + 4 in fp32; a half-precision model's scores are 2 bytes, but its softmax runs in fp32 and is cast back
# (tracer/model/functional.py softmax_fp32), 2 + 4 + 2 while the cast runs. Measured on the bundled model in fp32
# (BENCHMARKS.md): peak RSS grew 0.96 GB from a 2,000- to a 4,000-token prompt, the scores' share 0.86 GB.
SCORE_BYTES = 8
FREE_SHARE = 0.9  # what a check lets one allocation take of MemAvailable (the rest: the page cache, others)


def prefill_attention_bytes(n_heads: int, batch: int, new: int, seen: int) -> int:
    """Peak bytes of one layer's attention in a step of `new` tokens over `seen` keys (the layers run one after
    another, so this is the prefill's peak above the weights and the KV cache): the scores and their softmax, and the
    (T, S) bool causal mask made while they are alive. Quadratic in the prompt: 4.7 GB for 8,000 tokens over 9
    heads, where the KV cache of the same prompt is 0.4 GB."""
    return batch * n_heads * new * seen * SCORE_BYTES + new * seen


def check_prefill_fits(n_heads: int, batch: int, new: int, seen: int) -> None:
    """HardwareError (one line: what it needs, what there is, what to do) when a prefill's attention would not fit
    in this machine's available memory; torch would otherwise fail mid-layer or the OOM killer end the process."""
    need = prefill_attention_bytes(n_heads, batch, new, seen)
    free = available_memory_bytes()
    if free is not None and need > free * FREE_SHARE:
        rows = f"{batch} rows × " if batch > 1 else ""
        raise HardwareError(
            f"a prefill of {new:,} tokens needs {need / 1e9:,.1f} GB for its attention scores ({rows}{n_heads} heads × "
            f"{new:,} × {seen:,} positions, one layer at a time), this machine has {free / 1e9:,.1f} GB free; give "
            "a shorter prompt" + (" or a smaller --batch" if batch > 1 else "") + ", or free memory")
