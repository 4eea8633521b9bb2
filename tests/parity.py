"""Greedy parity against transformers, shared by the architecture tests (test_qwen3, test_mixtral and the MoE files
that import from it, test_gemma3): the same random prompt, transformers' greedy generation with its logits, and the
same loop through a llmtrace backend."""

from __future__ import annotations

from typing import Any

import torch

from llmtrace.tracer.run.backends import backend_for
from llmtrace.tracer.run.select import Request


def prompt_ids(vocab_size: int, length: int) -> torch.Tensor:
    """(1, length) random ids past the special ones (0-2), the same for every test (seed 5)."""
    return torch.randint(3, vocab_size, (1, length), generator=torch.Generator().manual_seed(5))


@torch.no_grad()
def hf_greedy(hf: torch.nn.Module, prompt: torch.Tensor, steps: int) -> tuple[list[int], torch.Tensor]:
    """transformers' `steps` greedy tokens after `prompt` and the logits (steps, V) it chose them from."""
    out = hf.generate(prompt, max_new_tokens=steps, min_new_tokens=steps, do_sample=False, eos_token_id=None,
                      pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    return out.sequences[0, prompt.shape[1]:].tolist(), torch.cat(out.logits)


@torch.no_grad()
def greedy_run(run: Any, prompt: torch.Tensor, steps: int) -> tuple[list[int], torch.Tensor]:
    """The same through a llmtrace backend (tracer/run/backends.py's prefill and decode): ids and logits (steps, V)."""
    logits = [run.prefill(prompt)[0]]
    ids = [int(logits[-1].argmax())]
    for _ in range(steps - 1):
        logits.append(run.decode(torch.tensor([[ids[-1]]]))[0])
        ids.append(int(logits[-1].argmax()))
    return ids, torch.stack(logits)


def count_c_steps(run: Any, backend: str) -> list[int]:
    """A list that grows by one per decode step the C step ran on `run`'s plan (its logits, not None: not the torch
    fallback): the native_decode's for backend "native", staged_step's for "native-staged"."""
    name = "staged_step" if backend == "native-staged" else "native_decode"
    original, calls = getattr(run.plan, name), []

    def counted(*args: object) -> torch.Tensor | None:
        out = original(*args)
        calls.extend([] if out is None else [1])
        return out

    setattr(run.plan, name, counted)
    return calls


@torch.no_grad()
def left_padded_gaps(model: Any, long: torch.Tensor, pad: int, backend: str, steps: int = 3) -> list[float]:
    """Prompts `long` (T,) and its last T - pad tokens in one batch of two on `backend`, the shorter left-padded with
    `pad` zeros: for each row, the largest gap between its logits in the batch (the prefill, then `steps` decode
    steps, each row fed the token its run alone chose) and its logits run alone."""
    short = long[pad:]
    batch = torch.stack([long, torch.cat([torch.zeros(pad, dtype=torch.long), short])])
    positions = long.shape[0] + steps + 1
    alone = []
    for prompt in (long, short):
        model.setup_cache(1, positions)
        run = backend_for(model, Request(backend=backend))
        logits = [run.prefill(prompt.view(1, -1))[0]]
        for _ in range(steps):
            logits.append(run.decode(logits[-1].argmax().view(1, 1))[0])
        alone.append(torch.stack(logits))
    model.setup_cache(2, positions)
    run = backend_for(model, Request(batch=2, backend=backend))
    together = [run.prefill(batch, [0, pad])]
    for step in range(steps):
        together.append(run.decode(torch.stack([alone[0][step].argmax(), alone[1][step].argmax()]).view(2, 1)))
    stacked = torch.stack(together)  # (steps + 1, 2, V)
    return [(stacked[:, row] - alone[row]).abs().max().item() for row in range(2)]
