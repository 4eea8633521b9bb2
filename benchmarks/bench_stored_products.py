"""One token's product x @ W.T at the bundled model's shapes and a LLaMA-7B FFN matrix, per kernel and dtype.

What `--weights stored` chooses among (tracer/model/weight_formats.py): dense torch.mv in fp32/fp16/bf16, torch's
int4 weight-only kernel (_weight_int4pack_mm_for_cpu, group 32) fed bf16, fp16 or fp32 activations, torch's
per-channel int8 kernel (_weight_int8pack_mm, bf16; not exact for Q8_0's per-block scales, shown for scale), and
the exact dequantize-on-the-fly "blocks" kernel on Q8_0, and llmtrace's own "native" kernel (exact, fp32, on the
file's blocks: tracer/model/native_kernel.py) at 1 and 2 threads with the GB/s of stored bytes it streams. Medians
of 15 calls (5 for the slow ones) after 2 warm-up calls, 2 threads unless a column says 1T. Run under
/work/tools/quiet:  .venv/bin/python benchmarks/bench_stored_products.py [--kernels native,int4]
(--kernels: a comma-separated subset of mv, int4, int8pack, blocks, native; default all).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from gguf import GGMLQuantizationType as Q  # noqa: E402

from llmtrace.tracer.model import native_kernel  # noqa: E402
from llmtrace.tracer.model.weight_formats import BLOCKS, INT4PACK, NATIVE, pack_gguf  # noqa: E402
from tests.tiny_gguf import random_blocks  # noqa: E402

# SmolLM2-135M: wq|wk|wv (960x576), wo (576x576), w1|w3 (3072x576), w2 (576x1536), LM head (49152x576);
# LLaMA-7B's w1 (11008x4096).
SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536), (49152, 576), (11008, 4096)]


def median_ms(fn, runs: int = 15) -> float:
    fn(), fn()
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2] * 1e3


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--kernels", default="mv,int4,int8pack,blocks,native")
    kernels = set(parser.parse_args().kernels.split(","))
    torch.set_num_threads(2)
    rng = np.random.default_rng(0)
    print("load average before:", os.getloadavg())
    if "native" in kernels:
        print("native kernel:", native_kernel.library().description, native_kernel.library().flags)
    for n, k in SHAPES:
        raw = random_blocks(Q.Q4_1, n, k, rng)
        weight = pack_gguf(raw, int(Q.Q4_1), k, INT4PACK)
        dense, x = weight.dequantize(), torch.randn(k)
        row = {}
        if "mv" in kernels:
            for dtype in (torch.float32, torch.float16, torch.bfloat16):
                w, v = dense.to(dtype), x.to(dtype)
                row[f"mv {dtype}".replace("torch.", "")] = median_ms(lambda: torch.mv(w, v))
        if "int4" in kernels:
            packed, scales_zeros = weight._prepare()
            for dtype in (torch.bfloat16, torch.float16, torch.float32):
                v, sz = x.to(dtype).view(1, -1), scales_zeros.to(dtype)
                row[f"int4 {dtype}".replace("torch.", "")] = median_ms(
                    lambda: torch.ops.aten._weight_int4pack_mm_for_cpu(v, packed, 32, sz),
                    15 if dtype == torch.bfloat16 else 5)
                if dtype == torch.bfloat16:  # the fast one, also on one thread
                    torch.set_num_threads(1)
                    row["int4 bfloat16 1T"] = median_ms(
                        lambda: torch.ops.aten._weight_int4pack_mm_for_cpu(v, packed, 32, sz))
                    torch.set_num_threads(2)
        if "int8pack" in kernels:
            w8, s8, vb = torch.randint(-127, 127, (n, k), dtype=torch.int8), torch.rand(n).bfloat16(), x.bfloat16()
            row["int8pack bf16"] = median_ms(lambda: torch.ops.aten._weight_int8pack_mm(vb.view(1, -1), w8, s8))
        if "blocks" in kernels:
            blocks = pack_gguf(random_blocks(Q.Q8_0, n, k, rng), int(Q.Q8_0), k, BLOCKS)
            row["blocks q8_0 fp32"] = median_ms(lambda: blocks(x.view(1, -1)), 5)
        if "native" in kernels:
            # the bundled model's own types: Q4_1 matrices, its Q8_0 embedding as the LM head
            for qtype, blocks_raw in ((Q.Q4_1, raw), (Q.Q8_0, random_blocks(Q.Q8_0, n, k, rng))):
                if qtype == Q.Q8_0 and n != 49152:
                    continue
                native = pack_gguf(blocks_raw, int(qtype), k, NATIVE)
                xv = x.view(1, -1)
                for threads in (1, 2):
                    torch.set_num_threads(threads)
                    ms = median_ms(lambda: native(xv))
                    row[f"native {qtype.name} {threads}T"] = ms
                    row[f"native {qtype.name} {threads}T GB/s"] = blocks_raw.nbytes / ms / 1e6
                torch.set_num_threads(2)
        print(n, k, {name: round(value, 3) for name, value in row.items()}, flush=True)
    print("load average after:", os.getloadavg())


if __name__ == "__main__":
    main()
