"""What the sampler is asked to do, checked: the declarative half of tracer/run/sampling.py, without torch or numpy,
so `run` refuses a bad --temperature or --top-k before torch is imported (milliseconds, not the seconds torch takes).

The messages name the command-line options (--top-k, not top_k): the person who reads them typed the options.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from numbers import Real
from typing import Sequence

from llmtrace.tracer.core.errors import BadArgumentError
from llmtrace.tracer.core.json_input import is_int

# The least temperature a draw takes: logits of a few hundred divided by it stay far inside fp32 (3.4e38), and it is
# already the argmax's draw for any two logits apart by more than 1e-4 (their weights differ by e^100).
MIN_TEMPERATURE = 1e-6

STEP_ORDER = ("repetition_penalty", "temperature", "greedy", "top_k", "top_p", "min_p")

MAX_TEMPERATURES = 6  # the sampling lesson's columns beyond this no longer fit 80 columns side by side


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How to pick the next token. Neutral values switch a step off (HF's conventions)."""

    temperature: float = 0.0  # 0 = greedy (argmax); > 0 samples from softmax(logits / T)
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off; in (0, 1]
    min_p: float = 0.0  # 0 = off; in [0, 1)
    repetition_penalty: float = 1.0  # 1 = off; > 0 (> 1 discourages repeats)
    seed: int | None = None  # None = a fresh random seed, reported by Sampler.seed

    def __post_init__(self) -> None:
        self._check_temperature()
        if not is_int(self.top_k) or self.top_k < 0:
            raise BadArgumentError(f"--top-k must be a whole number >= 0 (0 turns it off), got {self.top_k!r}")
        check_real("--top-p", self.top_p)
        if not 0 < self.top_p <= 1:
            raise BadArgumentError(f"--top-p must be in (0, 1] (1 turns it off), got {self.top_p}")
        check_real("--min-p", self.min_p)
        if not 0 <= self.min_p < 1:
            raise BadArgumentError(f"--min-p must be in [0, 1) (0 turns it off), got {self.min_p}")
        check_real("--repetition-penalty", self.repetition_penalty)
        if not self.repetition_penalty > 0:
            raise BadArgumentError("--repetition-penalty must be > 0 (1 turns it off, 1.1-1.3 is typical), got "
                                   f"{self.repetition_penalty}")
        if self.seed is not None and (not is_int(self.seed) or not 0 <= self.seed < 2**64):
            raise BadArgumentError(f"--seed must be a whole number in [0, 2**64), got {self.seed!r}")
        if self.greedy:
            ignored = [name for name, on in (("--top-k", self.top_k > 0), ("--top-p", self.top_p < 1),
                                             ("--min-p", self.min_p > 0)) if on]
            if ignored:
                verb = "has" if len(ignored) == 1 else "have"
                raise BadArgumentError(f"{' and '.join(ignored)} {verb} no effect when --temperature is 0 (greedy); "
                                       "give --temperature > 0 (e.g. 0.7) to sample")

    def _check_temperature(self) -> None:
        check_real("--temperature", self.temperature)
        if not self.temperature >= 0:
            raise BadArgumentError(f"--temperature must be >= 0 (0 means greedy), got {self.temperature}")
        if 0 < self.temperature < MIN_TEMPERATURE:  # logits / T in fp32 overflow, or T itself rounds to 0 there
            raise BadArgumentError(f"--temperature must be 0 (greedy) or at least {MIN_TEMPERATURE:g}, got "
                                   f"{self.temperature:g}: below, the logits divided by it overflow fp32; use 0 for "
                                   "the most likely token")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def active_steps(self) -> tuple[str, ...]:
        """The steps that change anything, in the order they run."""
        on = {
            "repetition_penalty": self.repetition_penalty != 1,
            "temperature": not self.greedy and self.temperature != 1,
            "greedy": self.greedy,
            "top_k": self.top_k > 0,
            "top_p": self.top_p < 1,
            "min_p": self.min_p > 0,
        }
        return tuple(step for step in STEP_ORDER if on[step])


def check_temperatures(temperatures: Sequence[float]) -> tuple[float, ...]:
    """The sampling lesson's temperatures (--temperatures) as a tuple, or BadArgumentError naming the bad one."""
    values = tuple(float(t) for t in temperatures)
    if len(values) > MAX_TEMPERATURES:
        raise BadArgumentError(f"--temperatures takes at most {MAX_TEMPERATURES} values, got {len(values)}")
    for t in values:
        if not math.isfinite(t) or t <= 0:
            raise BadArgumentError(f"--temperatures values must be finite and > 0 (greedy is the T -> 0 limit), "
                                   f"got {t:g}")
    return values


def check_real(name: str, value: object) -> None:
    """BadArgumentError unless `value` is a finite real number (numpy's floats too), not a bool."""
    if isinstance(value, bool) or not isinstance(value, Real) or not math.isfinite(value):
        raise BadArgumentError(f"{name} must be a finite number, got {value!r}")
