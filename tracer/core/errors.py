"""Typed exceptions. Each message is one line that says what was wrong and what to do; the CLI prints it as is."""

from __future__ import annotations

from typing import Any


def short_repr(value: Any) -> str:
    """A value as an error line quotes it: its repr, cut at 60 characters."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


class LlmtraceError(Exception):
    """Base class: anything the user can fix by changing their input."""


class ConfigError(LlmtraceError):
    """A model config is missing, unreadable, or lacks a field."""


class UnknownPresetError(ConfigError):
    """A --model name matches no preset and no path."""


class UnsupportedModelError(LlmtraceError):
    """An architecture, quantization or feature llmtrace does not handle."""


class CheckpointError(LlmtraceError):
    """Weights that are missing, truncated, corrupt, or do not match the config."""


class FileFormatError(CheckpointError):
    """A GGUF or safetensors file whose header is truncated or malformed."""


class BadArgumentError(LlmtraceError):
    """A numeric or enum argument out of range (seq <= 0, unknown dtype, ...)."""


class HardwareError(LlmtraceError):
    """An unknown hardware profile or a deployment that does not fit."""
