"""What a decode step's memory traffic alone streams at on this machine: benchmarks/step_stream.c reads the bundled
model's products' bytes (30 layers of Q|K|V, O, gate|up, down as Q4_1, the Q8_0 LM head: 96.4 MB) in the native
step's pattern (each product halved between 2 threads, a barrier after each) with nothing but a sum, on 4 KiB and on
2 MiB pages, and as one barrier-free run. Set beside the step's own rate it says how much of the gap to the
machine's best read bandwidth is the kernels' arithmetic and how much the traffic's shape.

    /work/tools/quiet .venv/bin/python -m benchmarks.bench_step_stream --rounds 60
    /work/tools/quiet .venv/bin/python -m benchmarks.bench_step_stream --rounds 10 --shape llama-7b-q4_0

`--shape llama-7b-q4_0` streams a LLaMA-7B Q4_0 step's 3.75 GB instead (issue 31's bandwidth bound at 7B).

Built with the system C compiler (`$CC` or `cc`, -O3 -march=native -fopenmp) into a temporary folder; Linux, x86-64
with AVX2.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import tempfile
from pathlib import Path

SOURCE = Path(__file__).resolve().with_name("step_stream.c")
# the bundled SmolLM2-135M's decode products, bytes: per layer wq|wk|wv 960 rows, wo 576, w1|w3 3072 of 576 Q4_1
# values (360 bytes a row), w2 576 rows of 1536 (960 bytes); the LM head 49152 rows of 576 Q8_0 values (612 bytes)
LAYER = [960 * 360, 576 * 360, 3072 * 360, 576 * 960]
STEP = LAYER * 30 + [49152 * 612]
# LLaMA-2-7B as a Q4_0 GGUF (benchmarks/scale_models.py's llama-7b): per layer wq|wk|wv 12,288 rows, wo 4,096,
# w1|w3 22,016 of 4,096 Q4_0 values (2,304 bytes a row), w2 4,096 rows of 11,008 (6,192 bytes); the Q6_K LM head
# 32,000 rows of 4,096 (3,360 bytes): 3.75 GB, the bytes its decode step reads (issue 31's bandwidth bound)
LAYER_7B = [12288 * 2304, 4096 * 2304, 22016 * 2304, 4096 * 6192]
STEPS = {"bundled": STEP, "llama-7b-q4_0": LAYER_7B * 32 + [32000 * 3360]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=60)
    parser.add_argument("--shape", choices=sorted(STEPS), default="bundled", help="whose step's bytes (default: the "
                                                                                   "bundled model's)")
    args = parser.parse_args()
    print("load average before:", os.getloadavg())
    with tempfile.TemporaryDirectory() as tmp:
        binary = Path(tmp) / "step_stream"
        subprocess.run([os.environ.get("CC", "cc"), "-O3", "-march=native", "-fopenmp", "-o", str(binary),
                        str(SOURCE)], check=True)
        subprocess.run([str(binary), str(args.rounds), *map(str, STEPS[args.shape])], check=True)
    print("load average after:", os.getloadavg())


if __name__ == "__main__":
    main()
