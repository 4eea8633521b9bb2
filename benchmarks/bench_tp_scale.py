"""`llmtrace run --tp 2` at the sizes users run (issue 31, item 2: "--tp 2, each rank maps only its shard"): each
rank's peak RSS against its shard's stored bytes, the ranks' total against the file + KV cache + 1.5 GB, and decode
tokens/s beside the single-process run at 1 and 2 threads.

Each configuration is `llmtrace run` as a user types it, in its own child process, one at a time, rounds alternated:

    tp2       run --model FILE PROMPT --max-new-tokens N --tp 2 --threads 1   (two ranks, one thread each)
    one-1t    run --model FILE PROMPT --max-new-tokens N --threads 1
    one-2t    run --model FILE PROMPT --max-new-tokens N --threads 2
    tp2-untraced   tp2 with --no-trace (each step timed whole: no stage wrappers around the rank's modules)

(each with --no-roofline and --json). While a child runs, every process under it is sampled from /proc every 50 ms:
its VmHWM (the kernel's own peak of its resident set, file-backed pages included) and its RssAnon/RssFile at the
sample where VmRSS was highest. The launcher, the ranks (multiprocessing's spawned children) and the resource tracker
are told apart by their command lines. Decode tokens/s: the trace's decode steps over the sum of their durations
(forward, sampling, detokenizing: rank 0's records for tp2).

    /work/tools/quiet /work/tools/py -m benchmarks.bench_tp_scale --model /tmp/scale/llama-7b.Q4_0.random.gguf \\
        --rounds 1 --new-tokens 16 --only tp2

--model may be an HF folder too (its ranks hold their shard in the compute dtype, e.g. bf16: the budget line then
compares against the safetensors files' bytes).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

PROMPT = "The capital of France is"
BUDGET_SLACK = 1.5e9  # issue 31's fixed overhead beyond the file and the KV cache
CONFIGS = {"tp2": ["--tp", "2", "--threads", "1"], "tp2-untraced": ["--tp", "2", "--threads", "1", "--no-trace"],
           "one-1t": ["--threads", "1"], "one-2t": ["--threads", "2"]}


def _status(pid: int) -> dict[str, int]:
    """VmHWM, VmRSS, RssAnon, RssFile of a process in bytes ({} once it is gone)."""
    out = {}
    try:
        with open(f"/proc/{pid}/status", encoding="ascii") as fh:
            for line in fh:
                key, _, value = line.partition(":")
                if key in ("VmHWM", "VmRSS", "RssAnon", "RssFile"):
                    out[key] = int(value.split()[0]) * 1024
    except (OSError, ValueError):
        return {}
    return out


def _children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children", encoding="ascii") as fh:
            return [int(p) for p in fh.read().split()]
    except OSError:
        return []


def _tree(pid: int) -> list[int]:
    seen, todo = [], [pid]
    while todo:
        p = todo.pop()
        seen.append(p)
        todo.extend(_children(p))
    return seen


def _role(pid: int, root: int) -> str:
    if pid == root:
        return "launcher"
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            cmd = fh.read().replace(b"\0", b" ").decode("utf-8", "replace")
    except OSError:
        return "?"
    if "resource_tracker" in cmd:
        return "resource tracker"
    return "rank" if "spawn_main" in cmd and pid in _children(root) else cmd[:60]  # a rank: the launcher's child


def measure(model: str, config: str, new_tokens: int) -> dict[str, Any]:
    """One child run: its wall time, each process's peak, the trace's decode tokens/s and ids."""
    with tempfile.TemporaryDirectory(prefix="bench-tp-") as folder:
        out = Path(folder) / "trace.json"
        cmd = [sys.executable, "-m", "llmtrace", "run", "--model", model, PROMPT, "--max-new-tokens",
               str(new_tokens), "--no-roofline", "--json", str(out), *CONFIGS[config]]
        load_before = os.getloadavg()[0]
        start = time.perf_counter()
        child = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        peaks: dict[int, dict[str, Any]] = {}
        while child.poll() is None:
            for pid in _tree(child.pid):
                now = _status(pid)
                if not now:
                    continue
                mine = peaks.setdefault(pid, {"role": _role(pid, child.pid), "VmHWM": 0, "VmRSS": 0})
                mine["VmHWM"] = max(mine["VmHWM"], now.get("VmHWM", 0))
                if now.get("VmRSS", 0) >= mine["VmRSS"]:
                    mine.update(VmRSS=now["VmRSS"], RssAnon=now.get("RssAnon", 0), RssFile=now.get("RssFile", 0))
            time.sleep(0.05)
        wall = time.perf_counter() - start
        err = child.stderr.read().decode("utf-8", "replace").strip() if child.stderr else ""
        if child.returncode != 0 or not out.exists():
            return {"config": config, "error": err.splitlines()[-1] if err else f"exit {child.returncode}"}
        trace = json.loads(out.read_text(encoding="utf-8"))
    decode = [s for s in trace["steps"] if s["phase"] == "decode"]
    seconds = sum(s["duration_ns"] for s in decode) / 1e9
    # rank 0's collectives in the decode steps: their time (the wait for the other rank included) and count
    mine = [c for c in trace.get("collectives", ()) if c["rank"] == 0 and c["phase"] == "decode"]
    comm = sum(c["duration_ns"] for c in mine) / 1e9
    kv = max((s["kv_allocated_bytes"] for s in trace["steps"]), default=0)
    return {"config": config, "load": (load_before, os.getloadavg()[0]), "wall_s": wall,
            "decode_tok_s": len(decode) / seconds if seconds else 0.0,
            "prefill_s": trace["steps"][0]["duration_ns"] / 1e9,
            "decode_comm_share": comm / seconds if seconds else 0.0,
            "collectives_per_step": len(mine) / max(1, len(decode)), "ids": trace["generated_ids"], "kv_bytes": kv,
            "processes": sorted(peaks.values(), key=lambda p: p["role"]), "note": err.splitlines()[0] if err else ""}


def shard_bytes(model: str, tp: int) -> list[int]:
    """What each rank holds for its weights as `run --tp` loads them (memory_fit's count of its shard)."""
    from llmtrace.tracer.core.dtypes import AUTO
    from llmtrace.tracer.load.loader import plan_load
    from llmtrace.tracer.load.tensor_parallel import shard_bytes as held

    plan = plan_load(model, AUTO)
    return [held(plan, rank, tp) for rank in range(tp)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--only", default="tp2,one-1t,one-2t", help=f"of {', '.join(CONFIGS)}, comma-separated")
    parser.add_argument("--json", default="")
    args = parser.parse_args()
    folder = Path(args.model)  # an HF folder: its safetensors files' bytes
    size = sum(f.stat().st_size for f in folder.glob("*.safetensors")) if folder.is_dir() else folder.stat().st_size
    shards = shard_bytes(args.model, 2)
    print(f"file {size / 1e9:.2f} GB; each rank's shard as held: {', '.join(f'{b / 1e9:.3f} GB' for b in shards)}")
    results = []
    for round_ in range(args.rounds):
        for config in args.only.split(","):
            r = measure(args.model, config, args.new_tokens)
            results.append(r)
            if "error" in r:
                print(f"round {round_ + 1} {config}: {r['error']}")
                continue
            ranks = [p for p in r["processes"] if p["role"] == "rank"]
            total = sum(p["VmHWM"] for p in ranks)
            budget = size + r["kv_bytes"] * max(1, len(ranks)) + BUDGET_SLACK
            print(f"round {round_ + 1} {config} (load {r['load'][0]:.1f} -> {r['load'][1]:.1f}): wall "
                  f"{r['wall_s']:.1f} s, prefill {r['prefill_s']:.2f} s, decode {r['decode_tok_s']:.2f} tok/s, "
                  f"ids {r['ids']}")
            if r["collectives_per_step"]:
                print(f"    rank 0: {r['collectives_per_step']:.0f} collectives a decode step, "
                      f"{100 * r['decode_comm_share']:.0f}% of the decode time in them")
            for p in r["processes"]:
                if p["VmHWM"] < 20e6:
                    continue  # a compiler check, uname: short-lived and small
                print(f"    {p['role']:<17} peak {p['VmHWM'] / 1e9:6.3f} GB (at its highest RSS: anon "
                      f"{p.get('RssAnon', 0) / 1e9:.3f}, file {p.get('RssFile', 0) / 1e9:.3f})")
            if ranks:
                print(f"    ranks together {total / 1e9:.3f} GB; budget (file + both KV caches + 1.5 GB) "
                      f"{budget / 1e9:.3f} GB")
    if args.json:
        Path(args.json).write_text(json.dumps({"file_bytes": size, "shard_bytes": shards, "results": results},
                                              indent=1), encoding="utf-8")


if __name__ == "__main__":
    main()
