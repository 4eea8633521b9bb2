"""Two trees' fused plans on one model's weights in one process, rounds alternated (issue 30, item 1: "the fused path
in one copy" measured against main before it, BENCHMARKS.md "Again one copy").

A whole-process A/B of that change moved by up to 30 % pair to pair on the shared machine; here both plans run on
the same model object, so only the plan's code differs: `--base`'s tracer/model/functional.py and fused.py (and
its KVCache.append, which its prefill writes through and the newer tree removed) are loaded from that checkout
beside this tree's. The bundled model dense in each dtype of `--dtypes`, 2 threads; per round a 128-token prefill
and 64 one-token steps, each plan in turn (the order alternated); medians of the per-round times and of the
rounds' ratios (new speed / base speed), and whether both plans chose the same greedy ids.

Written for the change it measured: run it from a checkout of the commit that landed it (43c11f3) with `--base` a
checkout of 8c9891b, main before it (later trees changed the plan's interface: the numbers are that change's):

    git worktree add --detach /tmp/fused_new 43c11f3 && git worktree add --detach /tmp/fused_base 8c9891b
    cd /tmp/fused_new && /work/tools/quiet /work/tools/py -m benchmarks.bench_fused_inproc_ab \\
        --base /tmp/fused_base --rounds 6 --dtypes bf16,fp32
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import Any


def load(name: str, path: Path, replace: tuple[tuple[str, str], ...] = ()) -> ModuleType:
    """The module at `path` under `name`, its source edited by `replace` (imports pointed at the base's modules)."""
    source = path.read_text()
    for old, new in replace:
        source = source.replace(old, new)
    module = importlib.util.module_from_spec(importlib.util.spec_from_loader(name, loader=None))
    sys.modules[name] = module
    exec(compile(source, str(path), "exec"), module.__dict__)
    return module


def measure(base: Path, dtype_name: str, rounds: int) -> dict[str, Any]:
    import torch

    from benchmarks.bench_model_speed import our_model
    from llmtrace.tracer.core.dtypes import COMPUTE_DTYPES, get_dtype
    from llmtrace.tracer.model.kv_cache import KVCache

    load("base_functional", base / "tracer/model/functional.py")
    base_fused = load("base_fused", base / "tracer/model/fused.py",
                      (("from llmtrace.tracer.model.functional import", "from base_functional import"),))
    base_kv = load("base_kv_cache", base / "tracer/model/kv_cache.py")
    if hasattr(base_kv.KVCache, "append"):
        KVCache.append = base_kv.KVCache.append  # the base plan's prefill writes through it
    model, _ = our_model(get_dtype(dtype_name, COMPUTE_DTYPES), False)
    model.setup_cache(1, 200)
    plans = {"base": base_fused.FusedPlan(model), "new": model._fused_plan}
    caches = [layer.attention.kv_cache for layer in model.layers]
    prompt = torch.randint(3, model.config.vocab_size, (1, 128), generator=torch.Generator().manual_seed(0))
    times: dict[str, list[tuple[float, float]]] = {key: [] for key in plans}
    ids = {}
    with torch.no_grad():
        for r in range(rounds + 1):  # round 0 warms both up, untimed
            for key, plan in (plans.items() if r % 2 else reversed(list(plans.items()))):
                for cache in caches:
                    cache.reset()
                t0 = time.perf_counter()
                token = plan.step(prompt, 0).argmax(-1, keepdim=True)
                t1 = time.perf_counter()
                sequence = []
                for position in range(128, 192):
                    token = plan.step(token, position).argmax(-1, keepdim=True)
                    sequence.append(int(token))
                t2 = time.perf_counter()
                ids[key] = sequence
                if r:
                    times[key].append((t1 - t0, (t2 - t1) / 64))
    speeds = {key: {"prefill_tok_s": 128 / statistics.median(p for p, _ in v),
                    "decode_tok_s": 1 / statistics.median(d for _, d in v)} for key, v in times.items()}
    pairs = list(zip(times["base"], times["new"]))
    return {"base": speeds["base"], "new": speeds["new"],
            "prefill_new_over_base": statistics.median(b[0] / n[0] for b, n in pairs),
            "decode_new_over_base": statistics.median(b[1] / n[1] for b, n in pairs),
            "same_ids": ids["base"] == ids["new"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", type=Path, required=True, help="a checkout of the tree before the change")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--dtypes", default="bf16,fp32")
    args = parser.parse_args()
    import torch

    torch.set_num_threads(2)
    for name in args.dtypes.split(","):
        print(name, json.dumps(measure(args.base, name, args.rounds)), flush=True)


if __name__ == "__main__":
    main()
