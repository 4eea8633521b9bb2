"""Shared fixtures. Each owner adds a section; keep fixtures cheap or session-scoped."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest
from tiny_llama import hf_config_dict, train_sentencepiece, write_tiny_llama

# ---- a test's own cache and config folders --------------------------------------------------------------------


@pytest.fixture
def private_dirs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """LLMTRACE_CACHE_DIR and XDG_CONFIG_HOME inside the test's tmp_path, so a test that loads a model reads and
    writes no weights cache, tuned kernel choice or config of the user's (or of another test). A module opts in
    with `pytestmark = pytest.mark.usefixtures("private_dirs")`; returns tmp_path."""
    monkeypatch.setenv("LLMTRACE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    return tmp_path


# ---- tiny LLaMA folders (model engineer) -------------------------------------------------------------------------


@pytest.fixture(scope="session")
def sp_model_bytes() -> bytes:
    """A SentencePiece BPE tokenizer.model trained on sample_prompts/ (byte fallback; ids 0/1/2 = unk/bos/eos)."""
    return train_sentencepiece()


@pytest.fixture(scope="session")
def sp_vocab_size(sp_model_bytes: bytes) -> int:
    import sentencepiece as spm

    return spm.SentencePieceProcessor(model_proto=sp_model_bytes).get_piece_size()


@pytest.fixture(scope="session")
def make_tiny_llama(
    tmp_path_factory: pytest.TempPathFactory, sp_model_bytes: bytes, sp_vocab_size: int
) -> Callable[..., Path]:
    """make_tiny_llama(name, seed=0, shards=1, **config) -> a folder with config.json, safetensors, tokenizer.model.

    `config` takes tiny_llama.hf_config_dict's keywords (dim, n_heads, n_kv_heads, head_dim, tie, rope_scaling...).
    Folders are written once per session and name; tests must not modify them (copy first).
    """
    made: dict[str, Path] = {}

    def make(name: str, seed: int = 0, shards: int = 1, **config: Any) -> Path:
        if name not in made:
            folder = tmp_path_factory.mktemp(f"tiny-{name}")
            made[name] = write_tiny_llama(folder, hf_config_dict(sp_vocab_size, **config), seed=seed,
                                          tokenizer_model=sp_model_bytes, shards=shards)
        return made[name]

    return make


@pytest.fixture(scope="session")
def tiny_llama_dir(make_tiny_llama: Callable[..., Path]) -> Path:
    """The default tiny model: 2 layers, dim 64, 4 heads over 2 KV heads (GQA), untied, SentencePiece tokenizer."""
    return make_tiny_llama("default")


# ---- `llmtrace tune` (kernel choice) ---------------------------------------------------------------------------


def fixed_timings(kernels: Any, config: Any, device: str = "cpu", progress: Any = None
                  ) -> tuple[tuple[Any, ...], float]:
    """product_timing.time_kernels' stand-in: fixed times with the stored kernels fastest (int4pack, then blocks, then
    any other), then fp32, fp16, bf16, so tune's pick is the same on every machine (tests assert no speed); the
    weights' bytes are the real ones."""
    from llmtrace.tracer.hardware.kernel_choice import CandidateTiming
    from llmtrace.tracer.hardware.product_timing import product_shapes

    rank = {"int4pack": 0.5, "blocks": 0.7, "fp32": 1.0, "fp16": 2.0, "bf16": 3.0}
    timings = []
    for kernel in kernels:
        if progress:
            progress(f"{kernel.name} products")
        per_value = {"fp32": 4, "fp16": 2, "bf16": 2}.get(kernel.dtype, 1)
        values = sum(s.rows * s.cols * (config.n_layers if s.per_layer else 1) for s in product_shapes(config))
        stored = kernel.weights == "stored"
        slow = rank.get(kernel.name, 0.9 if stored else 4.0)
        timings.append(CandidateTiming(kernel.name, kernel.dtype, kernel.weights, kernel.name if stored else "mv",
                                       slow * 1e-3, slow * 1e-2, values // 2 if stored else values * per_value))
    return tuple(timings), 0.01


@pytest.fixture(autouse=True)
def _fixed_kernel_choice(monkeypatch: pytest.MonkeyPatch, tmp_path_factory: pytest.TempPathFactory) -> None:
    """In-process tests never time products (a speed-dependent tune would make their output vary) and never read or
    write the user's saved picks: a fixed timer, no machine-load reading, and a kernels.json of their own. Tests of
    the timing and the store itself call them directly."""
    from llmtrace.tracer.hardware import kernel_store
    from llmtrace.tracer.load import kernel_pick

    path = tmp_path_factory.mktemp("kernels") / "kernels.json"
    monkeypatch.setattr(kernel_pick, "time_kernels", fixed_timings)
    monkeypatch.setattr(kernel_pick, "read_sample", lambda: None)  # no load reading: others_cpu None, not busy
    monkeypatch.setattr(kernel_store, "kernels_path", lambda: path)


@pytest.fixture(scope="session", autouse=True)
def _never_busy() -> Iterator[None]:
    """Tests run beside other work (the suite's own subprocesses, other test runs): a real machine-load reading
    would make a measurement provisional, or a quick roofline profile unsaved, at random. LLMTRACE_BUSY_SHARE=1 (set
    in os.environ, so CLI subprocesses inherit it) says no measurement is busy; the tests of the busy path set their
    own share and inject the readings (tracer/hardware/machine_load.py)."""
    from llmtrace.tracer.hardware.machine_load import BUSY_SHARE_ENV

    before = os.environ.get(BUSY_SHARE_ENV)
    os.environ[BUSY_SHARE_ENV] = "1"
    yield
    if before is None:
        os.environ.pop(BUSY_SHARE_ENV, None)
    else:
        os.environ[BUSY_SHARE_ENV] = before


# ---- the native stored kernel (tracer/model/native_kernel.py) -------------------------------------------------------


@pytest.fixture(scope="session", autouse=True)
def _native_kernel_build(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """One build of the native kernel for the whole session, outside the user's cache: set in os.environ so the
    CLI subprocesses inherit it (each would otherwise compile again, ~2 s, into its own empty cache folder)."""
    from llmtrace.tracer.model import native_kernel

    before = os.environ.get(native_kernel.DIR_ENV)
    os.environ[native_kernel.DIR_ENV] = str(tmp_path_factory.mktemp("native"))
    native_kernel.reset()
    yield
    if before is None:
        os.environ.pop(native_kernel.DIR_ENV, None)
    else:
        os.environ[native_kernel.DIR_ENV] = before
    native_kernel.reset()


@pytest.fixture
def portable_build(tmp_path: Path) -> Iterator[None]:
    """The library built without -march=native (no AVX2: the portable C loops), in a folder of the test's own."""
    from tests.native_builds import PORTABLE_FLAGS, built_with

    with built_with(PORTABLE_FLAGS, tmp_path / "native"):
        yield


# ---- tiny quantized GGUFs (stored weights, native kernel, stored candidates) ----------------------------------------


@pytest.fixture(scope="session")
def tiny_quantized(make_tiny_llama: Callable[..., Path], sp_model_bytes: bytes,
                   tmp_path_factory: pytest.TempPathFactory) -> Callable[[Any], Path]:
    """(qtype, head=None) -> the tiny LLaMA (dim 64, GQA, untied) written as a GGUF whose matrices gguf quantized to
    qtype (gguf.GGMLQuantizationType), the LM head to `head` when given (the bundled file mixes Q4_1 and a Q8_0 head);
    each file written once per session."""
    from tiny_gguf import sentencepiece_vocab, write_tiny_gguf

    from llmtrace.tracer.core.config import ModelConfig
    from llmtrace.tracer.load.hf_loader import load_hf_state_dict

    folder = make_tiny_llama("default")
    config = ModelConfig.from_hf_json(folder)
    state = load_hf_state_dict(folder, config)
    made: dict[Any, Path] = {}

    def make(qtype: Any, head: Any = None) -> Path:
        if (qtype, head) not in made:
            import gguf
            import numpy as np

            raw = {} if head is None else {
                "output.weight": (gguf.quants.quantize(state["output.weight"].float().numpy().astype(np.float32), head),
                                  head)}
            name = qtype.name if head is None else f"{qtype.name}-{head.name}-head"
            path = tmp_path_factory.mktemp(f"quantized-{name}") / "tiny.gguf"
            made[qtype, head] = write_tiny_gguf(path, config, state, sentencepiece_vocab(sp_model_bytes),
                                                matrix_type=qtype, raw_blocks=raw)
        return made[qtype, head]

    return make


# ---- the machine's name and the terminal's width ------------------------------------------------------------------

CPU_NAME_ENV = "LLMTRACE_TEST_CPU_NAME"


@pytest.fixture(autouse=True)
def _this_machine(monkeypatch: pytest.MonkeyPatch, tmp_path_factory: pytest.TempPathFactory) -> None:
    """Not the terminal's width (COLUMNS, LINES of the shell that started pytest: a test that renders sets its own).
    `LLMTRACE_TEST_CPU_NAME="Intel(R) Xeon(R) Platinum 8480+ Processor" pytest` runs every in-process test as if
    the CPU had that name (tracer/hardware/decode_ceilings.CPUINFO is the one place the name is read): no test may
    depend on the name of the machine it runs on (a long one wraps the run's and show's headers)."""
    for variable in ("COLUMNS", "LINES"):  # the terminal the tests were started from: each test sets its own width
        monkeypatch.delenv(variable, raising=False)
    name = os.environ.get(CPU_NAME_ENV)
    if not name:
        return
    from llmtrace.tracer.hardware import decode_ceilings

    path = tmp_path_factory.mktemp("cpuinfo") / "cpuinfo"
    path.write_text(f"processor\t: 0\nmodel name\t: {name}\nflags\t\t: fpu\n\nprocessor\t: 1\nmodel name\t: {name}\n",
                    encoding="utf-8")
    monkeypatch.setattr(decode_ceilings, "CPUINFO", str(path))
