"""Model speed: greedy decode tokens/s and 128-token prefill tokens/s, llmtrace's Transformer against HF
transformers' LlamaForCausalLM holding the same weights, in the same dtype, with the same torch threads.

Weights: the bundled default model (SmolLM2-135M-Instruct, GGUF dequantized by llmtrace.tracer.load.loader) when it is installed,
else seeded random weights at SmolLM2-135M's size (`--random` forces these). Both models get their own in-memory
copy (not memory-mapped: this VM evicts idle page-cache pages, which would time the disk instead of the model).
HF runs its eager forward with a DynamicCache (attn_implementation="sdpa", its default), the LM head on the last
position only (logits_to_keep=1) in prefill, greedy argmax in a plain loop: its fastest path short of generate()'s
extra work; `generate()` is timed too. Ours runs `prefill` / `decode_one` (the fused path; `--staged` adds the
stage-by-stage path for comparison). Rounds interleave the models; medians are reported.

    flock /tmp/llmtrace-bench.lock .venv/bin/python -m benchmarks.bench_model_speed --rounds 5
    flock /tmp/llmtrace-bench.lock .venv/bin/python -m benchmarks.bench_model_speed --gqa --rounds 5
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any, Callable

import torch

from llmtrace.tracer.core.config import ModelConfig
from llmtrace.tracer.core.contract import ours_to_hf
from llmtrace.tracer.core.dtypes import COMPUTE_DTYPES, DType, get_dtype
from llmtrace.tracer.core.presets import get_preset
from llmtrace.tracer.model.transformer import Transformer, build_meta_model, build_random_model

PROMPT_TOKENS = 128
DECODE_TOKENS = 64


def our_model(dtype: DType, random: bool) -> tuple[Transformer, str]:
    """The bundled model (or random SmolLM2-135M) in `dtype`, every weight copied into ordinary memory."""
    if not random:
        try:
            from llmtrace.tracer.load.loader import load_model

            loaded = load_model(None, dtype=dtype, weights="dense")  # HF and the meta copy take dense
            source = f"bundled {loaded.weight_format}"
            model = loaded.model
        except Exception as exc:  # bundled model absent or unloadable: say so in the output, use random weights
            source = f"random (bundled model unavailable: {exc})"
            model = build_random_model(get_preset("smollm2-135m"), seed=0, dtype=dtype)
    else:
        source = "random (seed 0)"
        model = build_random_model(get_preset("smollm2-135m"), seed=0, dtype=dtype)
    state = {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}
    resident = build_meta_model(model.config)
    resident.load_weights(state)
    return resident.eval().requires_grad_(False), source


def hf_model(ours: Transformer) -> Any:
    """HF LlamaForCausalLM with a copy of `ours`' weights and dtype."""
    import transformers
    from transformers.utils import logging

    logging.set_verbosity_error()
    cfg: ModelConfig = ours.config
    hf_config = transformers.LlamaConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.dim, intermediate_size=cfg.ffn_dim, num_hidden_layers=cfg.n_layers,
        num_attention_heads=cfg.n_heads, num_key_value_heads=cfg.n_kv_heads, head_dim=cfg.head_dim,
        rms_norm_eps=cfg.norm_eps, rope_theta=cfg.rope_theta, max_position_embeddings=cfg.max_seq_len,
        tie_word_embeddings=cfg.tie_embeddings,
    )
    dtype = ours.tok_embeddings.weight.dtype
    hf = transformers.LlamaForCausalLM(hf_config).to(dtype).eval().requires_grad_(False)
    state = {ours_to_hf(name): tensor.detach().clone() for name, tensor in ours.state_dict().items()}
    if cfg.tie_embeddings:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    hf.load_state_dict(state, strict=True)
    return hf, hf_config


def time_ours(model: Transformer, prompt: torch.Tensor, fused: bool) -> tuple[float, float, list[int]]:
    """(prefill s, decode s per token, greedy ids) for one generation."""
    from llmtrace.tracer.run.backends import backend_for
    from llmtrace.tracer.run.select import Request

    model.setup_cache(1, PROMPT_TOKENS + DECODE_TOKENS + 1)
    run = backend_for(model, Request(backend=None if fused else "modules"))
    start = time.perf_counter()
    token = run.prefill(prompt).argmax(-1, keepdim=True)
    prefill = time.perf_counter() - start
    ids = [int(token)]
    start = time.perf_counter()
    for _ in range(DECODE_TOKENS):
        token = run.decode(token).argmax(-1, keepdim=True)
        ids.append(int(token))
    decode = (time.perf_counter() - start) / DECODE_TOKENS
    return prefill, decode, ids


def hf_greedy(hf: Any, hf_config: Any, prompt: torch.Tensor, steps: int) -> tuple[float, float, list[int]]:
    """HF's forward loop with a DynamicCache: (prefill seconds, seconds for `steps` decode steps, the greedy ids)."""
    from transformers import DynamicCache

    with torch.no_grad():
        cache = DynamicCache(config=hf_config)
        start = time.perf_counter()
        out = hf(input_ids=prompt, cache=cache, use_cache=True, logits_to_keep=1)
        token = out.logits[:, -1].argmax(-1, keepdim=True)
        prefill = time.perf_counter() - start
        ids = [int(token)]
        start = time.perf_counter()
        for _ in range(steps):
            out = hf(input_ids=token, cache=cache, use_cache=True)
            token = out.logits[:, -1].argmax(-1, keepdim=True)
            ids.append(int(token))
        decode = time.perf_counter() - start
    return prefill, decode, ids


def time_hf(hf: Any, hf_config: Any, prompt: torch.Tensor) -> tuple[float, float, list[int]]:
    """(prefill seconds, seconds per decode token, ids) over DECODE_TOKENS steps."""
    prefill, decode, ids = hf_greedy(hf, hf_config, prompt, DECODE_TOKENS)
    return prefill, decode / DECODE_TOKENS, ids


def time_hf_generate(hf: Any, prompt: torch.Tensor) -> float:
    """Seconds per decode token through generate(): (time for N+1 new tokens - time for 1) / N."""
    def run(new: int) -> float:
        start = time.perf_counter()
        hf.generate(prompt, max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0)
        return time.perf_counter() - start

    with torch.no_grad():
        return (run(DECODE_TOKENS + 1) - run(1)) / DECODE_TOKENS


def bench_dtype(dtype: DType, rounds: int, random: bool, staged: bool) -> dict[str, Any]:
    ours, source = our_model(dtype, random)
    hf, hf_config = hf_model(ours)
    prompt = torch.randint(3, ours.config.vocab_size, (1, PROMPT_TOKENS), generator=torch.Generator().manual_seed(0))
    cases: dict[str, Callable[[], tuple[float, float, list[int]]]] = {
        "llmtrace": lambda: time_ours(ours, prompt, fused=True),
        "HF transformers": lambda: time_hf(hf, hf_config, prompt),
    }
    if staged:
        cases["llmtrace stage by stage"] = lambda: time_ours(ours, prompt, fused=False)
    for run in cases.values():  # warm-up: first-touch page faults, allocator, oneDNN primitive caches
        run()
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in cases}
    ids: dict[str, list[int]] = {}
    generate: list[float] = []
    for _ in range(rounds):
        for name, run in cases.items():
            prefill, decode, ids[name] = run()
            times[name].append((prefill, decode))
        generate.append(time_hf_generate(hf, prompt))
    result: dict[str, Any] = {"dtype": dtype.name, "weights": source, "threads": torch.get_num_threads(),
                              "same_greedy_tokens": ids["llmtrace"] == ids["HF transformers"], "cases": {}}
    for name, pairs in times.items():
        result["cases"][name] = {
            "prefill_tok_per_s": PROMPT_TOKENS / statistics.median(p for p, _ in pairs),
            "decode_tok_per_s": 1 / statistics.median(d for _, d in pairs),
            "decode_tok_per_s_rounds": [round(1 / d, 1) for _, d in pairs],
        }
    result["cases"]["HF generate()"] = {"prefill_tok_per_s": None, "decode_tok_per_s": 1 / statistics.median(generate),
                                        "decode_tok_per_s_rounds": [round(1 / g, 1) for g in generate]}
    return result


def bench_gqa(rounds: int) -> list[dict[str, Any]]:
    """Decode attention core (scores, softmax, weighted sum) for one query token: our grouped matmul (the R query
    heads of a KV head as R rows of one matmul, no copies) against repeating K and V R times first (HF's repeat_kv)."""
    rows = []
    for name, heads, kv_heads, head_dim in (("smollm2-135m", 9, 3, 64), ("llama3-8b", 32, 8, 128)):
        rep = heads // kv_heads
        for seen in (128, 1024, 4096):
            q = torch.randn(1, heads, 1, head_dim)
            k, v = torch.randn(1, kv_heads, seen, head_dim), torch.randn(1, kv_heads, seen, head_dim)
            scale = head_dim**-0.5

            def grouped() -> torch.Tensor:
                scores = torch.bmm(q.view(kv_heads, rep, head_dim), k[0].transpose(1, 2)).mul_(scale)
                return torch.bmm(torch.softmax(scores, dim=-1), v[0]).view(1, heads, 1, head_dim)

            def repeated() -> torch.Tensor:
                k_all, v_all = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
                scores = torch.matmul(q, k_all.transpose(2, 3)) * scale
                return torch.matmul(torch.softmax(scores, dim=-1), v_all)

            assert torch.allclose(grouped(), repeated(), atol=1e-5)
            row: dict[str, Any] = {"shape": name, "kv_len": seen}
            for label, fn in (("grouped_us", grouped), ("repeat_kv_us", repeated)):
                samples = []
                for _ in range(rounds):
                    start = time.perf_counter()
                    for _ in range(200):
                        fn()
                    samples.append((time.perf_counter() - start) / 200 * 1e6)
                row[label] = statistics.median(samples)
            rows.append(row)
    return rows


def print_table(results: list[dict[str, Any]]) -> None:
    print(f"prompt {PROMPT_TOKENS} tokens, {DECODE_TOKENS} greedy decode tokens, batch 1, medians")
    print(f"{'dtype':5} {'model':26} {'prefill tok/s':>13} {'decode tok/s':>12} {'decode vs HF':>12} "
          f"{'vs generate()':>13}")
    for r in results:
        hf_decode = r["cases"]["HF transformers"]["decode_tok_per_s"]
        gen_decode = r["cases"]["HF generate()"]["decode_tok_per_s"]
        for name, c in r["cases"].items():
            prefill = f"{c['prefill_tok_per_s']:.0f}" if c["prefill_tok_per_s"] else "-"
            print(f"{r['dtype']:5} {name:26} {prefill:>13} {c['decode_tok_per_s']:>12.1f} "
                  f"{c['decode_tok_per_s'] / hf_decode:>11.2f}x {c['decode_tok_per_s'] / gen_decode:>12.2f}x")
        print(f"      weights: {r['weights']}; threads {r['threads']}; same greedy tokens as HF: "
              f"{r['same_greedy_tokens']}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--dtypes", default="fp32,bf16", help="comma-separated: fp32, bf16, fp16")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's own choice)")
    parser.add_argument("--random", action="store_true",
                        help="random SmolLM2-135M weights instead of the bundled model")
    parser.add_argument("--staged", action="store_true", help="also time our stage-by-stage (hookable) path")
    parser.add_argument("--gqa", action="store_true", help="only time the decode attention core: grouped vs repeat_kv")
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.gqa:
        rows = bench_gqa(args.rounds)
        if args.json:
            print(json.dumps(rows, indent=1))
        for row in rows:
            print(f"{row['shape']:13} S={row['kv_len']:5}  grouped {row['grouped_us']:7.1f} us  "
                  f"repeat_kv {row['repeat_kv_us']:7.1f} us  ({row['repeat_kv_us'] / row['grouped_us']:.2f}x)")
        return
    results = []
    for dtype in [get_dtype(name, COMPUTE_DTYPES) for name in args.dtypes.split(",")]:
        results.append(bench_dtype(dtype, args.rounds, args.random, args.staged))
    if args.json:
        print(json.dumps(results, indent=1))
    else:
        print_table(results)


if __name__ == "__main__":
    main()
