"""Placeholder module replaced by the analytical commands (flops, kvmem, models)."""
