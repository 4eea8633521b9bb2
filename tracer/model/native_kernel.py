"""The "native" stored kernel: native/gguf_matmul.c, compiled once per machine and compiler, called through ctypes.

What it runs: x @ W.T with W in a GGUF's own block bytes (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K), each
block dequantized in registers to exactly gguf.quants.dequantize's values (the C file's header says how), and
those exact values for embedding lookups. llmtrace.tracer.model.weight_formats wraps it as the kernel "native".
The same library holds the "i8dot" kernel (native/int8_dot.c: the activations rounded to int8 per 32 values and integer
dot products with the blocks' codes; not exact: admitted only by the kernel choice's accuracy probe) and the "i16dot"
one (native/int16_dot.c: Q8_0 and Q6_K blocks times activations rounded to int16, likewise probed), chosen per row block
of a BlockMatrix by its activation kind, and the native decode step (native/decode_step.c, driven by
tracer/model/native_step.py).

Built at set-up (`prepare()`, which `make run` calls), else on the first `available()` (a stored-weights load asks): the
system C compiler ($CC, else `cc`; it may be a command line such as "ccache gcc") compiles every native/*.c (separate
units sharing native/blocks.h and kernels.h, one compiler process per CPU at once) and links them into one library, with
-O3 -march=native -fopenmp -ffp-contract=off and -lm; without OpenMP (Apple's clang: a trivial probe unit, compiled
first, says which flags the compiler takes) it is built without -fopenmp and runs on one thread, but an error in the
kernel's own code fails the build rather than dropping to fewer flags; no torch or Python headers, so it takes a few
seconds. The library goes in $LLMTRACE_NATIVE_DIR if set (the tests share one build that way), else the cache folder's
`native/` (llmtrace.tracer.core.cache_dirs), named by a key over everything that shapes the binary: every source and
header, the compiler's `--version`, the flags, the CPU (model and flags: -march=native) and the ABI numbers. A build is
written under a temporary name and renamed to a name that carries its own SHA-256 (`gguf_matmul-<key>-<sha>.so`); a
small pointer file `gguf_matmul-<key>.txt`, replaced atomically, names the current build: it is the record, in a file
the user owns, of the hash of what a build of these sources made. A loader hashes the library through a descriptor,
compares the pointer's hash, and checks that the file it dlopened is that one: a damaged or truncated library is never
loaded (a bad ELF can crash the process rather than fail) but rebuilt. dlopen runs a library's constructors before any
check of ours, so nothing another user could have written is ever loaded: the folder must be the user's own and private
(tracer/core/cache_dirs.py; else one line, UntrustedPathError), and so must the pointer and the library (owned by the
user, not writable by group or others). Builds take the folder's lock (flock) one at a time; the build that holds it
first removes what killed builds left (`.partial` files, probe and object folders), and two processes that start at
once build once. After loading, a self-test multiplies a small matrix whose exact product is known.

When it cannot be built (no compiler, a failed compile, a failed self-test) `available()` is False and
`unavailable_reason()` says why in one line; the other stored kernels ("int4pack", "blocks") remain. The outcome
is remembered for the process (`reset()` forgets it: tests, or after changing $CC).

The OpenMP runtime is torch's own: torch is imported first and ships libgomp.so.1, which the library's
DT_NEEDED entry of the same name resolves to, so both share one thread pool (two pools on two cores would spin
against each other). Each call passes torch.get_num_threads() as its thread count.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import functools
import hashlib
import os
import platform
import re
import shlex
import shutil
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np
import torch

from llmtrace.tracer.core.atomic_file import write_atomic
from llmtrace.tracer.core.cache_dirs import CACHE_ENV, cache_root, check_owned_file, private_folder
from llmtrace.tracer.core.ggml_types import GGML_TYPES

NATIVE_SOURCES = Path(__file__).resolve().with_name("native")
# everything the binary is made of (native/kernels.h lists the units): its .c files are compiled and linked into the
# one library, and the build key covers them and the headers they include
SOURCES = tuple(sorted(NATIVE_SOURCES.glob("*.[ch]")))
ABI = 8  # LLMT_ABI in gguf_matmul.c
STEP_ABI = 10  # LLMT_STEP_ABI in decode_step.c
MAX_PARTS = 8  # MAX_PARTS in the C file: row blocks one call multiplies
CC_ENV = "CC"
DIR_ENV = "LLMTRACE_NATIVE_DIR"
# Tried in order on a probe (_flags_taken): the first the compiler takes is used (OpenMP missing, then -march=native
# unknown to the compiler); the kernel is then compiled with that set only.
FLAG_SETS = (("-O3", "-march=native", "-fopenmp"), ("-O3", "-march=native"), ("-O3",))
UNIT_FLAGS = ("-ffp-contract=off", "-fPIC")  # every unit's compile
COMMON_FLAGS = (*UNIT_FLAGS, "-shared")  # a whole build's command line (and the link's)
LIBS = ("-lm",)  # after the source: linkers that drop libraries not yet needed (--as-needed) keep it
COMPILE_TIMEOUT_S = 120
# ggml type codes the C file multiplies (ggml.h enum ggml_type)
TYPES = {2: "Q4_0", 3: "Q4_1", 6: "Q5_0", 7: "Q5_1", 8: "Q8_0", 12: "Q4_K", 13: "Q5_K", 14: "Q6_K"}
# How a row block's products take the activations (EXACT_X, INT8_X, INT16_X in gguf_matmul.c): exact fp32 ("native"),
# rounded to int8 per 32 values ("i8dot") or to int16 ("i16dot", Q8_0 and Q6_K blocks only)
EXACT_X, INT8_X, INT16_X = 0, 1, 2
INT16_TYPES = (8, 14)  # the ggml types INT16_X takes: Q8_0, Q6_K
_STATUS = {1: "unsupported ggml type", 2: "shapes that do not fit the blocks", 3: "out of memory"}
_NOT_FINITE = 4  # llmt_hold_groups: every byte written, a scale NaN or infinite (the caller names the file)
_NAME = re.compile(r"gguf_matmul-[0-9a-f]{20}-[0-9a-f]{64}\.so")
LOCK_NAME = ".build.lock"  # held (flock) while a process builds: one build at a time per folder
# What a build leaves while it runs: the library under a temporary name, the flag probe's folder, the units' objects.
# Found under the lock, they are a killed build's (SIGKILL, a power cut): removed.
OBJECTS_PREFIX = ".objects-"  # the folder of a build's object files, one per unit, until they are linked
PARTIAL_GLOBS = (".gguf_matmul-*.so.partial", ".probe-*", OBJECTS_PREFIX + "*")
MAX_LIBRARY_BYTES = 256 << 20  # a library file larger than this is not a build of these sources (a few MB)
MAX_POINTER_BYTES = 4096
_REMOVED = "the kernel folder {folder} was removed during the build; run again"


@dataclass(frozen=True, slots=True)
class NativeLibrary:
    """The loaded library: its file, the flags it was built with, and the products' entry points."""

    path: Path
    flags: tuple[str, ...]
    avx2: bool  # the AVX2+FMA+F16C paths are compiled in (else portable C loops)
    openmp: bool  # threads (else one)
    describe: ctypes._CFuncPtr
    matmul: ctypes._CFuncPtr
    dequantize: ctypes._CFuncPtr
    matrix_size: int  # bytes of the C side's description of a matrix
    interleave: ctypes._CFuncPtr  # an i8dot Q4_0/Q4_1 matrix's rows in groups of sixteen (native/int8_groups.c)
    set_groups: ctypes._CFuncPtr  # a described part's interleaved copy
    group_rows: ctypes._CFuncPtr  # rows as stored of a matrix held interleaved in place
    handle: ctypes.CDLL  # the library itself, every entry point of _SIGNATURES declared on it

    @property
    def description(self) -> str:
        """For one-line displays: "AVX2, OpenMP"."""
        return ", ".join(["AVX2" if self.avx2 else "portable C", "OpenMP" if self.openmp else "one thread"])


@dataclass(frozen=True, slots=True)
class _Outcome:
    library: NativeLibrary | None
    reason: str  # why there is none, one line; "" when there is one


class NativeKernelError(RuntimeError):
    """The library refused a call (a shape or type the caller should have checked)."""


def available() -> bool:
    """Whether the native kernel can run here (builds it on the first call of the process)."""
    return _outcome().library is not None


def unavailable_reason() -> str:
    """Why `available()` is False, in one line ("" when it is True)."""
    return _outcome().reason


def library() -> NativeLibrary:
    """The loaded library; NativeKernelError (with the reason) when there is none."""
    outcome = _outcome()
    if outcome.library is None:
        raise NativeKernelError(f"the native kernel is not available: {outcome.reason}")
    return outcome.library


def loaded() -> NativeLibrary | None:
    """The library when this process has already looked for it and has it; never builds or loads one (a caller on a
    hot path that can do without it: the sampler's selection)."""
    if _outcome.cache_info().currsize == 0:
        return None
    return _outcome().library


def prepare() -> str:
    """Build (or find) the library now, for set-up (`make run`, README's set-up without make): one line, the
    library's path or why there is none. A build at set-up is one no first run pays (a C compiler's few seconds,
    where llama.cpp compiles at its install); it goes where runs look, with the same checks."""
    outcome = _outcome()
    if outcome.library is None:
        return f"llmtrace's C kernels are not built: {outcome.reason}"
    return f"llmtrace's C kernels: {outcome.library.path} ({outcome.library.description})"


def reset() -> None:
    """Forget this process's outcome: the next call looks for (and if need be builds) the library again."""
    _outcome.cache_clear()


# ---- the calls -------------------------------------------------------------------------------------------------


class BlockMatrix:
    """W as the kernel takes it: row blocks ("parts") stacked, each (rows, bytes per row) uint8 on the CPU, rows
    contiguous in themselves, of one ggml type each, all `k` values wide (wq|wk|wv of a Q4_K_M file is Q4_K, Q4_K,
    Q6_K). It holds the tensors (the kernel reads their memory in place) and the call's argument arrays, made once:
    a decode step makes ~120 calls, so each costs only what ctypes must."""

    __slots__ = ("parts", "k", "rows", "activations", "groups", "_described", "_address", "_call")

    def __init__(self, parts: list[tuple[int, torch.Tensor]], k: int, activations: tuple[int, ...] | None = None,
                 groups: tuple[torch.Tensor | None, ...] | None = None) -> None:
        """`activations`: per part, EXACT_X, INT8_X (the i8dot kernel) or INT16_X (i16dot); None: all exact.
        `groups`: per part, its rows interleaved by `interleave` (an i8dot Q4_0/Q4_1 part: its decode products read
        them) or None; held here with the parts."""
        if not 1 <= len(parts) <= MAX_PARTS:
            raise ValueError(f"the native kernel multiplies 1 to {MAX_PARTS} row blocks at once, not {len(parts)}")
        for code, blocks in parts:
            if code not in TYPES or blocks.dtype != torch.uint8 or blocks.dim() != 2 or blocks.device.type != "cpu" \
                    or (blocks.shape[0] > 1 and blocks.stride(1) != 1):
                raise ValueError(f"not a matrix of {TYPES.get(code, code)} blocks: {blocks.dtype} "
                                 f"{tuple(blocks.shape)} on {blocks.device}")
        self.parts = tuple(parts)
        self.k = int(k)
        self.rows = sum(blocks.shape[0] for _, blocks in parts)
        self.activations = tuple(activations) if activations is not None else (EXACT_X,) * len(parts)
        if len(self.activations) != len(parts):
            raise ValueError(f"{len(self.activations)} activation kinds for {len(parts)} row blocks")
        for (code, _), kind in zip(parts, self.activations):
            if kind not in (EXACT_X, INT8_X, INT16_X) or (kind == INT16_X and code not in INT16_TYPES):
                raise ValueError(f"no activation kind {kind} for {TYPES[code]} blocks")
        lib = library()
        count = len(parts)
        self._described = ctypes.create_string_buffer(lib.matrix_size)  # the C side's description, kept here
        status = lib.describe(count, (ctypes.c_int * count)(*(code for code, _ in parts)),
                              (ctypes.c_void_p * count)(*(blocks.data_ptr() for _, blocks in parts)),
                              (ctypes.c_int64 * count)(*(blocks.stride(0) for _, blocks in parts)),
                              (ctypes.c_int64 * count)(*(blocks.shape[0] for _, blocks in parts)), self.k,
                              (ctypes.c_int * count)(*self.activations), self._described)
        if status:
            kinds = "+".join(TYPES[code] for code, _ in parts)
            raise NativeKernelError(f"native kernel refused {kinds} ({self.rows} x {self.k}): "
                                    f"{_STATUS.get(status, status)}")
        self.groups = tuple(groups) if groups is not None else (None,) * count
        for p, ((code, blocks), grouped) in enumerate(zip(parts, self.groups, strict=True)):
            if grouped is None:
                continue
            if grouped.dtype != torch.uint8 or not grouped.is_contiguous() \
                    or grouped.numel() != grouped_bytes(code, blocks.shape[0], self.k):
                raise ValueError(f"not the interleaved rows of a {TYPES.get(code, code)} part "
                                 f"{tuple(blocks.shape)}: {grouped.dtype} {tuple(grouped.shape)}")
            status = lib.set_groups(self._described, p, grouped.data_ptr())
            if status:
                raise NativeKernelError(f"native kernel refused interleaved rows for a {TYPES[code]} part "
                                        f"(activations {self.activations[p]}): {_STATUS.get(status, status)}")
        self._address = ctypes.addressof(self._described)
        self._call = lib.matmul

    @property
    def address(self) -> int:
        """Where the C side's description lives (valid while this object is)."""
        return self._address


# The types whose i8dot products read rows interleaved in groups of GROUP_ROWS (native/int8_groups.c says why and
# how: kernels.h's GROUP_ROWS): the interleaved copy holds the same bytes as the rows.
GROUPED_TYPES = (2, 3)  # Q4_0, Q4_1
GROUP_ROWS = 16


def grouped_bytes(ggml_type: int, rows: int, k: int) -> int:
    """Bytes of `interleave`'s copy of a (rows, k) matrix: its whole groups of sixteen rows (the rest stay in rows)."""
    _, block_values, block_bytes = GGML_TYPES[ggml_type]
    return rows // GROUP_ROWS * GROUP_ROWS * (k // block_values) * block_bytes


def interleave(ggml_type: int, blocks: torch.Tensor, k: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """The whole groups of sixteen rows of `blocks` (a Q4_0/Q4_1 matrix, (rows, bytes per row) uint8) in the order the
    i8dot decode kernel reads them, written into `out` (contiguous uint8 of grouped_bytes; a new tensor when None)."""
    lib = library()
    if ggml_type not in GROUPED_TYPES:
        raise NativeKernelError(f"native interleave refused {TYPES.get(ggml_type, ggml_type)}: {_STATUS[1]}")
    size = grouped_bytes(ggml_type, blocks.shape[0], k)
    if out is None:
        out = torch.empty(size, dtype=torch.uint8)
    if out.dtype != torch.uint8 or not out.is_contiguous() or out.numel() != size:
        raise ValueError(f"interleaved rows need {size} contiguous bytes, not {out.dtype} {tuple(out.shape)}")
    status = lib.interleave(ggml_type, blocks.data_ptr(), blocks.stride(0), blocks.shape[0], k, out.data_ptr())
    if status:
        raise NativeKernelError(f"native interleave refused {TYPES.get(ggml_type, ggml_type)} "
                                f"{tuple(blocks.shape)}: {_STATUS.get(status, status)}")
    return out


def group_rows(ggml_type: int, held: torch.Tensor, k: int, ids: torch.Tensor) -> torch.Tensor:
    """Rows `ids` (1-D int64) as the file stores them, (len(ids), bytes per row) uint8, of a Q4_0/Q4_1 matrix held
    interleaved in place: `held` (rows, bytes per row) contiguous uint8, its whole groups of sixteen in `interleave`'s
    order and the rows after them as stored (native/int8_groups.c, "Held in place")."""
    lib = library()
    ids = ids.to(torch.int64).contiguous()
    if not held.is_contiguous() or held.dtype != torch.uint8 or held.dim() != 2:
        raise ValueError(f"not a matrix held in place: {held.dtype} {tuple(held.shape)}")
    out = torch.empty(ids.shape[0], held.shape[1], dtype=torch.uint8)
    status = lib.group_rows(ggml_type, held.data_ptr(), held.shape[0], k, ids.data_ptr(), ids.shape[0],
                            out.data_ptr())
    if status:
        raise NativeKernelError(f"native group_rows refused {TYPES.get(ggml_type, ggml_type)} "
                                f"{tuple(held.shape)}: {_STATUS.get(status, status)} (row ids out of range?)")
    return out


def hold_groups(ggml_type: int, rows: np.ndarray, k: int, out: np.ndarray, unit: int = 0,
                threads: int | None = None) -> bool:
    """`rows` (a Q4_0/Q4_1 matrix's rows as the file stores them, (rows, bytes per row) uint8, any row stride: a view
    of the file's map) written into `out` (contiguous, the same bytes: its room in the weight arena) as the i8dot
    kernel holds them in place, the whole groups interleaved and the rest as stored, in one pass on `threads` threads
    (torch's count when None); `unit` > 0: Q/K rows in llama.cpp's order, heads of `unit` rows, put in HF's
    (gguf_loader.unpermute_rope_rows).
    Whether every scale was finite (native/int8_groups.c, llmt_hold_groups)."""
    lib = library()
    if rows.dtype != np.uint8 or rows.ndim != 2 or rows.strides[1] != 1 or out.dtype != np.uint8 \
            or not out.flags.c_contiguous or out.nbytes != rows.shape[0] * rows.shape[1]:
        raise ValueError(f"cannot hold {rows.dtype} {rows.shape} rows in {out.dtype} {out.shape}")
    status = lib.handle.llmt_hold_groups(ggml_type, rows.ctypes.data, rows.strides[0], rows.shape[0], k, unit,
                                         out.ctypes.data, torch.get_num_threads() if threads is None else threads)
    if status not in (0, _NOT_FINITE):
        raise NativeKernelError(f"native hold_groups refused {TYPES.get(ggml_type, ggml_type)} {rows.shape} (heads "
                                f"of {unit} rows): {_STATUS.get(status, status)}")
    return status == 0


def scales_finite(ggml_type: int, blocks: np.ndarray) -> bool | None:
    """Whether every fp16 scale and min of `blocks` (contiguous uint8, whole blocks of `ggml_type` as stored) is
    finite, checked in one pass on torch's threads (native/scales.c); None for a type the library does not read."""
    if blocks.dtype != np.uint8 or not blocks.flags.c_contiguous:
        raise ValueError(f"not contiguous blocks: {blocks.dtype} {blocks.shape}")
    _, _, block_bytes = GGML_TYPES[ggml_type]
    found = library().handle.llmt_scales_finite(ggml_type, blocks.ctypes.data, blocks.nbytes // block_bytes,
                                                torch.get_num_threads())
    return None if found < 0 else bool(found)


def matmul(matrix: BlockMatrix, x: torch.Tensor) -> torch.Tensor:
    """x (..., K) @ W.T -> (..., N) fp32 for W = `matrix`; x of another dtype is cast to fp32 first. A decode step
    makes ~120 of these calls, so this path does only what it must (no reshapes: the kernel takes rows of K)."""
    if x.dtype != torch.float32 or not x.is_contiguous():
        x = x.to(torch.float32).contiguous()
    if x.shape[-1] != matrix.k:
        raise NativeKernelError(f"native matmul: x has {x.shape[-1]} values per row, the matrix {matrix.k}")
    out = torch.empty(x.shape[:-1] + (matrix.rows,), dtype=torch.float32)
    status = matrix._call(matrix._address, x.data_ptr(), x.numel() // matrix.k, out.data_ptr(), torch.get_num_threads())
    if status:
        raise NativeKernelError(f"native matmul of {matrix.rows} x {matrix.k} failed: {_STATUS.get(status, status)}")
    return out


def dequantize(ggml_type: int, blocks: torch.Tensor, k: int, ids: torch.Tensor | None = None) -> torch.Tensor:
    """Rows `ids` (1-D int64; every row when None) of W as fp32 (len(ids), K): exactly gguf's values."""
    lib = library()
    if ids is not None:
        ids = ids.to(torch.int64).contiguous()
    n = blocks.shape[0] if ids is None else ids.shape[0]
    out = torch.empty(n, k, dtype=torch.float32)
    status = lib.dequantize(ggml_type, blocks.data_ptr(), blocks.stride(0), blocks.shape[0],
                            None if ids is None else ids.data_ptr(), n, k, out.data_ptr(), torch.get_num_threads())
    if status:
        raise NativeKernelError(f"native dequantize refused {TYPES.get(ggml_type, ggml_type)} "
                                f"{tuple(blocks.shape)}: {_STATUS.get(status, status)} (row ids out of range?)")
    return out


# ---- finding or building the library ---------------------------------------------------------------------------


def native_dir() -> Path:
    """Where builds live: $LLMTRACE_NATIVE_DIR, else the cache folder's native/ (neither checked nor created)."""
    if os.environ.get(DIR_ENV):
        return Path(os.environ[DIR_ENV]).expanduser()
    return cache_root() / "native"


def _private_native_dir() -> Path:
    """native_dir(), created if need be, once it is trusted (tracer/core/cache_dirs.py): code from it is dlopened,
    so a folder another user can write is UntrustedPathError, never used. OSError when it cannot be created."""
    if os.environ.get(DIR_ENV):
        return private_folder(native_dir(), "kernel folder", DIR_ENV, create=True)
    private_folder(cache_root(), "cache folder", CACHE_ENV, create=True)
    return private_folder(native_dir(), "kernel folder", CACHE_ENV, create=True)


@functools.cache
def _outcome() -> _Outcome:
    compiler = shlex.split(os.environ.get(CC_ENV, "") or "cc")
    version = _compiler_version(compiler)
    if version is None:
        return _Outcome(None, f"no C compiler: `{' '.join(compiler)}` does not run (set ${CC_ENV} to one)")
    key = _key(compiler, version)
    folder = native_dir()
    try:
        folder = _private_native_dir()
    except OSError as exc:
        return _Outcome(None, f"cannot write the compiled kernel to {folder}: {exc.strerror or exc}")
    library, why = _load_current(folder, key)
    if library is not None:
        return _Outcome(library, "")
    try:
        with _building(folder):
            library, why = _load_current(folder, key)  # built by another process while this one waited
            if library is not None:
                return _Outcome(library, "")
            flags, error = _build(compiler, folder, key)
    except OSError as exc:
        if not folder.is_dir():
            return _Outcome(None, _REMOVED.format(folder=folder))
        return _Outcome(None, f"cannot write the compiled kernel to {folder}: {exc.strerror or exc}")
    if flags is None:
        if not folder.is_dir():  # the linker's "cannot open output file" would blame the compiler
            return _Outcome(None, _REMOVED.format(folder=folder))
        return _Outcome(None, f"`{' '.join(compiler)}` could not compile the native library: {error}")
    library, why = _load_current(folder, key)
    if library is None:
        return _Outcome(None, f"the compiled kernel does not work: {why}")
    return _Outcome(library, "")


@contextlib.contextmanager
def _building(folder: Path) -> Iterator[None]:
    """Hold the folder's build lock for the block (waiting for another process's build to end), first removing what
    killed builds left: under the lock no other build is running, so every partial file is a dead one's."""
    fd = os.open(folder / LOCK_NAME, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        remove_partials(folder)
        yield
    finally:
        os.close(fd)  # releases the lock


def remove_partials(folder: Path) -> list[Path]:
    """Remove the temporary files and probe folders of builds that did not finish; the paths removed. Call only
    while holding the build lock."""
    removed = []
    for pattern in PARTIAL_GLOBS:
        for path in folder.glob(pattern):
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)
            removed.append(path)
    return removed


def _compiler_version(compiler: list[str]) -> str | None:
    try:
        done = subprocess.run([*compiler, "--version"], capture_output=True, text=True, timeout=30, check=False)
    except (OSError, subprocess.SubprocessError, ValueError):
        return None
    return done.stdout.strip() if done.returncode == 0 and done.stdout.strip() else None


def _cpu() -> str:
    """The CPU as -march=native sees it: model name and feature flags (Linux), else what platform knows."""
    fields = {}
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as fh:
            for line in fh:
                name, _, value = line.partition(":")
                name = name.strip()
                if name in ("model name", "flags", "Features", "CPU part") and name not in fields:
                    fields[name] = value.strip()
                if not line.strip() and fields:
                    break
    except OSError:
        pass
    return f"{platform.machine()} {platform.processor()} {sorted(fields.items())}"


@functools.cache
def sources_digest() -> str:
    """A short digest of the C sources' text: what a saved kernel choice was measured with (tracer/load/kernel_pick.py
    keys its saved choices by it, so a changed kernel is measured again rather than judged by old timings). Read once
    per process: every `run` of a GGUF looks its choice up."""
    h = hashlib.sha256()
    for path in SOURCES:
        h.update(path.read_bytes())
    return h.hexdigest()[:12]


def _key(compiler: list[str], version: str) -> str:
    h = hashlib.sha256()
    parts = [path.read_bytes() for path in SOURCES]
    for part in (*parts, " ".join(compiler).encode(), version.encode(), repr((FLAG_SETS, COMMON_FLAGS, LIBS)).encode(),
                 _cpu().encode(), f"{ABI} {STEP_ABI}".encode()):
        h.update(len(part).to_bytes(8, "little"))
        h.update(part)
    return h.hexdigest()[:20]


# Compiled with each flag set in turn to find the first the compiler takes: a trivial unit that includes omp.h under
# OpenMP, as the kernel does.
_PROBE = """#ifdef _OPENMP
#include <omp.h>
int llmt_probe(void) { return omp_get_max_threads(); }
#else
int llmt_probe(void) { return 1; }
#endif
"""


def _compile(compiler: list[str], flags: tuple[str, ...], units: list[Path], out: str) -> str:
    """Compile `units` (.c files) and link them into the shared library `out`; "" when it compiled, else the
    compiler's first line that says "error" (gcc and clang end with the source line and a caret under it), or its
    last line. Several units are compiled at once, one compiler process each (up to the CPUs there are), into
    objects in a temporary folder beside `out`, then linked: the library's ~4 s of compiling, one unit after
    another, is a first run's largest cost after the model's load (BENCHMARKS.md, "The first run")."""
    if len(units) == 1:
        return _run_compiler([*compiler, *flags, *COMMON_FLAGS, "-o", out, str(units[0]), *LIBS])
    with tempfile.TemporaryDirectory(dir=Path(out).parent, prefix=OBJECTS_PREFIX) as tmp:
        objects = [str(Path(tmp) / f"{unit.stem}.o") for unit in units]
        commands = [[*compiler, *flags, *UNIT_FLAGS, "-c", "-o", obj, str(unit)] for unit, obj in zip(units, objects)]
        with ThreadPoolExecutor(max_workers=max(1, min(len(commands), os.cpu_count() or 1))) as pool:
            errors = [error for error in pool.map(_run_compiler, commands) if error]
        if errors:
            return errors[0]
        return _run_compiler([*compiler, *flags, *COMMON_FLAGS, "-o", out, *objects, *LIBS])


def _run_compiler(command: list[str]) -> str:
    """One compiler command: "" when it succeeded, else its error line (_error_line)."""
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=COMPILE_TIMEOUT_S, check=False)
    except (OSError, subprocess.SubprocessError) as exc:
        return str(exc) or type(exc).__name__
    return "" if done.returncode == 0 else _error_line(done.returncode, done.stderr or done.stdout)


def _error_line(returncode: int, text: str) -> str:
    """A failed compile's first line that says "error", or its last line, or its exit status."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    errors = [line for line in lines if "error" in line.lower()]
    return (errors or lines or [f"exit status {returncode}"])[0 if errors else -1]


def _flags_taken(compiler: list[str], folder: Path) -> tuple[tuple[str, ...] | None, str]:
    """The first of FLAG_SETS this compiler builds a trivial OpenMP-aware library with, or (None, its last error).
    Chosen on a probe, not on the kernel itself: the kernel failing under -march=native (an error in its AVX2 or
    AVX-512 code) must fail the build, not quietly fall back to a build without those paths."""
    error = ""
    with tempfile.TemporaryDirectory(dir=folder, prefix=".probe-") as tmp:
        probe = Path(tmp) / "probe.c"
        probe.write_text(_PROBE, encoding="ascii")
        for flags in FLAG_SETS:
            error = _compile(compiler, flags, [probe], str(Path(tmp) / "probe.so"))
            if not error:
                return flags, ""
    return None, error


def _build(compiler: list[str], folder: Path, key: str) -> tuple[tuple[str, ...] | None, str]:
    """Compile into `folder` under a temporary name, rename to its content name, point the key's pointer at it.
    Returns (the flags it compiled with, "") or (None, the compiler's error line)."""
    flags, error = _flags_taken(compiler, folder)
    if flags is None:
        return None, error
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".gguf_matmul-{key}.", suffix=".so.partial")
    os.close(fd)
    try:
        error = _compile(compiler, flags, [path for path in SOURCES if path.suffix == ".c"], tmp)
        if error:
            return None, f"{error} (flags {' '.join(flags)})"
        os.chmod(tmp, 0o755)  # never group- or other-writable, whatever the umask (a loader refuses such a file)
        digest = hashlib.sha256(Path(tmp).read_bytes()).hexdigest()
        name = f"gguf_matmul-{key}-{digest}.so"
        os.replace(tmp, folder / name)
        pointer = folder / f"gguf_matmul-{key}.txt"
        write_atomic(pointer, f"{name}\n{' '.join(flags)}\n")
        os.chmod(pointer, 0o644)
        return flags, ""
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


_I, _P, _I64 = ctypes.c_int, ctypes.c_void_p, ctypes.c_int64
# The entry points called through the library's handle (the products', native/gguf_matmul.c; the decode step's
# sizes, decode_step.c; a map's SIGBUS guard, mapped_file.c; the loader's passes over a file's blocks, int8_groups.c
# and scales.c): name -> (argument types, or None to leave them
# undeclared, result type). The decode step itself runs holding the GIL: native_step.py declares it on a PyDLL.
_SIGNATURES = {
    "llmt_describe": ([_I, ctypes.POINTER(_I), ctypes.POINTER(_P), ctypes.POINTER(_I64), ctypes.POINTER(_I64), _I64,
                       ctypes.POINTER(_I), _P], _I),
    "llmt_matmul": ([_P, _P, _I64, _P, _I], _I),
    "llmt_matrix_size": (None, _I64),
    "llmt_dequantize": ([_I, _P, _I64, _I64, _P, _I64, _I64, _P, _I], _I),
    "llmt_interleave": ([_I, _P, _I64, _I64, _I64, _P], _I),
    "llmt_set_groups": ([_P, _I, _P], _I),
    "llmt_group_rows": ([_I, _P, _I64, _I64, _P, _I64, _P], _I),
    "llmt_step_layer_size": ([], _I64),
    "llmt_step_plan_size": ([], _I64),
    "llmt_step_scratch_floats": ([_P, _I], _I64),
    "llmt_step_stamps": ([_P, _I], _I64),
    "llmt_guard_map": ([_P, _I64, ctypes.c_char_p], _I),
    "llmt_unguard_map": ([_P], None),
    "llmt_hold_groups": ([_I, _P, _I64, _I64, _I64, _I64, _P, _I], _I),
    "llmt_scales_finite": ([_I, _P, _I64, _I], _I),
}


def _declared(handle: ctypes.CDLL, name: str, argtypes: list | None, restype: type) -> ctypes._CFuncPtr:
    """The library's entry point `name` with its C signature declared (ctypes then converts and checks the calls)."""
    call = getattr(handle, name)
    if argtypes is not None:
        call.argtypes = argtypes
    call.restype = restype
    return call


def _load_current(folder: Path, key: str) -> tuple[NativeLibrary | None, str]:
    """The library the key's pointer names, if it is whole, loads, has this ABI and passes the self-test; else
    (None, why). The pointer is the record of what a build of this user made from these sources: the library's name
    and SHA-256. Both files must be the user's own and not writable by group or others (UntrustedPathError: never
    loaded, since dlopen runs constructors before any check of ours), and the library's bytes are hashed through
    the descriptor checked, which stays open (its inode cannot be reused) until the loaded file is compared with it."""
    pointer = folder / f"gguf_matmul-{key}.txt"
    try:
        text = _read_owned(pointer, "the kernel record", MAX_POINTER_BYTES)
        name, flag_line = text.decode("utf-8").splitlines()[:2]
    except (OSError, ValueError, UnicodeDecodeError):
        return None, "not built yet"
    if not _NAME.fullmatch(name):
        return None, "damaged pointer file"
    path = folder / name
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None, "library file missing"
    try:
        st = check_owned_file(fd, path, "the compiled kernel")
        if st.st_size > MAX_LIBRARY_BYTES:
            return None, "library file damaged"
        h = hashlib.sha256()
        with os.fdopen(os.dup(fd), "rb") as fh:
            while block := fh.read(1 << 20):
                h.update(block)
        if h.hexdigest() != name[-67:-3]:
            return None, "library file damaged"
        try:
            # by its path, not /proc/self/fd/N: glibc hands back an already loaded library of the same name, and
            # descriptor numbers are reused. The folder is the user's alone, so the file cannot change hands
            # between the hash and the load; the identity check below sees a swap by the user's own processes.
            handle = ctypes.CDLL(str(path))
            now = os.stat(path)
            if (now.st_dev, now.st_ino) != (st.st_dev, st.st_ino):
                return None, "library file replaced while loading"
            if handle.llmt_abi() != ABI or handle.llmt_step_abi() != STEP_ABI:
                return None, "library of another ABI"
            features = handle.llmt_features()
        except (OSError, AttributeError) as exc:
            return None, f"library does not load ({exc})"
    finally:
        os.close(fd)
    calls = {name: _declared(handle, name, *signature) for name, signature in _SIGNATURES.items()}
    library = NativeLibrary(path, tuple(flag_line.split()), bool(features & 1), bool(features & 2),
                            calls["llmt_describe"], calls["llmt_matmul"], calls["llmt_dequantize"],
                            int(handle.llmt_matrix_size()), calls["llmt_interleave"], calls["llmt_set_groups"],
                            calls["llmt_group_rows"], handle)
    why = _self_test(library)
    return (library, "") if not why else (None, why)


def _read_owned(path: Path, what: str, limit: int) -> bytes:
    """A small file's bytes once it is a regular file of the user's own that no one else can write (OSError when it
    is absent or a symlink, UntrustedPathError when someone else could have written it); at most `limit` bytes."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        check_owned_file(fd, path, what)
        return os.read(fd, limit)
    finally:
        os.close(fd)


def _self_test(lib: NativeLibrary) -> str:
    """Two Q8_0 rows (d = 1, q = j - 16 and 16 - j) times x = 1..32 for one and for two activation rows: integer
    sums, exact in fp32, through both code paths (the one-row kernel and the tiled one); then the i8dot kernel with
    x = 127 - 8j (max |x| = 127, so x is its own int8 code and the sums are exact too), and the i16dot one with
    x = 32767 - 2048j (its own int16 code). "" when right."""
    block = bytearray()
    for sign in (1, -1):
        block += bytes([0x00, 0x3C])  # fp16 1.0
        block += bytes(((sign * (j - 16)) & 0xFF) for j in range(32))
    blocks = (ctypes.c_uint8 * len(block)).from_buffer(block)
    x = (ctypes.c_float * 64)(*[float(j + 1) for j in range(32)] * 2)
    want = sum((j - 16) * (j + 1) for j in range(32))
    described = ctypes.create_string_buffer(lib.matrix_size)
    x8 = (ctypes.c_float * 64)(*[float(127 - 8 * j) for j in range(32)] * 2)
    want8 = sum((j - 16) * (127 - 8 * j) for j in range(32))
    x16 = (ctypes.c_float * 64)(*[float(32767 - 2048 * j) for j in range(32)] * 2)
    want16 = sum((j - 16) * (32767 - 2048 * j) for j in range(32))
    for kind, inputs, expected in ((EXACT_X, x, want), (INT8_X, x8, want8), (INT16_X, x16, want16)):
        status = lib.describe(1, (ctypes.c_int * 1)(8), (ctypes.c_void_p * 1)(ctypes.addressof(blocks)),
                              (ctypes.c_int64 * 1)(34), (ctypes.c_int64 * 1)(2), 32, (ctypes.c_int * 1)(kind),
                              described)
        if status:
            return f"self-test failed (status {status} describing the matrix)"
        for m in (1, 2):
            out = (ctypes.c_float * (2 * m))()
            status = lib.matmul(described, ctypes.addressof(inputs), m, ctypes.addressof(out), 1)
            if status or list(out) != [float(expected), float(-expected)] * m:
                kernel = {EXACT_X: "exact", INT8_X: "i8dot", INT16_X: "i16dot"}[kind]
                return f"self-test failed ({kernel}: status {status}, {list(out)} for {m} row(s))"
    values = (ctypes.c_float * 64)()
    status = lib.dequantize(8, ctypes.addressof(blocks), 34, 2, None, 2, 32, ctypes.addressof(values), 1)
    if status or list(values[:32]) != [float(j - 16) for j in range(32)]:
        return "self-test of dequantization failed"
    return ""
