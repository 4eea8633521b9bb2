"""The weight products of one decode step alone, at each batch, on the bundled model: the weight-streaming bandwidth
and FLOP/s they reach beside the two ceilings the roofline uses for this machine (square fp32 GEMM FLOP/s and copy
bandwidth, measured in the same run). Explains where the measured decode step (`llmtrace run --batch-sweep`) and
the copy + GEMM roofline's prediction part: at small batch a product streams its weights slower than a copy moves bytes, at large batch a
skinny (B x K) @ (K x N) product reaches a fraction of a square GEMM's FLOP/s.

Every projection of every layer and the LM head, in the fused path's packed shapes (Q|K|V, O, gate|up, down, LM
head), called as the fused path calls them (torch.mv for one row, F.linear otherwise) on (B, K) inputs; the
fastest of `--repeats` passes per batch, batches interleaved.

    /work/tools/quiet .venv/bin/python -m benchmarks.bench_decode_products --batches 1,2,4,8,16,32,64
"""

from __future__ import annotations

import argparse
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", default="1,2,4,8,16,32,64")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()

    import torch
    import torch.nn.functional as F

    from llmtrace.tracer.core.dtypes import FP32
    from llmtrace.tracer.hardware.measure import measure_machine
    from llmtrace.tracer.load.loader import load_model
    from llmtrace.tracer.run.batch_spec import parse_batches

    torch.set_num_threads(args.threads)
    batches = parse_batches(args.batches, "--batches")
    loaded = load_model(None, dtype=FP32, weights="dense")
    model = loaded.model
    model.setup_cache(1, 8)  # packs Q|K|V and gate|up as the fused path runs them
    with torch.no_grad():
        weights = []
        for layer in model.layers:
            a, f = layer.attention, layer.feed_forward
            wqkv = torch.cat([a.wq.weight, a.wk.weight, a.wv.weight]).clone()
            w13 = torch.cat([f.w1.weight, f.w3.weight]).clone()
            weights += [wqkv, a.wo.weight.detach().clone(), w13, f.w2.weight.detach().clone()]
        weights.append(model.output.weight.detach().clone())
    weight_bytes = sum(w.numel() * w.element_size() for w in weights)
    m = measure_machine(dtypes=(FP32,), repeats=5, gemm_max_n=1024)
    peak, copy = m.gemms[0].flops_per_s, m.copy.bytes_per_s
    print(f"{len(weights)} weight products, {weight_bytes / 1e6:.1f} MB of fp32 weights per pass; "
          f"ceilings: fp32 GEMM {peak / 1e9:.1f} GFLOP/s (n={m.gemms[0].n}), copy {copy / 1e9:.2f} GB/s")
    inputs = {b: [torch.randn(b, w.shape[1]) for w in weights] for b in batches}
    best = {b: float("inf") for b in batches}
    with torch.no_grad():
        for _ in range(args.repeats + 1):  # the first round warms up
            for b in batches:
                start = time.perf_counter()
                for w, x in zip(weights, inputs[b]):
                    torch.mv(w, x[0]) if b == 1 else F.linear(x, w)
                best[b] = min(best[b], time.perf_counter() - start)
    print("| batch | products ms | weight stream GB/s | vs copy | GFLOP/s | vs square GEMM |")
    print("|---:|---:|---:|---:|---:|---:|")
    for b in batches:
        t = best[b]
        flops = 2 * b * weight_bytes / 4
        print(f"| {b} | {t * 1e3:.1f} | {weight_bytes / t / 1e9:.2f} | {weight_bytes / t / copy:.2f} | "
              f"{flops / t / 1e9:.1f} | {flops / t / peak:.2f} |")


if __name__ == "__main__":
    main()
