"""How a generation uses its backend (tracer/run/backends.py): the cache set up, the Request `select` is asked, the
tracer that follows the backend chosen, the warm-up, and each step's call (a traced forward, or several steps run
ahead in C); the Generation loop (tracer/run/generate.py) takes these from RunBackend, BatchGeneration overrides the
parts a batch does its own way."""

from __future__ import annotations

import time

import numpy as np
import torch

from llmtrace.tracer.model.native_step import AheadRun
from llmtrace.tracer.run.backends import matvec_of
from llmtrace.tracer.run.sampling import SampleResult
from llmtrace.tracer.run.select import Request
from llmtrace.tracer.trace.hooks import Tracer
from llmtrace.tracer.trace.records import PACKED, PREFILL
from llmtrace.tracer.trace.routing import routing_step
from llmtrace.tracer.trace.stage_clock import reads_host_clock


class RunBackend:
    """The backend half of a Generation (its model, settings, sampler, tracer, selection and backend)."""

    def _set_up_cache(self, ids: list[int], limit: int) -> None:
        self.model.setup_cache(1, len(ids) + limit)
        self._kv_allocated = int(self.model.kv_allocated_bytes)  # fixed until the next setup_cache

    @staticmethod
    def _prompt_length(ids: list[int]) -> int:
        return len(ids)

    def _request(self, batch: int = 1) -> Request:
        """What the run asks of the backend (tracer/run/select.py), asked with the observers attached."""
        return Request(batch=batch, staged=self.settings.staged, observed=self._observer is not None,
                       traced=self.settings.trace, host_clock=reads_host_clock(self._tracer.clock),
                       sampler=self.sampler, run_ahead=self._run_ahead, on_cpu=self._on_cpu,
                       backend=self._asked_backend, matvec=matvec_of(getattr(self.loaded, "kernels", None)))

    def _new_tracer(self) -> Tracer:
        """A tracer of the run's backend: the fused path's marks when it runs the packed path, else the modules'
        wrappers (and, under --staged's native backend, the C step's readings)."""
        packed = self._selection.route is not None and self._selection.route.prefill == PACKED
        return Tracer(self.model, self.origin_ns, enabled=self.settings.trace, mechanism="fused" if packed else "wrap")

    def _warm_up(self, ids: list[int]) -> None:
        """One untimed prefill of the prompt and one decode step, then an empty cache: the first call of a kernel
        for a shape pays one-off set-up (oneDNN's bf16/AMX kernels took ~40x a layer's time in the first prefill),
        which a profile of steady-state work must not show as layer 0's cost. It takes the run's backend, untraced.
        Where every product runs in the C library (the plan has a native step: a GGUF on the default kernels), no
        product has a per-shape set-up, and the prompt's first token warms the rest as well, at a fraction of a
        whole prefill's cost (at 7B a 6-token prompt's untimed prefill was ~0.5 s of a first run: issue 31)."""
        plan = self._selection.plan if self._selection is not None else None
        if plan is not None and plan.native is not None:
            ids = ids[:1]
        tokens = torch.tensor([ids], dtype=torch.long, device=self.device)  # (1, T)
        try:
            with torch.no_grad():
                self._untraced.prefill(tokens)
                self._untraced.decode(tokens[:, -1:])  # (1, 1)
        finally:
            self.model.reset_cache()
        if self._sync is not None:
            self._sync()

    def _forward(self, phase: str, index: int, tokens: torch.Tensor,
                 pad: list[int] | None = None) -> tuple[torch.Tensor, int, int]:
        """One traced forward of tokens (B, T), prefill or decode_one: the logits (B, V), its start and end."""
        sync = self._sync
        self._tracer.begin_step(phase, index)
        if sync is not None:
            sync()
        start = time.perf_counter_ns()
        logits = self._backend.prefill(tokens, pad) if phase == PREFILL else self._backend.decode(tokens)  # (B, V)
        if sync is not None:
            sync()
        forward_end = time.perf_counter_ns()
        self._tracer.end_step()
        if self.config.moe is not None and not self.dry_run:  # read after the clocks: the route stages' last choice
            routed = routing_step(self.model, phase, index)
            if routed is not None:
                self._routing.append(routed)
        return logits, start, forward_end

    def _token_tensor(self, ids: list[int]) -> torch.Tensor:
        """The ids as a (1, T) int64 tensor on the model's device. On the CPU through numpy: torch.tensor() parses a
        nested list and dispatches a copy, tens of microseconds right after a model step has evicted the caches
        (bench_token_overhead). A decode step's one id is written into the run's one (1, 1) tensor, made once: the
        model reads its ids during the step and keeps no reference to them."""
        if not self._on_cpu:
            return torch.tensor([ids], dtype=torch.long, device=self.device)  # (1, T)
        if len(ids) != 1:
            return torch.from_numpy(np.array([ids], dtype=np.int64))  # (1, T); a fresh array: nothing aliases it
        if self._decode_ids is None:
            self._decode_ids = np.zeros((1, 1), dtype=np.int64)
            self._decode_tensor = torch.from_numpy(self._decode_ids)  # (1, 1), sharing the array's memory
        self._decode_ids[0, 0] = ids[0]
        return self._decode_tensor

    def _decode_ahead(self, token: int, steps: int, eos: int | None) -> tuple[AheadRun, list[SampleResult]] | None:
        """The native backend's run of up to `steps` steps from `token`, the sampler choosing each next token from
        the step's logits as `_step` has it choose (the prompt and every token so far for its penalty); the run and
        the sampler's results, in order (one more than the run's steps when the sampler raised on the last)."""
        results: list[SampleResult] = []
        previous = self._prompt_ids_and_generated()

        def choose(logits: np.ndarray) -> int:
            result = self.sampler.sample(logits, previous)
            results.append(result)
            previous.append(int(result.token_id))
            return int(result.token_id)

        run = self._backend.ahead(token, steps, eos, choose, self.settings.trace)
        return None if run is None else (run, results)
