"""Write tests/golden/tiny_trace.json, tiny_dry_run.json, tiny_batch_trace.json, tiny_journey_trace.json (sampled,
with the logit lens and attention) and tiny_moe_trace.json: the fixed traces `llmtrace show`'s golden files render.

A real generation of the tiny test model (tests/tiny_llama.py: 2 layers, dim 64, SentencePiece trained on
sample_prompts/; for tiny_moe_trace.json the same as a Mixtral of 4 experts, 2 per token), greedy, whose every clock
reading is then replaced by a fixed, made-up timing (and the machine by a fixed description), so that the rendered output is the same on every machine and every run. The shapes, FLOPs,
bytes, tokens and probabilities are the real ones.

The committed fixtures are trace schema version 1 (whole stage records), which keeps the reader of version 1
tested; this script writes the current version. Run once, when the trace schema or the tiny model changes (then
regenerate the goldens, see test_golden.py, and keep a version-1 trace among the tests):

    .venv/bin/python tests/golden/make_trace_fixture.py [fixture names: only those]
"""

from __future__ import annotations

import json
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from tiny_llama import hf_config_dict, train_sentencepiece, write_tiny_llama  # noqa: E402

PROMPT = "The sky is blue because"
NEW_TOKENS = 6
FIXED_ENVIRONMENT = {"llmtrace_version": "0.1.0", "torch_version": "2.13.0+cpu", "python_version": "3.11.7",
                     "platform": "Linux (golden fixture)", "device_name": "fixture CPU", "threads": 2}
MODEL_NAME = "tiny-llama (test fixture)"


BATCH_PROMPTS = ("The sky is blue because", "Hi", "Once upon a time there was a small dog")


def generate(folder: Path, dry_run: bool = False, batch: bool = False, journey: bool = False,
             moe: bool = False) -> dict:
    import sentencepiece as spm

    from llmtrace.tracer.core.dtypes import FP32
    from llmtrace.tracer.load.loader import load_model
    from llmtrace.tracer.run.batch_generate import generation_for
    from llmtrace.tracer.run.generate import Finished
    from llmtrace.tracer.trace.records import RunSettings

    sp = train_sentencepiece()
    vocab = spm.SentencePieceProcessor(model_proto=sp).get_piece_size()
    if not folder.exists():
        config = hf_config_dict(vocab)
        if moe:  # a Mixtral of the same size: 4 experts of the same FFN width, 2 per token
            config.update(architectures=["MixtralForCausalLM"], model_type="mixtral", num_local_experts=4,
                          num_experts_per_tok=2)
        write_tiny_llama(folder, config, seed=0, tokenizer_model=sp)
    loaded = load_model(str(folder), dtype=FP32, device="cpu", dry_run=dry_run)
    settings = RunSettings(model=str(folder), prompt=PROMPT, max_new_tokens=NEW_TOKENS, temperature=0.0, top_k=None,
                           top_p=None, min_p=None, repetition_penalty=1.0, seed=None, dtype="fp32", device="cpu",
                           threads=None, chat=False, trace=True, dry_run=dry_run, prompt_tokens=None, warmup=True,
                           staged=False)
    if batch:  # three prompts of different lengths: left pads, each sequence its own tokens
        settings = replace(settings, batch=len(BATCH_PROMPTS), batch_prompts=BATCH_PROMPTS, temperatures=())
    if journey:  # the deeper views: sampled with filters, the logit lens, attention, the run without a KV cache
        settings = replace(settings, temperature=0.8, top_k=40, top_p=0.9, seed=1, lens=True, attention=True,
                           no_kv_cache=True, max_new_tokens=3)
    generation = generation_for(loaded, settings)
    trace = None
    try:
        for event in generation.events():
            if isinstance(event, Finished):
                trace = event.trace
    finally:
        generation.close()
    assert trace is not None
    return trace.to_dict()


def fix_timings(data: dict) -> dict:
    """Every clock reading replaced by a made-up one: stage k of a step takes 1-5 µs (k mod 5), a step's forward
    is its stages plus 20 µs, sampling 30 µs, detokenizing 4 µs; steps follow each other."""
    data["settings"]["model"] = MODEL_NAME
    data["model"]["source"] = MODEL_NAME
    data["config"]["source"] = MODEL_NAME
    data["model"]["load_seconds"] = 0.05
    data["environment"].update(FIXED_ENVIRONMENT)
    data["tokenization"]["start_ns"] = 0
    data["tokenization"]["duration_ns"] = 120_000
    for index, sequence in enumerate(data.get("batch", {}).get("sequences", ())):
        sequence["tokenization"]["start_ns"] = 120_000 * index
        sequence["tokenization"]["duration_ns"] = 120_000
    clock = 1_000_000  # set-up (cache, warm-up) before the prefill
    for step in data["steps"]:
        step["start_ns"] = clock
        work = data["stage_work"]  # a row: [work, step, layer, start_ns, duration_ns]
        stages = [s for s in data["stages"] if work[s[0]]["phase"] == step["phase"] and s[1] == step["step"]]
        t = clock
        for k, stage in enumerate(stages):
            stage[3] = t
            stage[4] = 1_000 * (1 + k % 5) * (step["input_tokens"] if step["phase"] == "prefill" else 1)
            t += stage[4]
        step["forward_ns"] = t - clock + 20_000
        step["sample_ns"] = 30_000
        step["detokenize_ns"] = 4_000
        if step.get("compact_ns"):
            step["compact_ns"] = 15_000
        step["duration_ns"] = step["forward_ns"] + step["sample_ns"] + step["detokenize_ns"] + step.get("compact_ns", 0)
        clock += step["duration_ns"]
    data["wall_ns"] = clock
    data["peak_rss_bytes"] = 300_000_000
    data["peak_device_bytes"] = None
    for record in (*data.get("lens", ()), *data.get("attention", ())):
        record["instrument_ns"] = 50_000
    replay = data.get("no_kv_cache")
    if replay:  # a recomputed step: the cached prefill's time, a decode step's × half the positions it runs again
        forwards = {step["step"]: step["forward_ns"] for step in data["steps"]}
        for step in replay["steps"]:
            step["cached_forward_ns"] = forwards[step["step"]]
            step["forward_ns"] = step["cached_forward_ns"] * (1 if step["step"] == 0 else step["positions"] // 2)
            step["time_ratio"] = step["forward_ns"] / step["cached_forward_ns"]
        replay["forward_ns"] = sum(step["forward_ns"] for step in replay["steps"])
        replay["cached_forward_ns"] = sum(step["cached_forward_ns"] for step in replay["steps"])
        replay["time_ratio"] = replay["forward_ns"] / replay["cached_forward_ns"]
    return data


def main(names: list[str]) -> None:
    """Every fixture, or those `names` (the others left as committed)."""
    with tempfile.TemporaryDirectory() as tmp:
        for name, dry_run, batch, journey, moe in (("tiny_trace.json", False, False, False, False),
                                                   ("tiny_dry_run.json", True, False, False, False),
                                                   ("tiny_batch_trace.json", False, True, False, False),
                                                   ("tiny_journey_trace.json", False, False, True, False),
                                                   ("tiny_moe_trace.json", False, False, False, True)):
            if names and name not in names:
                continue
            folder = Path(tmp) / ("tiny-moe" if moe else "tiny")
            data = fix_timings(generate(folder, dry_run, batch, journey, moe))
            out = HERE / name
            out.write_text(json.dumps(data, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
            print(f"wrote {out} ({out.stat().st_size:,} bytes)")


if __name__ == "__main__":
    main(sys.argv[1:])
