"""The native kernels' one-row (decode) products side by side: a baseline build, the current one's exact kernel
("native"), its int8-activation kernel ("i8dot", the same library, each matrix described with int8 activations) and
the per-type plans "i8+nat" (the layers on i8dot, a Q8_0 or Q6_K head on native: Q4_1:i8dot,Q8_0:native) and
"i8+i16" (the head on the int16-activation kernel instead: Q4_1:i8dot,Q8_0:i16dot); the baseline's i8dot too ("base i8"),
built with the baseline's own int8_dot.c (a revision's, or the file beside a baseline file), so a change to either
file is measured against it.

Each build is tracer/model/native/gguf_matmul.c alone (or the baseline's text of it, from a git revision or a file)
compiled with native_kernel's own flags into a temporary folder and called through ctypes as llmtrace calls it
(llmt_describe once, llmt_matmul per product, one activation row). Calls of the builds are interleaved, so a slow
spell of a shared machine hits both; medians and bests (the fastest call: what the code can do when nothing else
runs) are reported as GB/s of stored bytes streamed.

- per shape: one matrix called over and over (its bytes stay in L2/L3: the kernel's arithmetic rate);
- "step": a decode step's products in their order (every layer's matrices, then the LM head), each matrix its
  own memory, ~100 MB in all: the bytes come from DRAM as in a real decode step, so this is the figure that sets
  decode speed.

Shapes: the bundled SmolLM2-135M (`--model smollm2`: Q4_1 layers and a Q8_0 head by default; 30 layers of wq|wk|wv
960x576, wo 576x576, w1|w3 3072x576, w2 576x1536, head 49152x576), or a 2048-wide LLaMA (`--model llama2048`:
TinyLlama-1.1B's shapes, for the K-quants whose 256-value blocks 576 does not hold; 4 layers + a 32000x2048 head).

With `--in-model ROUNDS`, also the bundled model itself (`--weights native`, 2 threads) in child processes, one
per build and round, alternated (benchmarks/run_with_native_source.py builds the baseline): 128 `decode_one` steps
after a 5-token prompt, each step's forward and the time inside its weight products (PackedWeight calls: the
kernel plus its ctypes call and output allocation); the 10th percentile and the median over the steps; and the
current build with the i8dot plans (`--weights Q4_1:i8dot,Q8_0:native` and `Q4_1:i8dot,Q8_0:i16dot`). The
baseline's gguf_matmul.c is built with the current decode_step.c, so it must have the current ABI (7: the per-part
activation kind and interleaved groups) for --in-model.

    /work/tools/quiet .venv/bin/python -m benchmarks.bench_native_rows --baseline main --in-model 4
    /work/tools/quiet .venv/bin/python -m benchmarks.bench_native_rows --layers Q4_K --head Q6_K --model llama2048
"""

from __future__ import annotations

import argparse
import copy
import ctypes
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import gguf
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from llmtrace.tracer.model import native_kernel  # noqa: E402
from tests.tiny_gguf import random_blocks  # noqa: E402

Q = gguf.GGMLQuantizationType
REPO = Path(__file__).resolve().parent.parent
MODELS = {  # (layer matrices as (rows, k), layers, head rows, width)
    "smollm2": ([(960, 576), (576, 576), (3072, 576), (576, 1536)], 30, 49152, 576),
    "llama2048": ([(2560, 2048), (2048, 2048), (11264, 2048), (2048, 5632)], 4, 32000, 2048),
}
NAMES = ["wq|wk|wv", "wo", "w1|w3", "w2"]


class Build:
    """One compiled source, loaded: llmt_describe and llmt_matmul through ctypes; `acts`: {ggml type: activation
    kind} its matrices are described with (ABI 5: 1 is i8dot; ABI 6: 2 is i16dot, Q8_0 and Q6_K); a type not there: 0,
    exact."""

    def __init__(self, label: str, source: str, folder: Path, beside: dict[str, str | None] | None = None) -> None:
        self.label = label
        self.acts: dict[int, int] = {}
        folder = folder / label
        folder.mkdir()
        path = folder / f"{label}.c"
        path.write_text(source)
        for name, text in (beside or {}).items():  # #include "int8_dot.c" looks beside the including file before -I
            if text is not None:
                (folder / name).write_text(text)
        library = folder / f"{label}.so"
        compiler = os.environ.get("CC", "cc").split()
        flags = (*native_kernel.FLAG_SETS[0], *native_kernel.COMMON_FLAGS)
        # -I: the source's #includes (kernels.h, or before the units were separate int8_dot.c) from the source folder;
        # a source that is one unit of several (it includes kernels.h) is linked with the other units, each the
        # one given beside it, else today's
        units = [path]
        if '#include "kernels.h"' in source:
            units += [folder / other.name if (folder / other.name).is_file() else other
                      for other in sorted(native_kernel.NATIVE_SOURCES.glob("*.c")) if other.name != "gguf_matmul.c"]
        subprocess.run([*compiler, *flags, "-I", str(native_kernel.NATIVE_SOURCES), "-o", str(library),
                        *map(str, units), *native_kernel.LIBS], check=True)
        handle = ctypes.CDLL(str(library))
        self.abi = int(handle.llmt_abi())
        self.describe = handle.llmt_describe
        self.describe.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_int), ctypes.POINTER(ctypes.c_void_p),
                                  ctypes.POINTER(ctypes.c_int64), ctypes.POINTER(ctypes.c_int64), ctypes.c_int64,
                                  *([ctypes.POINTER(ctypes.c_int)] if self.abi >= 5 else []), ctypes.c_void_p]
        self.matmul = handle.llmt_matmul
        self.matmul.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int]
        handle.llmt_matrix_size.restype = ctypes.c_int64
        self.size = int(handle.llmt_matrix_size())
        # ABI 7 on: an i8dot Q4_0/Q4_1 matrix's products read its rows interleaved (in sixteens now), made as the
        # loader makes them (native/int8_groups.c) and kept alive here with the description
        self.interleave = getattr(handle, "llmt_interleave", None)
        self.set_groups = getattr(handle, "llmt_set_groups", None)
        self.kept: list[np.ndarray] = []

    def with_acts(self, label: str, acts: dict[int, int]) -> Build:
        """The same library, its matrices described with activation kinds `acts` {ggml type: kind}."""
        assert self.abi >= (6 if 2 in acts.values() else 5), f"activation kinds {acts} need a newer ABI"
        other = copy.copy(self)
        other.label, other.acts = label, acts
        return other

    def matrix(self, qtype: Q, blocks: np.ndarray, k: int) -> ctypes.Array:
        described = ctypes.create_string_buffer(self.size)
        int8 = [(ctypes.c_int * 1)(self.acts.get(int(qtype), 0))] if self.abi >= 5 else []
        status = self.describe(1, (ctypes.c_int * 1)(int(qtype)), (ctypes.c_void_p * 1)(blocks.ctypes.data),
                               (ctypes.c_int64 * 1)(blocks.shape[1]), (ctypes.c_int64 * 1)(blocks.shape[0]), k,
                               *int8, described)
        assert status == 0, status
        if self.acts.get(int(qtype)) == 1 and self.interleave is not None and qtype in (Q.Q4_0, Q.Q4_1):
            groups = np.empty(blocks.shape[0] // 8 * 8 * blocks.shape[1], dtype=np.uint8)
            assert self.interleave(int(qtype), ctypes.c_void_p(blocks.ctypes.data), ctypes.c_int64(blocks.shape[1]),
                                   ctypes.c_int64(blocks.shape[0]), ctypes.c_int64(k),
                                   ctypes.c_void_p(groups.ctypes.data)) == 0
            assert self.set_groups(described, 0, ctypes.c_void_p(groups.ctypes.data)) == 0
            self.kept.append(groups)
        return described


def baseline_source(spec: str, name: str = "gguf_matmul.c") -> str | None:
    """A file's text (for int8_dot.c and int8_groups.c: the file of that name beside it), else `git show
    SPEC:tracer/model/native/NAME`; None when there is no such file (a revision before int8_groups.c)."""
    if Path(spec).is_file():
        beside = Path(spec).with_name(name)
        return Path(spec).read_text() if name == "gguf_matmul.c" else beside.read_text() if beside.is_file() else None
    done = subprocess.run(["git", "-C", str(REPO), "show", f"{spec}:tracer/model/native/{name}"],
                          capture_output=True, text=True)
    if done.returncode and name == "gguf_matmul.c":
        sys.exit(f"no baseline {spec}: {done.stderr.strip()}")
    return done.stdout if done.returncode == 0 else None


def timed(call) -> float:
    start = time.perf_counter()
    call()
    return time.perf_counter() - start


def compare(builds: list[Build], matrices: list[tuple[Q, np.ndarray, int]], x: np.ndarray, out: np.ndarray,
            threads: int, runs: int) -> list[tuple[float, float]]:
    """(median, best) seconds per build for one pass over `matrices`, the builds' passes interleaved."""
    described = [[build.matrix(qtype, blocks, k) for qtype, blocks, k in matrices] for build in builds]
    calls = [[(build.matmul, m) for m in mats] for build, mats in zip(builds, described)]
    xp, op = x.ctypes.data, out.ctypes.data

    def one_pass(build_calls):
        for matmul, m in build_calls:
            matmul(m, xp, 1, op, threads)

    for build_calls in calls:  # warm-up
        one_pass(build_calls)
    times = [[] for _ in builds]
    for _ in range(runs):
        for i, build_calls in enumerate(calls):
            times[i].append(timed(lambda: one_pass(build_calls)))
    return [(float(np.median(t)), min(t)) for t in times]


def model_steps(weights: str = "native", steps: int = 128) -> dict[str, float]:
    """This process's build in the bundled model under `weights`: percentiles (ms) of decode steps and of their
    products (the products' share is 0 when the native decode step runs them inside its one C call)."""
    import torch

    from llmtrace.tracer.load.loader import load_model
    from llmtrace.tracer.model.weight_formats import PackedWeight

    torch.set_num_threads(2)
    loaded = load_model(None, weights=weights)
    model = loaded.model
    ids = torch.tensor([list(loaded.tokenizer.encode("The capital of France is"))])  # (1, T)
    token = ids[:, -1:]  # (1, 1)
    spent = [0]
    original = PackedWeight.__call__

    def timed(self, *args, **kwargs):
        start = time.perf_counter_ns()
        out = original(self, *args, **kwargs)
        spent[0] += time.perf_counter_ns() - start
        return out

    PackedWeight.__call__ = timed
    from llmtrace.tracer.run.backends import backend_for

    model.setup_cache(1, ids.shape[1] + 5)
    run = backend_for(model)
    run.prefill(ids)
    for _ in range(4):  # warm-up
        run.decode(token)
    forward, products = [], []
    model.setup_cache(1, ids.shape[1] + steps + 1)
    run = backend_for(model)
    run.prefill(ids)
    for _ in range(steps):
        spent[0] = 0
        start = time.perf_counter_ns()
        run.decode(token)
        forward.append(time.perf_counter_ns() - start)
        products.append(spent[0])
    PackedWeight.__call__ = original
    return {f"{name} p{p}": float(np.percentile(values, p)) / 1e6
            for name, values in (("forward", forward), ("products", products)) for p in (10, 50)}


def in_model(baseline: str, rounds: int) -> None:
    """Alternate child processes of the baseline build and the current one; print each round and the medians."""
    plans = {"i8+nat": "Q4_1:i8dot,Q8_0:native", "i8+i16": "Q4_1:i8dot,Q8_0:i16dot"}
    results: dict[str, list[dict[str, float]]] = {"baseline": [], "current": [], **{label: [] for label in plans}}
    for round_ in range(rounds):
        for label in results:
            command = [sys.executable, "-m", "benchmarks.run_with_native_source", baseline] if label == "baseline" \
                else [sys.executable]
            weights = [plans[label]] if label in plans else []
            done = subprocess.run([*command, "-m", "benchmarks.bench_native_rows", "--model-child", *weights],
                                  cwd=REPO, check=True, capture_output=True, text=True)
            results[label].append(json.loads(done.stdout.strip().splitlines()[-1]))
            print(f"  round {round_ + 1} {label:8}", {k: round(v, 2) for k, v in results[label][-1].items()}, flush=True)
    for label, rows in results.items():
        print(f"  median of rounds, {label:8}", {k: round(float(np.median([r[k] for r in rows])), 2) for k in rows[0]})


def main() -> None:
    if sys.argv[1:2] == ["--model-child"]:
        print(json.dumps(model_steps(*sys.argv[2:3])))
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", default="main", help="git revision or file of the baseline source ('' none)")
    parser.add_argument("--layers", default="Q4_1", help="layer matrices' type")
    parser.add_argument("--head", default="Q8_0", help="LM head's type")
    parser.add_argument("--model", default="smollm2", choices=sorted(MODELS))
    parser.add_argument("--runs", type=int, default=15, help="steps per build and thread count")
    parser.add_argument("--in-model", type=int, default=0, metavar="ROUNDS",
                        help="also the bundled model's decode steps, ROUNDS child processes per build")
    args = parser.parse_args()
    layer_type, head_type = Q[args.layers], Q[args.head]
    shapes, n_layers, head_rows, width = MODELS[args.model]
    rng = np.random.default_rng(0)
    print("load average before:", os.getloadavg())
    with tempfile.TemporaryDirectory() as tmp:
        builds = [Build("current", (native_kernel.NATIVE_SOURCES / "gguf_matmul.c").read_text(), Path(tmp))]
        int8 = {int(t): 1 for t in (layer_type, head_type)}
        builds.append(builds[0].with_acts("i8dot", int8))
        if head_type in (Q.Q8_0, Q.Q6_K) and layer_type != head_type:  # the types i16dot runs
            builds.append(builds[0].with_acts("i8+nat", {int(layer_type): 1}))
            builds.append(builds[0].with_acts("i8+i16", {int(layer_type): 1, int(head_type): 2}))
        if args.baseline:
            baseline = Build("baseline", baseline_source(args.baseline), Path(tmp),
                             {name: baseline_source(args.baseline, name)
                              for name in ("int8_dot.c", "int8_groups.c", "int16_dot.c")})
            builds[:0] = [baseline] + ([baseline.with_acts("base i8", int8)] if baseline.abi >= 5 else [])
        labels = " | ".join(f"{b.label} med / best" for b in builds)
        layers = [[(layer_type, random_blocks(layer_type, n, k, rng), k) for n, k in shapes] for _ in range(n_layers)]
        head = (head_type, random_blocks(head_type, head_rows, width, rng), width)
        step = [m for layer in layers for m in layer] + [head]
        step_bytes = sum(blocks.nbytes for _, blocks, _ in step)
        x = rng.standard_normal(max(k for _, k in shapes)).astype(np.float32)
        out = np.empty(head_rows, dtype=np.float32)
        for threads in (1, 2):
            print(f"{threads} thread(s); GB/s of stored bytes: {labels}")
            for name, matrix in zip(NAMES + ["head"], layers[0] + [head]):
                runs = 200 if matrix is not head else 15
                result = compare(builds, [matrix], x, out, threads, runs)
                rows, k = matrix[1].shape[0], matrix[2]
                nbytes = matrix[1].nbytes
                cells = " | ".join(f"{nbytes / med / 1e9:6.2f} / {nbytes / best / 1e9:6.2f}" for med, best in result)
                print(f"  {name:9} {matrix[0].name:5} {rows:6}x{k:<5} {cells}", flush=True)
            result = compare(builds, step, x, out, threads, args.runs)
            cells = " | ".join(f"{step_bytes / med / 1e9:6.2f} / {step_bytes / best / 1e9:6.2f}" for med, best in result)
            ms = " | ".join(f"{med * 1e3:.2f} ms" for med, _ in result)
            print(f"  step ({step_bytes / 1e6:.1f} MB) {cells}   (median {ms})", flush=True)
    if args.in_model and args.baseline:
        print("bundled model, --weights native, 2 threads: decode_one ms (forward) and its products' ms")
        in_model(args.baseline, args.in_model)
    print("load average after:", os.getloadavg())


if __name__ == "__main__":
    main()
