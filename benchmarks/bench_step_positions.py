"""The bundled model's native decode step at fixed cache positions, built from several C source folders and called
in turn on one plan: for a change whose effect grows with the cache (the attention), where a whole step's time
drifts more between child processes on a shared machine than the change moves it.

    /work/tools/quiet .venv/bin/python -m benchmarks.bench_step_positions 5,130,400 120 cur /tmp/main-native

One process loads the bundled model (default weights, 2 threads), prefills max(POSITIONS)+1 random tokens (seed 0)
and holds this tree's native step plan. Each variant is `cur` (this tree's tracer/model/native) or a folder holding
decode_step.c, gguf_matmul.c, int8_dot.c (top_values.c too before step ABI 5) and those of int8_groups.c (ABI 7 on)
and int16_dot.c (ABI 6 on) it has, built by a child process into FOLDER/build as native_kernel builds (the step's
ABI must match this tree's: the plan is this tree's structs; a build before ABI 7 reads an i8dot Q4 matrix's rows from the file's map,
not the arena). At each position every variant's llmt_decode_step is called ROUNDS times in turn (A B A B ...),
untraced, writing the same K and V row; then as often traced, its readings giving the scores, softmax and values stages' times summed over the layers.
Printed per position and variant: the step's p10 and median (ms), the three stages' medians (ms), and the largest
logit difference from the first variant.
"""

from __future__ import annotations

import ctypes
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent.parent


def build(folder: Path) -> Path:
    """The library native_kernel builds from `folder`'s sources, in folder/build (built by a child process)."""
    code = ("import sys; from pathlib import Path; from llmtrace.tracer.model import native_kernel as k; "
            "from benchmarks.run_with_native_source import use_sources; "
            "f = Path(sys.argv[1]); use_sources(f, f / 'build'); print(k.library().path)")
    done = subprocess.run([sys.executable, "-c", code, str(folder)], capture_output=True, text=True, cwd=HERE)
    if done.returncode:
        sys.exit(f"{folder}: {done.stderr[-2000:]}")
    return Path(done.stdout.strip().splitlines()[-1])


def main() -> None:
    import torch

    from llmtrace.tracer.load.loader import load_model
    from llmtrace.tracer.model import native_kernel
    from llmtrace.tracer.run.backends import backend_for

    positions, rounds, variants = [int(p) for p in sys.argv[1].split(",")], int(sys.argv[2]), sys.argv[3:]
    print("load average before:", os.getloadavg(), flush=True)
    torch.set_num_threads(2)
    model = load_model(None).model
    model.setup_cache(1, max(positions) + 8)
    torch.manual_seed(0)
    ids = torch.randint(100, 20000, (1, max(positions) + 1))  # (1, T)
    model.prefill(ids)
    plan = backend_for(model).plan
    step = plan.native
    if step is None:
        sys.exit(f"no native step: {plan.native_reason}")
    calls = []
    for variant in variants:
        path = native_kernel.library().path if variant == "cur" else build(Path(variant))
        call = ctypes.PyDLL(str(path)).llmt_decode_step
        call.argtypes, call.restype = step._step.argtypes, ctypes.c_int
        calls.append(call)
    layers = model.config.n_layers
    logits = torch.empty(1, step.vocab)  # (1, V)
    stamps = torch.zeros(step.stamp_count, dtype=torch.int64)
    for position in positions:
        args = [step._address, int(ids[0, position]), position, logits.data_ptr(), None, 2, 0, None, None]
        outs = []
        for call in calls:
            assert call(*args) == 0
            outs.append(logits.clone())
        whole: list[list[int]] = [[] for _ in calls]
        stages: list[list[tuple[int, ...]]] = [[] for _ in calls]
        for _ in range(rounds):
            for i, call in enumerate(calls):
                start = time.perf_counter_ns()
                call(*args)
                whole[i].append(time.perf_counter_ns() - start)
        args[4] = stamps.data_ptr()
        for _ in range(rounds):
            for i, call in enumerate(calls):
                call(*args)
                r = stamps.tolist()  # start, embedding, then 14 a layer: scores, softmax, values end at 5, 6, 7
                stages[i].append(tuple(sum(r[2 + 14 * l + k] - r[1 + 14 * l + k] for l in range(layers))
                                       for k in (4, 5, 6)))
        for i, variant in enumerate(variants):
            ordered = sorted(whole[i])
            print(json.dumps({"position": position, "variant": variant,
                              "step p10": round(ordered[len(ordered) // 10] / 1e6, 3),
                              "step median": round(statistics.median(ordered) / 1e6, 3),
                              "scores, softmax, values": [round(statistics.median(s[k] for s in stages[i]) / 1e6, 3)
                                                          for k in range(3)],
                              "max logit difference": float((outs[i] - outs[0]).abs().max())}), flush=True)
    print("load average after:", os.getloadavg())


if __name__ == "__main__":
    main()
