"""The native stored kernel (tracer/model/native/gguf_matmul.c, tracer/model/native_kernel.py) against gguf's own
dequantizer, and how it is built: once, atomically, never loaded when damaged, and never needed (without a C
compiler the other stored kernels run).

The reference for every product is x @ gguf.quants.dequantize(blocks).T computed in fp64 (an independent decoder
and an exact sum); the kernel sums in fp32 in its own order, so it must agree within fp32 summation error: here
2^-20 of sum |x| |w| per output (fp32's unit roundoff is 2^-24; measured errors are about 2^-24 of that sum)."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Callable, Iterator

import gguf
import numpy as np
import pytest
import torch
from gguf.quants import dequantize as gguf_dequantize

from llmtrace.tracer.core.config import ModelConfig
from llmtrace.tracer.core.dtypes import FP32
from llmtrace.tracer.core.errors import BadArgumentError
from llmtrace.tracer.load.hf_loader import load_hf_state_dict
from llmtrace.tracer.load.loader import load_model
from llmtrace.tracer.load.stored_weights import DENSE, STORED, all_kernels, parse_weights
from llmtrace.tracer.model import native_kernel
from llmtrace.tracer.model.weight_formats import (
    BLOCKS,
    INT4PACK,
    NATIVE,
    concat_rows,
    pack_gguf,
    runs_blocks,
    stored_kernels,
)
from tests.guard_page import guarded_products
from tests.tiny_gguf import llama_cpp_name, random_blocks, sentencepiece_vocab, write_tiny_gguf
from tests.torch_threads import torch_threads

Q = gguf.GGMLQuantizationType
TYPES = [Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.Q4_K, Q.Q5_K, Q.Q6_K]
REPO = Path(__file__).resolve().parents[1]
SUM_TOLERANCE = 2**-20


@pytest.fixture
def native() -> None:
    if not native_kernel.available():
        pytest.skip(f"native kernel not available here: {native_kernel.unavailable_reason()}")


@pytest.fixture
def own_build(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A build folder of the test's own and a forgotten outcome; afterwards the session's build is found again."""
    folder = tmp_path / "native"
    monkeypatch.setenv(native_kernel.DIR_ENV, str(folder))
    native_kernel.reset()
    yield folder
    native_kernel.reset()


def _columns(qtype: Q) -> int:
    """K for the tests: not a multiple of 256 where the format allows it (7 blocks of 32), else two super-blocks."""
    block, _ = gguf.GGML_QUANT_SIZES[qtype]
    return 7 * 32 if block == 32 else 2 * 256


# ---- values and products ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("qtype", TYPES, ids=lambda q: q.name)
def test_products_equal_the_exact_product_of_ggufs_values(qtype: Q, native: None) -> None:
    rng = np.random.default_rng(int(qtype))
    rows, cols = 37, _columns(qtype)  # 37 rows: an odd split between two threads
    raw = random_blocks(qtype, rows, cols, rng)
    values = np.asarray(gguf_dequantize(raw, qtype), dtype=np.float32)  # (37, K)
    weight = pack_gguf(raw, int(qtype), cols, NATIVE)
    assert weight.format.kernel == NATIVE and weight.format.stored == qtype.name
    assert weight.stored_bytes == raw.nbytes and weight.tensors["blocks"].shape == raw.shape
    # exact values: every bit as gguf decodes them
    assert np.array_equal(weight.dequantize().numpy().view(np.uint32), values.view(np.uint32))
    ids = torch.tensor([[5, 0], [36, 5]])
    assert np.array_equal(weight.rows(ids, torch.float32).numpy(), values[ids.numpy()])
    assert torch.equal(weight.dequantize(torch.float32, 10, 20), torch.from_numpy(values[10:20]))
    reference = values.astype(np.float64)
    for tokens in (1, 3, 17):  # one token (the registers' algebra), a few, a prefill (exact tiles)
        x = torch.randn(tokens, cols, generator=torch.Generator().manual_seed(tokens))
        got = weight(x)
        assert got.shape == (tokens, rows) and got.dtype == torch.float32
        exact = x.double().numpy() @ reference.T
        bound = np.abs(x.double().numpy()) @ np.abs(reference).T * SUM_TOLERANCE
        assert (np.abs(got.double().numpy() - exact) <= bound).all(), (tokens, float((np.abs(got.numpy() - exact) / bound).max()))
    one = torch.randn(cols)  # a 1-D token
    assert np.allclose(weight(one).double().numpy(), reference @ one.double().numpy(), rtol=0,
                       atol=float((np.abs(reference) @ np.abs(one.double().numpy())).max()) * SUM_TOLERANCE)
    half = weight(x.bfloat16())  # other dtypes: cast to fp32 and back
    assert half.dtype == torch.bfloat16 and torch.equal(half, weight(x.bfloat16().float()).bfloat16())


def test_results_do_not_depend_on_the_thread_count(native: None) -> None:
    """Threads split the rows of W; each output is summed by one thread in one order, so 1 and 2 threads agree
    bit for bit."""
    raw = random_blocks(Q.Q4_1, 300, 576, np.random.default_rng(3))
    weight = pack_gguf(raw, int(Q.Q4_1), 576, NATIVE)
    x = torch.randn(5, 576)
    with torch_threads(1):
        one = (weight(x[:1]), weight(x))
    with torch_threads(2):
        two = (weight(x[:1]), weight(x))
    assert torch.equal(one[0], two[0]) and torch.equal(one[1], two[1])


def test_the_weight_is_the_files_bytes(native: None) -> None:
    """pack_gguf keeps the rows it is given (a writable map of the file: no copy); a read-only array is copied.
    Row blocks stack exactly (the fused path's wq|wk|wv)."""
    raw = random_blocks(Q.Q8_0, 16, 64, np.random.default_rng(4))
    weight = pack_gguf(raw, int(Q.Q8_0), 64, NATIVE)
    assert np.shares_memory(weight.tensors["blocks"].numpy(), raw)
    frozen = raw.copy()
    frozen.flags.writeable = False
    assert not np.shares_memory(pack_gguf(frozen, int(Q.Q8_0), 64, NATIVE).tensors["blocks"].numpy(), frozen)
    other = random_blocks(Q.Q8_0, 8, 64, np.random.default_rng(5))
    both = concat_rows([weight, pack_gguf(other, int(Q.Q8_0), 64, NATIVE)])
    assert both.shape == (24, 64) and both.stored_bytes == raw.nbytes + other.nbytes
    assert torch.equal(both.dequantize(), torch.from_numpy(np.concatenate(
        [gguf_dequantize(raw, Q.Q8_0), gguf_dequantize(other, Q.Q8_0)]).astype(np.float32)))


def test_row_blocks_of_several_formats_multiply_in_one_call(native: None) -> None:
    """wq|wk|wv of a Q4_K_M file: Q4_K, Q4_K, Q6_K rows stacked without a copy; one call, the threads' shares cut
    across the blocks by bytes."""
    rng = np.random.default_rng(7)
    members = [(Q.Q4_K, 40), (Q.Q6_K, 9), (Q.Q4_K, 24)]
    raws = [random_blocks(qtype, rows, 512, rng) for qtype, rows in members]
    weights = [pack_gguf(raw, int(qtype), 512, NATIVE) for raw, (qtype, _) in zip(raws, members)]
    both = concat_rows(weights)
    assert both.shape == (73, 512) and both.format.name == "q4_k+q6_k" and both.format.stored == "Q4_K+Q6_K"
    assert both.stored_bytes == sum(r.nbytes for r in raws) and both.format.stored_bits == both.stored_bytes * 8 / (73 * 512)
    assert all(np.shares_memory(t.numpy(), raw) for t, raw in zip(both.tensors.values(), raws))
    values = np.concatenate([gguf_dequantize(raw, qtype) for raw, (qtype, _) in zip(raws, members)]).astype(np.float32)
    assert np.array_equal(both.dequantize().numpy(), values)
    assert np.array_equal(both.dequantize(torch.float32, 35, 52).numpy(), values[35:52])
    assert np.array_equal(both.rows(torch.tensor([45, 0, 72]), torch.float32).numpy(), values[[45, 0, 72]])
    for tokens in (1, 5):
        x = torch.randn(tokens, 512, generator=torch.Generator().manual_seed(tokens))
        exact = x.double().numpy() @ values.astype(np.float64).T
        bound = np.abs(x.double().numpy()) @ np.abs(values.astype(np.float64)).T * SUM_TOLERANCE
        assert (np.abs(both(x).double().numpy() - exact) <= bound).all()
        assert torch.equal(both(x), torch.cat([w(x) for w in weights], dim=1))  # each row summed the same way


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="guard pages through libc mprotect (Linux)")
@pytest.mark.parametrize("qtype", TYPES, ids=lambda q: q.name)
def test_no_byte_past_the_matrix_is_read(qtype: Q, native: None) -> None:
    """W ends exactly where an unreadable page starts: the kernels widen bytes straight from memory and prefetch
    ahead of what they read, and none of that may load a byte past W (a load there would crash the process; a
    prefetch never faults). One token and a prefill, over rows that split unevenly between two threads."""
    rows, cols = 301, _columns(qtype)  # enough work that 2 threads split it (gguf_matmul.c PARALLEL_MIN_WORK)
    raw = random_blocks(qtype, rows, cols, np.random.default_rng(11))
    reference = np.asarray(gguf_dequantize(raw, qtype), dtype=np.float64)
    for weight, x in guarded_products(raw, int(qtype), cols, NATIVE):
        got = weight(x).double().numpy()
        bound = np.abs(x.double().numpy()) @ np.abs(reference).T * SUM_TOLERANCE
        assert (np.abs(got - x.double().numpy() @ reference.T) <= bound).all()


def test_a_refused_call_is_an_error_not_a_crash(native: None) -> None:
    raw = random_blocks(Q.Q4_0, 4, 64, np.random.default_rng(6))
    weight = pack_gguf(raw, int(Q.Q4_0), 64, NATIVE)
    with pytest.raises(native_kernel.NativeKernelError, match="out of range"):
        weight.rows(torch.tensor([4]), torch.float32)
    with pytest.raises(native_kernel.NativeKernelError, match="do not fit the blocks"):
        native_kernel.matmul(native_kernel.BlockMatrix([(int(Q.Q4_0), weight.tensors["blocks"])], 48),
                             torch.ones(1, 48))
    with pytest.raises(ValueError, match="not a matrix of Q4_0 blocks"):
        native_kernel.BlockMatrix([(int(Q.Q4_0), weight.tensors["blocks"].float())], 64)


# ---- building it -----------------------------------------------------------------------------------------------


def _library_file(folder: Path) -> Path:
    (pointer,) = folder.glob("gguf_matmul-*.txt")
    return folder / pointer.read_text().splitlines()[0]


def test_a_damaged_build_is_rebuilt_not_loaded(own_build: Path, monkeypatch: pytest.MonkeyPatch,
                                               tmp_path: Path) -> None:
    """Built by another process; here, damaged copies are found by their hash before dlopen sees them (this process
    never loaded these paths: glibc hands back an already loaded library by its path, whatever the file holds now)."""
    code = "from llmtrace.tracer.model import native_kernel as n; print(n.available(), n.unavailable_reason())"
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300,
                          env={**os.environ, native_kernel.DIR_ENV: str(own_build)})
    assert done.stdout.strip() == "True", done.stdout + done.stderr
    library = _library_file(own_build)
    assert hashlib.sha256(library.read_bytes()).hexdigest() in library.name  # named by its own content
    second = tmp_path / "second"
    shutil.copytree(own_build, second)
    builds = []
    real_build = native_kernel._build
    monkeypatch.setattr(native_kernel, "_build", lambda *args: builds.append(1) or real_build(*args))

    data = bytearray(library.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one flipped bit in the code: dlopen would not notice, the kernel might crash
    library.write_bytes(bytes(data))
    native_kernel.reset()
    assert native_kernel.available() and builds == [1]
    assert hashlib.sha256(library.read_bytes()).hexdigest() in library.name

    copy = _library_file(second)
    copy.write_bytes(b"\x7fELF truncated")
    (pointer,) = second.glob("gguf_matmul-*.txt")
    monkeypatch.setenv(native_kernel.DIR_ENV, str(second))
    native_kernel.reset()
    assert native_kernel.available() and builds == [1, 1]  # the truncated file: rebuilt
    assert hashlib.sha256(copy.read_bytes()).hexdigest() in copy.name
    pointer.write_text("../../elsewhere.so\n")  # a pointer that is not a build's name is not followed
    native_kernel.reset()
    assert native_kernel.available() and builds == [1, 1, 1]
    assert not list(own_build.glob("*.partial")) and not list(second.glob("*.partial"))


def test_set_up_builds_the_library_a_later_process_loads_without_compiling(
        own_build: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """`make run`'s prepare() compiles the units (in parallel, into objects, then linked) where runs look: a later
    process finds that build and compiles nothing, and no objects are left. Without a compiler it says so."""
    code = "from llmtrace.tracer.model import native_kernel as n; print(n.prepare())"
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300,
                          env={**os.environ, native_kernel.DIR_ENV: str(own_build)})
    library = _library_file(own_build)
    assert done.stdout.strip().startswith(f"llmtrace's C kernels: {library} ("), done.stdout + done.stderr
    assert not list(own_build.glob(native_kernel.OBJECTS_PREFIX + "*")) and not list(own_build.glob("*.partial"))
    builds = []
    real_build = native_kernel._build
    monkeypatch.setattr(native_kernel, "_build", lambda *args: builds.append(1) or real_build(*args))
    native_kernel.reset()
    assert native_kernel.available() and native_kernel.library().path == library and builds == []
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    native_kernel.reset()
    assert native_kernel.prepare() == ("llmtrace's C kernels are not built: no C compiler: "
                                       f"`{tmp_path / 'no-such-cc'}` does not run (set $CC to one)")


def test_two_processes_building_at_once_leave_one_whole_build(tmp_path: Path) -> None:
    folder = tmp_path / "native"
    env = {**os.environ, native_kernel.DIR_ENV: str(folder)}
    code = "from llmtrace.tracer.model import native_kernel as n; print(n.available(), n.unavailable_reason())"
    procs = [subprocess.Popen([sys.executable, "-c", code], cwd=REPO, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outputs = [p.communicate(timeout=300) for p in procs]
    assert all(p.returncode == 0 for p in procs), outputs
    assert all(out.strip() == "True" for out, _ in outputs), outputs
    library = _library_file(folder)
    assert hashlib.sha256(library.read_bytes()).hexdigest() in library.name
    assert len(list(folder.glob("*.so"))) == 1 and not list(folder.glob("*.partial"))


def test_without_a_compiler_the_other_kernels_run(own_build: Path, monkeypatch: pytest.MonkeyPatch,
                                                  tiny_quantized: Callable[[Q], Path], tmp_path: Path) -> None:
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    assert not native_kernel.available()
    reason = native_kernel.unavailable_reason()
    assert reason.startswith("no C compiler") and "no-such-cc" in reason and "\n" not in reason
    assert stored_kernels(int(Q.Q4_1)) == (INT4PACK, BLOCKS) and stored_kernels(int(Q.Q6_K)) == ()
    assert all_kernels() == (INT4PACK, BLOCKS)
    with pytest.raises(BadArgumentError, match="--weights native: no C compiler"):
        parse_weights(NATIVE)
    loaded = load_model(str(tiny_quantized(Q.Q4_1)), FP32, weights=STORED, use_cache=False)
    # --weights stored: the default table's row without a compiler (int4pack for Q4 types)
    assert loaded.weights.mode == STORED and "as stored (Q4_1:int4pack)" in loaded.weight_format
    loaded.model.setup_cache(1, 8)
    assert torch.isfinite(loaded.model.prefill(torch.tensor([[1, 40, 41]]))).all()
    assert not own_build.exists() or not list(own_build.glob("*.so"))


def test_a_compiler_that_fails_is_one_line(own_build: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    fake = tmp_path / "fakecc"
    fake.write_text('#!/bin/sh\nif [ "$1" = --version ]; then echo "fakecc 1.0"; exit 0; fi\n'
                    'echo "gguf_matmul.c:1: error: this compiler refuses" >&2\nexit 1\n')
    fake.chmod(0o755)
    monkeypatch.setenv("CC", str(fake))
    assert not native_kernel.available()
    reason = native_kernel.unavailable_reason()
    assert "could not compile the native library" in reason and "this compiler refuses" in reason and "\n" not in reason
    assert not list(own_build.glob("*.partial")) and not list(own_build.glob("*.so"))


def test_an_error_in_the_vector_code_fails_the_build_rather_than_dropping_the_flags(
        own_build: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A kernel that compiles only without -march=native (here: an #error under AVX2, as a broken AVX2 or AVX-512
    path would) is refused with the compiler's error, not built quietly with plain -O3 and none of its vector code."""
    probe = tmp_path / "probe.c"
    probe.write_text("int main(void) {\n#ifdef __AVX2__\nreturn 0;\n#else\nreturn 1;\n#endif\n}\n")
    built = subprocess.run(["cc", "-march=native", "-o", str(tmp_path / "probe"), str(probe)], check=False)
    if built.returncode != 0 or subprocess.run([str(tmp_path / "probe")], check=False).returncode != 0:
        pytest.skip("this machine's -march=native has no AVX2")
    broken = tmp_path / "decode_step.c"
    broken.write_text('#ifdef __AVX2__\n#error "the AVX2 path is broken"\n#endif\nint llmt_abi(void) { return 0; }\n')
    monkeypatch.setattr(native_kernel, "SOURCES", (broken,))
    assert not native_kernel.available()
    reason = native_kernel.unavailable_reason()
    assert "could not compile the native library" in reason and "the AVX2 path is broken" in reason
    assert "-march=native" in reason and "\n" not in reason
    assert not list(own_build.glob("*.so")) and not list(own_build.glob("*.partial"))
    assert not list(own_build.glob(".probe-*"))


def test_the_build_key_covers_every_source_and_header(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The library is every native/*.c compiled and linked (no .c includes another) with the headers they include:
    a change to any one of them, a header included, is another build."""
    names = {path.name for path in native_kernel.SOURCES}
    assert {"decode_step.c", "gguf_matmul.c", "int8_dot.c", "int16_dot.c", "blocks.h", "kernels.h"} <= names
    assert not any('#include "' + other + '"' in path.read_text() for path in native_kernel.SOURCES
                   for other in names if other.endswith(".c"))
    copies = []
    for path in native_kernel.SOURCES:
        shutil.copy(path, tmp_path / path.name)
        copies.append(tmp_path / path.name)
    monkeypatch.setattr(native_kernel, "SOURCES", tuple(copies))
    key = native_kernel._key(["cc"], "cc 1.0")
    for copy in copies:
        text = copy.read_text()
        copy.write_text(text + "\n")
        assert native_kernel._key(["cc"], "cc 1.0") != key, copy.name
        copy.write_text(text)
    assert native_kernel._key(["cc"], "cc 1.0") == key


def test_the_build_takes_the_first_flag_set_the_compiler_accepts(own_build: Path, tmp_path: Path) -> None:
    """A compiler that takes -march=native and OpenMP (gcc on Linux) builds with them: the library's pointer file
    records the first flag set."""
    unit = tmp_path / "unit.c"
    unit.write_text("#include <omp.h>\nint f(void) { return omp_get_max_threads(); }\n")
    if subprocess.run(["cc", *native_kernel.FLAG_SETS[0], "-fPIC", "-shared", "-o", str(tmp_path / "unit.so"),
                       str(unit)], check=False, capture_output=True).returncode != 0:
        pytest.skip("cc does not take -march=native -fopenmp here")
    assert native_kernel.available(), native_kernel.unavailable_reason()
    pointer = next(own_build.glob("gguf_matmul-*.txt"))
    assert pointer.read_text().splitlines()[1] == " ".join(native_kernel.FLAG_SETS[0])


# ---- end to end ------------------------------------------------------------------------------------------------




@pytest.fixture(scope="module")
def tiny_q4_k_m(make_tiny_llama: Callable[..., Path], sp_model_bytes: bytes,
                tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny LLaMA (dim 256: whole K-quant blocks) mixed as llama.cpp's Q4_K_M and Q5_K_M are: Q4_K and Q5_K
    matrices, Q6_K attn_v and ffn_down, Q8_0 embedding; random blocks under small scales (gguf cannot write
    K-quants)."""
    folder = make_tiny_llama("kquants-native", seed=12, dim=256, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=512)
    config = ModelConfig.from_hf_json(folder)
    state = load_hf_state_dict(folder, config)
    rng = np.random.default_rng(12)
    mix = {"token_embd": Q.Q8_0, "attn_v": Q.Q6_K, "ffn_down": Q.Q6_K, "output": Q.Q6_K, "attn_q": Q.Q5_K,
           "ffn_gate": Q.Q5_0, "ffn_up": Q.Q5_1, "attn_output": Q.Q4_0}
    raw = {}
    for ours, tensor in state.items():
        name = llama_cpp_name(ours)
        if tensor.ndim == 2 and not (ours == "output.weight" and config.tie_embeddings):
            qtype = next((q for part, q in mix.items() if f".{part}." in f".{name}"), Q.Q4_K)
            raw[name] = (random_blocks(qtype, tensor.shape[0], tensor.shape[1], rng), qtype)
    path = tmp_path_factory.mktemp("native-q4km") / "q4_k_m.gguf"
    return write_tiny_gguf(path, config, state, sentencepiece_vocab(sp_model_bytes), raw_blocks=raw)


def _logits(path: Path, weights: str, tokens: list[int]) -> torch.Tensor:
    loaded = load_model(str(path), FP32, weights=weights, use_cache=False)
    model = loaded.model
    model.setup_cache(1, 16)
    out = [model.prefill(torch.tensor([tokens[:-1]]))]
    out.append(model.decode_one(torch.tensor([tokens[-1:]])))
    return torch.cat(out)  # (2, V): the prompt's last position, then one decode step


# Stored (native) against dense fp32 on the same file: the same weights to the bit, products summed in fp32 in
# another order; through two layers, norms and softmax that leaves differences near fp32's rounding.
NATIVE_LOGIT_TOLERANCE = 2**-16


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0], ids=lambda q: q.name)
def test_native_logits_equal_dense_fp32_within_fp32_rounding(qtype: Q, native: None,
                                                             tiny_quantized: Callable[[Q], Path]) -> None:
    path = tiny_quantized(qtype)
    tokens = [1, 40, 41, 42, 43, 44]
    stored, dense = _logits(path, NATIVE, tokens), _logits(path, DENSE, tokens)
    scale = float(dense.abs().max())
    assert float((stored - dense).abs().max()) <= NATIVE_LOGIT_TOLERANCE * scale


def test_a_k_quant_mix_runs_wholly_stored(native: None, tiny_q4_k_m: Path) -> None:
    """Q4_K_M-like files: every matrix has the native library's kernels (native, and i8dot where the accuracy probe
    admits it), so the default runs all of them as stored (no other kernel runs Q6_K or Q5_*), and the exact
    kernel's logits are the dense path's within fp32 rounding."""
    loaded = load_model(str(tiny_q4_k_m), FP32, weights=STORED, use_cache=False)
    assert loaded.weights.mode == STORED and "as stored (" in loaded.weight_format
    assert all(runs_blocks(w.format.kernel) for w in loaded.model.stored_weights().values())
    formats = {w.format.name for w in loaded.model.stored_weights().values()}
    assert formats == {"q4_k", "q5_k", "q6_k", "q5_0", "q5_1", "q4_0", "q8_0"}
    tokens = [1, 40, 41, 42, 43, 44]
    stored, dense = _logits(tiny_q4_k_m, NATIVE, tokens), _logits(tiny_q4_k_m, DENSE, tokens)
    assert float((stored - dense).abs().max()) <= NATIVE_LOGIT_TOLERANCE * float(dense.abs().max())
