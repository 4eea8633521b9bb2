"""What the fused path's rework (issue 9 item 5) cost: one decode step of the bundled model at context 128 under
A: the fused path before it (two hand copies, its own roundings: tracer/model/fused.py at commit 08cf846, read
   with `git show`, so run this from a git checkout),
B: the path as it is (one copy, rounding like the staged path),
C: B plus a second, one-token copy with B's roundings (defined here, only to measure what a second copy buys).
Rounds interleaved, medians. BENCHMARKS.md, "Fused path: one copy".

    /work/tools/quiet .venv/bin/python -m benchmarks.bench_fused_copies --dtype fp32 --rounds 7 --per-round 20
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import ModuleType

import torch
import torch.nn.functional as F

from llmtrace.tracer.core.config import first_attended_position
from llmtrace.tracer.core.dtypes import get_dtype
from llmtrace.tracer.load.loader import load_model
from llmtrace.tracer.model import fused
from llmtrace.tracer.model.functional import attention_scores, attention_values, matvec, softmax_fp32

BEFORE = "08cf846"  # main just before the rework
CONTEXT = 128


def fused_before(folder: Path) -> ModuleType:
    source = subprocess.run(["git", "show", f"{BEFORE}:tracer/model/fused.py"], check=True, capture_output=True,
                            text=True).stdout
    path = folder / "fused_before.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("fused_before", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def one_token_layer(layer: fused.FusedLayer, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, pos: int,
                    mark: fused.Mark) -> torch.Tensor:
    """C's second copy: x (dim,) at position `pos`, every op of FusedLayer.forward's, on 1-D/2-D views."""
    heads, kv_heads, head_dim = layer.heads, layer.kv_heads, layer.head_dim
    h = layer.attention_norm(x)
    mark()
    qkv = matvec(layer.wqkv, h, layer.bqkv).view(heads + 2 * kv_heads, head_dim)  # (H+2Hkv, D)
    mark()
    qk = qkv[: heads + kv_heads]
    torch.addcmul(qk * cos, qk.roll(head_dim // 2, dims=-1), sin, out=qk)
    mark()
    kv_row = layer.cache.kv[0]  # (2Hkv, S_max, D)
    kv_row.select(1, pos).copy_(qkv[heads:])
    first = first_attended_position(pos + 1, 1, layer.cache.window)
    live = kv_row.narrow(1, first, pos + 1 - first)  # (2Hkv, S, D)
    mark()
    q = qk[:heads].view(kv_heads, heads // kv_heads, head_dim)  # (Hkv, R, D)
    scores = attention_scores(q, live[:kv_heads], layer.scale, True)
    mark()
    probs = softmax_fp32(scores)
    mark()
    out = attention_values(probs, live[kv_heads:], True).view(-1)  # (H*D,)
    mark()
    attended = matvec(layer.wo, out, layer.bo)
    mark()
    x = attended.add_(x)
    mark()
    h = layer.ffn_norm(x)
    mark()
    gate_up = matvec(layer.w13, h, layer.b13)
    mark()
    act = F.silu(gate_up[: layer.ffn_dim]).mul_(gate_up[layer.ffn_dim :])
    mark()
    down = matvec(layer.w2, act, layer.b2)
    mark()
    x = down.add_(x)
    mark()
    return x


class TwoCopyPlan(fused.FusedPlan):
    """B's plan with C's one-token copy for one token of one sequence."""

    def step(self, tokens: torch.Tensor, start: int, mark: fused.Mark = fused.no_mark) -> torch.Tensor:
        if tokens.numel() != 1 or self.layers[0].cache.kv.shape[0] != 1:
            return super().step(tokens, start, mark)
        mark()
        x = F.embedding(tokens.reshape(-1), self.embedding)[0]  # (dim,)
        mark()
        cos, sin = self.cos[start], self.sin[start]  # (1, D)
        for layer in self.layers:
            x = one_token_layer(layer, x, cos, sin, start, mark)
        for layer in self.layers:
            self.fill.length, self.fill.batch = start + 1, 1
        h = self.final_norm(x)
        mark()
        logits = matvec(self.output, h, self.output_bias).view(1, -1)
        mark()
        return logits


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="fp32")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--per-round", type=int, default=20)
    args = parser.parse_args()
    torch.set_num_threads(2)
    model = load_model(None, dtype=get_dtype(args.dtype)).model
    model.setup_cache(1, CONTEXT + 8)
    prompt = torch.randint(3, model.config.vocab_size, (1, CONTEXT), generator=torch.Generator().manual_seed(0))
    with tempfile.TemporaryDirectory() as folder, torch.no_grad():
        model.prefill(prompt)
        plans = {"A two copies (before)": fused_before(Path(folder)).FusedPlan(model),
                 "B one copy": fused.FusedPlan(model), "C one copy + one-token copy": TwoCopyPlan(model)}
        token = torch.tensor([[42]])

        def once(plan: object) -> tuple[int, torch.Tensor]:
            model.fill.length, model.fill.batch = CONTEXT, 1  # every step writes position CONTEXT again
            start = time.perf_counter_ns()
            logits = plan.step(token, CONTEXT)
            return time.perf_counter_ns() - start, logits

        logits = {name: once(plan)[1].float() for name, plan in plans.items()}
        b = logits["B one copy"]
        for name, value in logits.items():
            print(f"max |{name} - B| = {(value - b).abs().max().item():.3g} (largest logit {b.abs().max().item():.3g})")
        for plan in plans.values():
            for _ in range(5):
                once(plan)
        times: dict[str, list[int]] = {name: [] for name in plans}
        for _ in range(args.rounds):
            for name, plan in plans.items():
                times[name].extend(once(plan)[0] for _ in range(args.per_round))
    medians = {name: statistics.median(v) / 1e6 for name, v in times.items()}
    a = medians["A two copies (before)"]
    for name, ms in medians.items():
        print(f"{args.dtype} {name}: median {ms:.2f} ms/step over {len(times[name])} steps, {ms / a:.3f}x A")


if __name__ == "__main__":
    sys.exit(main())
