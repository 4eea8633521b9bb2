"""The native kernels under AddressSanitizer and valgrind (`make sanitize`; issue 27: what held must not regress).

ASan: the library built with `-fsanitize=address` ($CC carries the flags, so the build key and folder are its own),
the runtime preloaded into Python (LD_PRELOAD; leaks off: Python and torch keep what they allocate), and the tests
that drive the C code run under it: every product, dequantization, interleave and decode-step test, the sampler's
passes, and the hostile-input tests (truncated, corrupted and type-flipped GGUFs through the loaders and, where
they reach it, the kernel). Their CLI subprocesses inherit the environment, so they run under ASan too. A report
ends the process with exit 86, failing the run.

valgrind (memcheck): a driver that imports no torch (valgrind would take minutes to start it) loads the library,
built without AVX-512 (valgrind cannot run those instructions: the AVX2 paths, -march=native less AVX-512), with
ctypes and calls each product entry point: llmt_describe and llmt_matmul for every type the
kernel takes (Q4_0 ... Q6_K) with each activation kind it accepts (exact, int8, int16) at 1, 3 and 8 rows of
activations, llmt_dequantize of all rows and of chosen ids, and llmt_interleave + llmt_set_groups for the i8dot
Q4_0/Q4_1 rows. The blocks are random bytes (scales included: NaN and Inf are values the kernel must survive too).
The decode step (llmt_decode_step, llmt_decode_ahead) is covered by the ASan run only: driving it needs a whole
model's plan.

    python -m benchmarks.sanitize_native            # both
    python -m benchmarks.sanitize_native --asan     # one of them
    python -m benchmarks.sanitize_native --drive LIB   # the valgrind driver itself (no torch)
"""

from __future__ import annotations

import argparse
import ctypes
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
ASAN_FLAGS = "-fsanitize=address -fno-omit-frame-pointer -g"
ASAN_EXIT = 86
SANITIZED_COMPILE_S = 1800  # an instrumented -O3 build of the unity source passed native_kernel's 120 s when busy
VALGRIND_FLAGS = "-mno-avx512f"  # before -march=native, and still winning over it (gcc: an explicit -mno- does)
VALGRIND_EXIT = 99
# the tests that reach the C code, and those that feed it hostile files
ASAN_TESTS = ("tests/test_native_kernel.py", "tests/test_native_step.py", "tests/test_native_staged.py",
              "tests/test_int8_dot.py", "tests/test_int8_groups.py", "tests/test_int16_dot.py",
              "tests/test_int8_step.py", "tests/test_run_ahead.py",
              "tests/test_stored_weights.py", "tests/test_readers_fuzz.py", "tests/test_hostile_input.py",
              "tests/test_bad_input.py")

# Tests of the build's own logic (rebuilds, compilers that fail, two processes building): each compiles the library
# again, minutes apiece when instrumented, and none of them runs a kernel on data. Left out of the ASan run.
ASAN_SKIP = tuple(f"tests/test_native_kernel.py::{name}" for name in (
    "test_a_damaged_build_is_rebuilt_not_loaded", "test_two_processes_building_at_once_leave_one_whole_build",
    "test_without_a_compiler_the_other_kernels_run", "test_a_compiler_that_fails_is_one_line",
    "test_an_error_in_the_vector_code_fails_the_build_rather_than_dropping_the_flags",
    "test_the_build_takes_the_first_flag_set_the_compiler_accepts"))

# native_kernel's constants, repeated here so that the driver imports no torch; `main` checks they still agree.
TYPES = (2, 3, 6, 7, 8, 12, 13, 14)  # Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K
EXACT_X, INT8_X, INT16_X = 0, 1, 2
GROUPED_TYPES = (2, 3)


def drive(path: str) -> int:
    """Call every product entry point of the library at `path` on random blocks; the number of calls made."""
    from llmtrace.tracer.core.ggml_types import GGML_TYPES  # pure Python

    lib = ctypes.CDLL(path)
    i64, ptr, i32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
    lib.llmt_matrix_size.restype = i64
    lib.llmt_describe.argtypes = [i32, ctypes.POINTER(i32), ctypes.POINTER(ptr), ctypes.POINTER(i64),
                                  ctypes.POINTER(i64), i64, ctypes.POINTER(i32), ptr]
    lib.llmt_matmul.argtypes = [ptr, ptr, i64, ptr, i32]
    lib.llmt_dequantize.argtypes = [i32, ptr, i64, i64, ptr, i64, i64, ptr, i32]
    lib.llmt_interleave.argtypes = [i32, ptr, i64, i64, i64, ptr]
    lib.llmt_set_groups.argtypes = [ptr, i32, ptr]
    size = int(lib.llmt_matrix_size())
    rng = random.Random(0)
    k, rows = 512, 17  # two K-quant super-blocks; one interleaved group of sixteen rows (GROUP_ROWS) and one left over
    calls = 0
    for code in TYPES:
        _, values, block = GGML_TYPES[code]
        stride = k // values * block
        data = (ctypes.c_uint8 * (rows * stride))(*(rng.randrange(256) for _ in range(rows * stride)))
        for kind in (EXACT_X, INT8_X, INT16_X):
            described = ctypes.create_string_buffer(size)
            status = lib.llmt_describe(1, (ctypes.c_int * 1)(code), (ctypes.c_void_p * 1)(ctypes.addressof(data)),
                                       (ctypes.c_int64 * 1)(stride), (ctypes.c_int64 * 1)(rows), ctypes.c_int64(k),
                                       (ctypes.c_int * 1)(kind), described)
            calls += 1
            if status:
                continue  # a kind this type does not take (int16 is Q8_0 and Q6_K only)
            groups = None
            if kind == INT8_X and code in GROUPED_TYPES:
                groups = (ctypes.c_uint8 * (16 * stride))()  # the whole group's bytes
                assert lib.llmt_interleave(code, ctypes.addressof(data), ctypes.c_int64(stride), ctypes.c_int64(rows),
                                           ctypes.c_int64(k), ctypes.addressof(groups)) == 0
                assert lib.llmt_set_groups(described, 0, ctypes.addressof(groups)) == 0
                calls += 2
            for m in (1, 3, 8):
                x = (ctypes.c_float * (m * k))(*(rng.uniform(-4, 4) for _ in range(m * k)))
                out = (ctypes.c_float * (m * rows))()
                assert lib.llmt_matmul(described, ctypes.addressof(x), ctypes.c_int64(m), ctypes.addressof(out), 1) == 0
                calls += 1
        out = (ctypes.c_float * (rows * k))()
        ids = (ctypes.c_int64 * 3)(8, 0, 4)
        for chosen, n in ((None, rows), (ids, 3)):
            assert lib.llmt_dequantize(code, ctypes.addressof(data), ctypes.c_int64(stride), ctypes.c_int64(rows),
                                       None if chosen is None else ctypes.addressof(chosen), ctypes.c_int64(n),
                                       ctypes.c_int64(k), ctypes.addressof(out), 1) == 0
            calls += 1
    return calls


def asan(tests: tuple[str, ...]) -> tuple[bool, str]:
    runtime = subprocess.run(["cc", "-print-file-name=libasan.so"], capture_output=True, text=True,
                             check=True).stdout.strip()
    if not os.path.isabs(runtime):
        return False, "no libasan.so for `cc` (install the compiler's sanitizer runtime, e.g. libasan8)"
    env = {**os.environ, "CC": f"{os.environ.get('CC', 'cc')} {ASAN_FLAGS}", "LD_PRELOAD": runtime,
           "ASAN_OPTIONS": f"detect_leaks=0:halt_on_error=1:exitcode={ASAN_EXIT}"}
    with tempfile.TemporaryDirectory(prefix="llmtrace-asan-") as tmp:
        env["LLMTRACE_NATIVE_DIR"] = tmp
        probe = (f"from llmtrace.tracer.model import native_kernel as n; import sys; "
                 f"n.COMPILE_TIMEOUT_S = {SANITIZED_COMPILE_S}; "
                 "sys.exit(0 if n.available() else n.unavailable_reason())")
        built = subprocess.run([sys.executable, "-c", probe], cwd=REPO, env=env, capture_output=True, text=True)
        if built.returncode:
            return False, f"the ASan build failed: {built.stderr.strip()[-300:]}"
        (library,) = Path(tmp).glob("*.so")
        symbols = subprocess.run(["nm", "-D", str(library)], capture_output=True, text=True).stdout
        if "__asan_" not in symbols:
            return False, f"{library} is not instrumented"
        start = time.monotonic()
        done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p",
                               "benchmarks.sanitize_native", *(f"--deselect={node}" for node in ASAN_SKIP), *tests],
                              cwd=REPO, env=env, capture_output=True, text=True)
    # pytest's counts line ("1 failed, 400 passed in 9.1s"); its last line is a progress row when all pass quietly
    counts = [line for line in done.stdout.splitlines() if re.search(r"\d+ (passed|failed|error)", line)]
    summary = (counts or done.stdout.strip().splitlines() or [""])[-1].strip("= ")
    report = "ERROR: AddressSanitizer" in done.stdout + done.stderr or done.returncode == ASAN_EXIT
    if report:
        first = next(line for line in (done.stdout + done.stderr).splitlines() if "AddressSanitizer" in line)
        return False, f"ASan reported: {first}"
    if done.returncode:
        return False, f"tests failed under ASan: {summary}"
    return True, f"ASan: no report; {summary} ({len(tests)} test files, {time.monotonic() - start:.0f} s)"


def valgrind() -> tuple[bool, str]:
    if shutil.which("valgrind") is None:
        return False, "valgrind is not installed (apt-get install valgrind)"
    with tempfile.TemporaryDirectory(prefix="llmtrace-valgrind-") as tmp:
        # valgrind has no AVX-512 (its instructions are SIGILL under it): the AVX2 build, which the ASan run's
        # -march=native build does not take on an AVX-512 machine, so the two runs cover both
        env = {**os.environ, "LLMTRACE_NATIVE_DIR": tmp, "CC": f"{os.environ.get('CC', 'cc')} {VALGRIND_FLAGS}"}
        probe = ("from llmtrace.tracer.model import native_kernel as n; import sys; "
                 "sys.exit(0 if n.available() else n.unavailable_reason())")
        built = subprocess.run([sys.executable, "-c", probe], cwd=REPO, env=env, capture_output=True, text=True)
        if built.returncode:
            return False, f"the build failed: {built.stderr.strip()[-300:]}"
        (library,) = Path(tmp).glob("*.so")
        start = time.monotonic()
        done = subprocess.run(["valgrind", "--tool=memcheck", f"--error-exitcode={VALGRIND_EXIT}", "--leak-check=no",
                               sys.executable, "-m", "benchmarks.sanitize_native", "--drive", str(library)],
                              cwd=REPO, env=env, capture_output=True, text=True)
    errors = [line for line in done.stderr.splitlines() if "ERROR SUMMARY" in line]
    summary = errors[-1].split("==", 2)[-1].strip() if errors else "no summary"
    if done.returncode:
        return False, f"valgrind: exit {done.returncode}, {summary}; {done.stderr.strip()[-300:]}"
    return True, f"valgrind: {done.stdout.strip()}; {summary} ({time.monotonic() - start:.0f} s)"


def pytest_configure(config: object) -> None:
    """Loaded into the ASan run's pytest (-p benchmarks.sanitize_native): the session's own build is instrumented
    too, and needs more than native_kernel's compile timeout."""
    from llmtrace.tracer.model import native_kernel

    native_kernel.COMPILE_TIMEOUT_S = SANITIZED_COMPILE_S


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--asan", action="store_true", help="only the ASan run")
    parser.add_argument("--valgrind", action="store_true", help="only the valgrind run")
    parser.add_argument("--drive", metavar="LIB", help="call the entry points of LIB (what valgrind runs)")
    parser.add_argument("tests", nargs="*", help=f"test files for ASan (default: {len(ASAN_TESTS)} files)")
    args = parser.parse_args()
    if args.drive:
        print(f"{drive(args.drive)} entry-point calls")
        return 0
    from llmtrace.tracer.model import native_kernel

    assert tuple(native_kernel.TYPES) == TYPES and native_kernel.GROUPED_TYPES == GROUPED_TYPES
    assert (native_kernel.EXACT_X, native_kernel.INT8_X, native_kernel.INT16_X) == (EXACT_X, INT8_X, INT16_X)
    ok = True
    for wanted, run in ((args.asan or not args.valgrind, lambda: asan(tuple(args.tests) or ASAN_TESTS)),
                        (args.valgrind or not args.asan, valgrind)):
        if wanted:
            passed, line = run()
            print(line, flush=True)
            ok = ok and passed
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
