"""The default kernels' numerics against their references, on a GGUF (issue 31, item 1): a teacher-forced text of
`--tokens` tokens (the sample prompts, concatenated), fed one token a step as `run` decodes, and at every position
the greedy (top-1) token of

- llmtrace's default kernels (README "Default kernels": i8dot, llama.cpp-style int8 activations, on the 4-bit types
  where the C library has its AVX2 rows),
- llmtrace's exact kernel (`--weights native`: gguf's dequantized values, fp32 products),
- llama.cpp on the same file (llama-cpp-python, CPU), the reference of the int8-activation numerics,

then how often each pair agrees. The target: the default agrees with llama.cpp at >= 99% of the positions (exit 1
otherwise). llama.cpp is a benchmark-only dependency (`pip install llama-cpp-python`); never imported by tests.

    /work/tools/quiet .venv/bin/python -m benchmarks.check_numerics --tokens 512
    /work/tools/quiet .venv/bin/python -m benchmarks.check_numerics --model llama-7b.Q4_0.gguf --threads 2
    /work/tools/quiet .venv/bin/python -m benchmarks.check_numerics --model SmolLM2-135M.Q8_0.gguf --weights i8dot
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

TARGET = 0.99  # the default's greedy top-1 agreement with llama.cpp, teacher-forced
SOURCE_TEXT = ("story", "sky", "code", "capital", "seed_zh")


def text_ids(tokenizer: Any, tokens: int) -> list[int]:
    """The first `tokens` ids of the sample prompts, concatenated as often as needed."""
    from importlib import resources

    text = ""
    while True:
        for name in SOURCE_TEXT:
            text += (resources.files("llmtrace.sample_prompts") / f"{name}.txt").read_text("utf-8") + "\n"
        ids = list(tokenizer.encode(text))
        if len(ids) >= tokens:
            return ids[:tokens]


def llmtrace_top1(model_path: str | None, weights: str | None, ids: list[int]) -> tuple[list[int], str]:
    """The greedy token after each position, each step one decode call (the run's path), and the kernel line."""
    import torch

    from llmtrace.tracer.core.dtypes import AUTO
    from llmtrace.tracer.load.loader import load_model

    loaded = load_model(model_path, AUTO, weights=weights)
    model = loaded.model
    model.setup_cache(1, len(ids) + 1)
    top = []
    with torch.no_grad():
        logits = model.prefill(torch.tensor([ids[:1]]))
        top.append(int(logits.reshape(-1, logits.shape[-1])[-1].argmax()))
        for token in ids[1:]:
            logits = model.decode_one(torch.tensor([[token]]))
            top.append(int(logits.reshape(-1).argmax()))
    kernels = loaded.kernels
    return top, f"{kernels.picked} ({kernels.numerics})" if kernels is not None else "?"


def llama_cpp_top1(path: Path, ids: list[int], threads: int, kv: str = "f16") -> tuple[list[int], list[float]]:
    """llama.cpp's greedy token after each position, and the gap between its top two logits there over the
    largest |logit| (how near a tie each position is). `kv`: its KV cache's type (f16, its default; f32, llmtrace's
    run's)."""
    import llama_cpp
    import numpy as np

    cache = {"f16": llama_cpp.GGML_TYPE_F16, "f32": llama_cpp.GGML_TYPE_F32}[kv]
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=len(ids) + 8, n_threads=threads, n_threads_batch=threads,
                          logits_all=False, verbose=False, type_k=cache, type_v=cache)
    top, gaps = [], []
    for token in ids:
        llm.eval([token])
        logits = np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(llm.n_vocab(),)).astype(np.float64)
        first, second = np.partition(logits, -2)[-2:][::-1]
        top.append(int(np.argmax(logits)))
        gaps.append(float((first - second) / np.abs(logits).max()))
    return top, gaps


def agreement(a: list[int], b: list[int]) -> float:
    return sum(x == y for x, y in zip(a, b)) / len(a)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="a GGUF file (default: the bundled SmolLM2-135M Q4_1)")
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--weights", default=None,
                        help="the kernels judged in the default's place (a --weights spec: i8dot, Q8_0:i8dot,...; "
                             "default: the default table's), to check a kernel before it becomes a default")
    parser.add_argument("--llama-kv", choices=("f16", "f32"), default="f16",
                        help="llama.cpp's KV cache type (default f16, its own; f32 is the cache llmtrace's run holds)")
    args = parser.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    from llmtrace.tracer.checkpoint.bundled import bundled_model_path
    from llmtrace.tracer.load.loader import load_model

    path = Path(args.model) if args.model else bundled_model_path()
    ids = text_ids(load_model(args.model, dry_run=True).tokenizer, args.tokens)
    default, default_line = llmtrace_top1(args.model, args.weights, ids)
    exact, exact_line = llmtrace_top1(args.model, "native", ids)
    reference, gaps = llama_cpp_top1(path, ids, args.threads, args.llama_kv)
    import llama_cpp

    print(f"{path}: {len(ids)} teacher-forced tokens, {args.threads} threads, llama-cpp-python {llama_cpp.__version__}"
          f" (KV cache {args.llama_kv})")
    print(f"default  {default_line}" + (f" (--weights {args.weights})" if args.weights else ""))
    print(f"exact    {exact_line}")
    rows = [("default vs llama.cpp", agreement(default, reference)),
            ("exact vs llama.cpp", agreement(exact, reference)), ("default vs exact", agreement(default, exact))]
    for name, share in rows:
        print(f"{name:<22} {share:7.2%} greedy top-1 agreement")
    apart = [i for i, (a, b) in enumerate(zip(default, reference)) if a != b]

    def sided(i: int) -> str:
        return "with llama.cpp" if exact[i] == reference[i] else "with the default" if exact[i] == default[i] \
            else "with neither"

    print("default and llama.cpp apart at " + ("; ".join(
        f"position {i} (llama.cpp's top-two gap {gaps[i]:.2%} of max |logit|, exact {sided(i)})" for i in apart)
        or "no position"))
    print(f"median top-two gap over all positions: {sorted(gaps)[len(gaps) // 2]:.2%} of max |logit|")
    met = rows[0][1] >= TARGET
    print(f"target: default vs llama.cpp >= {TARGET:.0%}: {'met' if met else 'NOT met'}")
    return 0 if met else 1


if __name__ == "__main__":
    sys.exit(main())
