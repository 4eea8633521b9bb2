"""Issue 31 items 1 and 4: the same command on the same machine gives the same kernels, tokens and logits every time
(nothing measured: two fresh runs, fresh config and cache folders, compared bit for bit), and without a C compiler
one line says so and the fallback is the table's fastest torch path for each format."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import gguf
import pytest
import torch
from typer.testing import CliRunner

from llmtrace.cli.app import app
from llmtrace.tracer.core.dtypes import AUTO
from llmtrace.tracer.hardware import kernel_defaults as table
from llmtrace.tracer.load import kernel_pick
from llmtrace.tracer.load.loader import load_model
from llmtrace.tracer.model import native_kernel

Q = gguf.GGMLQuantizationType
REPO = Path(__file__).resolve().parent.parent


def _fresh_run(tmp: Path) -> dict:
    """`llmtrace run` of the bundled model in a process of its own, with its own config and cache folders."""
    env = {**os.environ, "XDG_CONFIG_HOME": str(tmp / "config"), "LLMTRACE_CACHE_DIR": str(tmp / "cache")}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (env.get("PYTHONPATH"), str(REPO)) if p)  # this tree's llmtrace
    tmp.mkdir()
    out = tmp / "trace.json"
    proc = subprocess.run([sys.executable, "-m", "llmtrace", "run", "capital", "--max-new-tokens", "6", "--json",
                           str(out), "--no-roofline", "--temperatures", "", "--trace-steps", "first"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "measur" not in proc.stdout  # nothing timed to decide the kernels
    return json.loads(out.read_text(encoding="utf-8"))


def test_two_fresh_runs_give_the_same_kernels_ids_and_logits(tmp_path: Path) -> None:
    first, second = (_fresh_run(tmp_path / name) for name in ("a", "b"))
    assert first["kernels"] == second["kernels"] and first["kernels"]["source"] == "default"
    assert first["generated_ids"] == second["generated_ids"]
    logits = [[[c["logit"] for c in step["candidates"]] for step in run["steps"]] for run in (first, second)]
    assert logits[0] == logits[1] and len(logits[0]) == 6  # bit for bit: JSON keeps every float's digits


def test_two_fresh_loads_give_the_same_logits_bit_for_bit() -> None:
    runs = []
    for _ in range(2):
        loaded = load_model(None, AUTO, use_cache=False)
        model = loaded.model
        model.setup_cache(1, 16)
        with torch.no_grad():
            out = [model.prefill(torch.tensor([[1, 504, 3458, 282, 4649, 314]]))[:, -1]]
            for token in (5456, 30, 216):
                out.append(model.decode_one(torch.tensor([[token]])))
        runs.append((loaded.kernels, torch.cat([o.reshape(-1) for o in out])))
    assert runs[0][0] == runs[1][0]
    assert torch.equal(runs[0][1], runs[1][1])


@pytest.fixture
def no_compiler(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The compiler lookup finds nothing (CC names no program), in a build folder of the test's own."""
    monkeypatch.setenv(native_kernel.DIR_ENV, str(tmp_path / "native"))
    monkeypatch.setenv(native_kernel.CC_ENV, str(tmp_path / "no-such-cc"))
    native_kernel.reset()
    yield
    native_kernel.reset()


def test_without_a_compiler_one_line_and_the_fastest_torch_path(no_compiler: None,
                                                                  tiny_quantized: Callable[..., Path]) -> None:
    assert kernel_pick.instruction_set(torch.device("cpu")) == table.NO_COMPILER
    mixed = load_model(str(tiny_quantized(Q.Q4_1, head=Q.Q8_0)), AUTO, use_cache=False)
    # Q4_1 on torch's int4 kernel; the Q8_0 head dense fp32, which the table has faster than the "blocks" kernel
    assert mixed.kernels.picked == "Q4_1:int4pack" and mixed.weights.kernel == "Q4_1:int4pack"
    assert [(b.type, b.kernel) for b in mixed.kernels.by_type] == [("Q4_1", "int4pack"), ("Q8_0", "dense")]
    formats = {name: w.format.kernel for name, w in mixed.model.stored_weights().items()}
    assert "output" not in formats and formats["layers.0.attention.wq"] == "int4pack"  # the head: dense
    note = mixed.kernel_note
    assert note.startswith("no C compiler: `") and "\n" not in note
    assert ("Q4 matrices run on torch's int4 kernel and the rest dequantized; decode is several times slower "
            "(3-10x") in note
    q8 = load_model(str(tiny_quantized(Q.Q8_0)), AUTO, use_cache=False)
    assert q8.weights.mode == "dense" and q8.kernels.picked == "fp32" and "no C compiler" in q8.kernel_note


def test_without_a_compiler_run_says_so_in_one_line(no_compiler: None, tiny_quantized: Callable[..., Path]) -> None:
    result = CliRunner().invoke(app, ["run", "sky", "-m", str(tiny_quantized(Q.Q4_1)), "--max-new-tokens", "1",
                                      "--no-trace", "--no-roofline", "--temperatures", ""], terminal_width=200)
    assert result.exit_code == 0, result.output
    text = " ".join(result.output.split())  # warnings are wrapped to the terminal: one note, however wrapped
    assert text.count("note:") == 1 and "note: no C compiler: `" in text
    assert "kernels Q4_1 int4pack (bf16) · default, no C compiler" in result.output


@pytest.mark.parametrize("isa, expected", [(table.AVX512_VNNI, "mm"), (table.AVX2, "mv")])
def test_a_bf16_folders_one_token_products_take_the_tables_kernel(isa: str, expected: str, tmp_path: Path,
                                                                  make_tiny_llama: Callable[..., Path],
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """The table's float column: on AVX-512 a bf16 checkpoint's one-token products run through mm (torch's bf16 mv
    streamed 11.8 GB/s there, mm 20.1: BENCHMARKS.md), on AVX2 through torch.mv; the decode that runs is the one named,
    and both give the same logits to bf16's rounding."""
    from safetensors.torch import load_file, save_file

    from llmtrace.tracer.run.backends import backend_for, matvec_of
    from llmtrace.tracer.run.select import Request

    folder = tmp_path / "bf16"
    source = make_tiny_llama("default")
    folder.mkdir()
    for name in ("config.json", "tokenizer.model", "tokenizer_config.json"):
        (folder / name).write_bytes((source / name).read_bytes())
    tensors = {k: v.to(torch.bfloat16) for k, v in load_file(str(source / "model.safetensors")).items()}
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    monkeypatch.setattr(kernel_pick, "instruction_set", lambda device, build=True: isa)
    loaded = load_model(str(folder), dtype=AUTO, use_cache=False)
    assert loaded.kernels.dtype == "bf16" and loaded.kernels.decode_kernel == expected
    assert matvec_of(loaded.kernels) == expected
    model = loaded.model
    logits = {}
    for kernel in ("mv", "mm"):
        model.setup_cache(1, 8)
        run = backend_for(model, Request(matvec=kernel))
        run.prefill(torch.tensor([[3, 4, 5]]))
        calls: list[int] = []
        real_mv = torch.mv
        monkeypatch.setattr(torch, "mv", lambda *a: calls.append(1) or real_mv(*a))
        logits[kernel] = run.decode(torch.tensor([[6]])).float()
        monkeypatch.setattr(torch, "mv", real_mv)
        assert bool(calls) is (kernel == "mv")
    torch.testing.assert_close(logits["mm"], logits["mv"], rtol=0.02, atol=0.02)
