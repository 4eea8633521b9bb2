"""A long prompt's prefill says what it needs and is refused when that does not fit (issue 27, item 8): an 8,000-token
prompt on the bundled model grew past 3.5 GB without a word. Its attention's (B, H, T, S) scores and their softmax
grow with the square of the prompt (tracer/hardware/memory.py); the model refuses a step whose scores cannot fit
in the machine's available memory before its first layer, and `run` says what a large one will take."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from llmtrace.cli.app import app
from llmtrace.tracer.core.dtypes import FP32
from llmtrace.tracer.core.errors import HardwareError
from llmtrace.tracer.hardware import memory
from llmtrace.tracer.hardware.memory import prefill_attention_bytes
from llmtrace.tracer.load.loader import load_model

runner = CliRunner()


def test_the_bundled_models_8000_token_prompt_needs_4_7_gb() -> None:
    """SmolLM2-135M: 9 heads. 8,000² scores × 9 heads × (4 + 4 bytes) + the 8,000² bool mask."""
    assert prefill_attention_bytes(9, 1, 8000, 8000) == 8000 * 8000 * 9 * 8 + 8000 * 8000 == 4_672_000_000


def test_the_figure_is_the_tensors_a_layer_holds(tiny_llama_dir: Path) -> None:
    """Against the tensors themselves: the scores the model's AttentionScores returns and the probabilities its
    Softmax returns, in one layer of a staged prefill, plus the causal mask's (T, S) bools."""
    loaded = load_model(str(tiny_llama_dir), dtype=FP32)
    model = loaded.model
    model.staged = True
    held: list[int] = []
    layer = model.layers[0].attention
    hooks = [layer.scores.register_forward_hook(lambda m, a, out: held.append(out.numel() * out.element_size())),
             layer.softmax.register_forward_hook(lambda m, a, out: held.append(out.numel() * out.element_size()))]
    try:
        model.setup_cache(2, 32)
        model.prefill(torch.randint(3, 300, (2, 20)))
    finally:
        for hook in hooks:
            hook.remove()
    assert sum(held) + 20 * 20 == prefill_attention_bytes(model.config.n_heads, 2, 20, 20)


def test_a_prefill_that_does_not_fit_is_refused_before_its_first_layer(tiny_llama_dir: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    loaded = load_model(str(tiny_llama_dir), dtype=FP32)
    model = loaded.model
    model.setup_cache(1, 64)
    need = prefill_attention_bytes(model.config.n_heads, 1, 50, 50)
    monkeypatch.setattr(memory, "available_memory_bytes", lambda: int(need / memory.FREE_SHARE) - 1)
    ran: list[int] = []
    hook = model.layers[0].register_forward_pre_hook(lambda m, a: ran.append(1))
    try:
        with pytest.raises(HardwareError) as refused:
            model.prefill(torch.randint(3, 300, (1, 50)))
        assert not ran and model.pos == 0
        with pytest.raises(HardwareError):
            model(torch.randint(3, 300, (1, 50)))  # the cache-free forward (--no-kv-cache's replay) too
    finally:
        hook.remove()
    message = str(refused.value)
    assert message == (f"a prefill of 50 tokens needs {need / 1e9:.1f} GB for its attention scores (4 heads × 50 × 50 "
                       f"positions, one layer at a time), this machine has {(int(need / 0.9) - 1) / 1e9:.1f} GB free; "
                       "give a shorter prompt, or free memory")
    monkeypatch.setattr(memory, "available_memory_bytes", lambda: int(need / memory.FREE_SHARE) + 1)
    assert model.prefill(torch.randint(3, 300, (1, 50))).shape == (1, model.config.vocab_size)


def test_run_refuses_it_in_one_line(tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(memory, "available_memory_bytes", lambda: 10_000)
    result = runner.invoke(app, ["run", "The sky is blue and the grass is green", "--model", str(tiny_llama_dir),
                                 "--max-new-tokens", "1", "--no-roofline"])
    assert result.exit_code == 2, result.output
    assert result.stderr.count("\n") == 1 and "needs" in result.stderr and "GB free" in result.stderr
    assert "give a shorter prompt" in result.stderr


def test_run_says_what_a_large_prefill_will_take(tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The tiny model's scores are small: the note's threshold lowered to show the line as a large prompt gets."""
    from llmtrace.cli import run_stream

    monkeypatch.setattr(run_stream, "PREFILL_NOTE_BYTES", 1)
    result = runner.invoke(app, ["run", "sky", "--literal", "--model", str(tiny_llama_dir), "--max-new-tokens", "1",
                                 "--no-roofline"])
    assert result.exit_code == 0, result.output
    tokens = next(int(line.split("prefill of ")[1].split()[0]) for line in result.stdout.splitlines()
                  if "prefill of " in line)
    need = prefill_attention_bytes(4, 1, tokens, tokens)
    assert f"prefill of {tokens} tokens: its attention scores take {need / 1e9:,.1f} GB at their peak (4 heads × " \
           f"{tokens} × {tokens} positions, one layer at a time)" in result.stdout
