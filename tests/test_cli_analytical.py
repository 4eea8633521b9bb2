"""`llmtrace flops`, `kvmem` and `models`: their JSON (checked against the schema documented in README.md), their
tables, every bad input (one line on stderr, exit 2), and that none of them (nor `show` of a saved trace, nor `--help`)
imports torch or numpy."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from pathlib import Path
from typing import Callable

import jsonschema
import pytest
from typer.testing import CliRunner

from llmtrace.cli.app import app, main
from llmtrace.tracer.checkpoint.bundled import bundled_model_path

ROOT = Path(__file__).resolve().parent.parent
ENTRY = "import sys; sys.argv[0] = 'llmtrace'; from llmtrace.cli.app import main; main()"
runner = CliRunner()


def invoke_main(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    """The console script's entry point, in-process: exit code, stdout, stderr."""
    with pytest.raises(SystemExit) as exit_info:
        main(args)
    out, err = capsys.readouterr()
    return int(exit_info.value.code or 0), out, err


def run_llmtrace(args: list[str], python_flags: tuple[str, ...] = (), env: dict[str, str] | None = None,
                 ) -> subprocess.CompletedProcess[str]:
    base_env = {k: v for k, v in os.environ.items() if k != "LLMTRACE_DEBUG"}
    return subprocess.run([sys.executable, *python_flags, "-c", ENTRY, *args], cwd=ROOT, capture_output=True,
                          text=True, env={**base_env, **(env or {})}, timeout=120)


# ---- JSON, against the schema documented in README.md ---------------------------------------------------------

_INT = {"type": "integer"}
_NUM = {"type": "number"}
_STR = {"type": "string"}
_TOTALS = {
    "type": "object",
    "required": ["matmul_flops", "elementwise_flops", "total_flops", "useful_flops", "attention_dense_flops",
                 "attention_useful_flops", "per_layer_flops", "weight_bytes", "kv_read_bytes", "kv_write_bytes",
                 "activation_bytes", "min_bytes", "total_bytes", "arithmetic_intensity", "weights_kv_intensity",
                 "peak_activation_bytes"],
}
_COMPONENT = {
    "type": "object",
    "required": ["name", "label", "kind", "per_layer", "instances", "formula", "flops", "useful_flops",
                 "weight_bytes", "kv_read_bytes", "kv_write_bytes", "act_read_bytes", "act_write_bytes",
                 "total_flops", "total_useful_flops"],
    "properties": {"kind": {"enum": ["matmul", "elementwise", "memory"]}, "flops": _INT, "total_flops": _INT},
}
_PHASE = {
    "type": "object",
    "required": ["phase", "kernels", "batch", "new_tokens", "cached_before", "kv_len", "components", "totals"],
    "properties": {"components": {"type": "array", "items": _COMPONENT}, "totals": _TOTALS},
}
FLOPS_SCHEMA = {
    "type": "object",
    "required": ["schema", "model", "params", "weight_bytes", "checkpoint", "weights_dtype", "weights_dtype_from",
                 "kv_dtype", "activation_dtype", "kernels", "kernels_description", "batch", "prompt_len", "prompt_tokenizer", "new_tokens",
                 "decode_context", "prefill", "decode", "generation", "two_x_params", "decode_step_flops_per_token",
                 "decode_vs_rule", "generation_flops_per_token", "generation_vs_rule"],
    "properties": {
        "schema": {"const": "llmtrace.flops/2"},
        "kernels": {"enum": ["eager", "fused"]},
        "model": {"type": "object", "required": ["name", "source", "vocab_size", "dim", "n_layers", "n_heads",
                                                  "n_kv_heads", "head_dim", "ffn_dim", "max_seq_len", "tie_embeddings"]},
        "params": {"type": "object", "required": ["embedding", "per_layer", "layers", "final_norm", "lm_head",
                                                   "tied", "total", "non_embedding"]},
        "weight_bytes": {"type": "object", "required": ["fp32", "bf16", "fp16", "fp8", "int8", "int4"]},
        "checkpoint": {"anyOf": [{"type": "null"}, {
            "type": "object", "required": ["format", "files", "n_tensors", "n_params", "total_bytes", "by_dtype"]}]},
        "weights_dtype": {"enum": ["fp32", "bf16", "fp16", "fp8", "int8", "int4"]},
        "weights_dtype_from": {"enum": ["option", "checkpoint", "default"]},
        "two_x_params": _INT, "decode_vs_rule": _NUM, "generation_vs_rule": _NUM,
        "prefill": _PHASE,
        "decode": _PHASE,
        "generation": {
            "type": "object",
            "required": ["prompt_len", "new_tokens", "batch", "kernels", "decode_steps", "final_kv_len", "exceeds_max_seq_len",
                         "components", "prefill_totals", "decode_totals", "totals"],
            "properties": {"components": {"type": "array", "items": {
                "type": "object",
                "required": ["name", "label", "kind", "prefill_flops", "decode_flops", "total_flops",
                             "total_useful_flops"]}},
                "totals": _TOTALS},
        },
    },
}
_SIZE = {"type": "object", "required": ["n_layers", "n_kv_heads", "head_dim", "dtype", "bytes_per_value", "batch",
                                         "seq", "bytes_per_token_per_layer", "bytes_per_token", "bytes_per_layer",
                                         "total_bytes"]}
KVMEM_SCHEMA = {
    "type": "object",
    "required": ["schema", "model", "max_seq_len", "formula", "size", "without_gqa", "gqa_saving", "table", "budget"],
    "properties": {
        "schema": {"const": "llmtrace.kvmem/1"}, "formula": _STR, "size": _SIZE, "without_gqa": _SIZE,
        "gqa_saving": _NUM,
        "table": {"type": "array", "items": {"type": "object", "required": ["seq", "total_bytes"]}},
        "budget": {"anyOf": [{"type": "null"}, {"type": "object", "required": [
            "budget_bytes", "max_positions_kv_only", "weights_dtype", "weights_bytes", "max_positions_with_weights",
            "model_max_seq_len"]}]},
    },
}
MODELS_SCHEMA = {
    "type": "object",
    "required": ["schema", "dtype", "models"],
    "properties": {
        "schema": {"const": "llmtrace.models/1"},
        "models": {"type": "array", "items": {"type": "object", "required": [
            "name", "vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "head_dim", "ffn_dim", "max_seq_len",
            "tie_embeddings", "params", "weight_bytes", "kv_bytes_per_token"]}},
    },
}


def _json(args: list[str]) -> dict:
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.stderr
    assert result.stderr == ""
    return json.loads(result.stdout)


def test_flops_json_llama_7b() -> None:
    data = _json(["flops", "--json", "--prompt-len", "16", "--new-tokens", "8"])
    jsonschema.validate(data, FLOPS_SCHEMA)
    assert data["params"]["total"] == 6_738_415_616
    assert data["weight_bytes"]["fp16"] == 2 * 6_738_415_616
    decode = {c["name"]: c for c in data["decode"]["components"]}
    assert decode["attention.wq"]["flops"] == 2 * 4096 * 4096
    assert decode["feed_forward.w2"]["flops"] == 2 * 11008 * 4096
    assert data["decode"]["kv_len"] == 17  # L = P = 16 cached, plus the new token
    gen = data["generation"]
    assert gen["decode_steps"] == 7
    assert gen["totals"]["total_flops"] == data["prefill"]["totals"]["total_flops"] + gen["decode_totals"]["total_flops"]
    assert data["two_x_params"] == 2 * 6_738_415_616
    assert data["kernels"] == "fused"  # no hardware to choose by: what inference engines run
    totals = data["prefill"]["totals"]
    assert totals["arithmetic_intensity"] == pytest.approx(totals["total_flops"] / totals["total_bytes"])
    # fused: the causal 16*17/2 = 136 pairs of 32 heads of 128, twice (QKᵀ, PV), 32 layers
    assert totals["attention_dense_flops"] == totals["attention_useful_flops"] == 2 * 2 * 32 * 136 * 128 * 32


def test_flops_json_eager_counts_every_pair_and_the_scores() -> None:
    data = _json(["flops", "--json", "--prompt-len", "16", "--new-tokens", "8", "--kernels", "eager"])
    jsonschema.validate(data, FLOPS_SCHEMA)
    assert data["kernels"] == "eager"
    totals = data["prefill"]["totals"]
    assert totals["attention_dense_flops"] == 2 * 2 * 32 * 16 * 16 * 128 * 32
    scale = {c["name"]: c for c in data["prefill"]["components"]}["attention.scale"]
    assert scale["act_read_bytes"] == scale["act_write_bytes"] == 32 * 16 * 16 * 2  # the fp16 scores, in and out


def test_flops_json_batch_and_dtype() -> None:
    data = _json(["flops", "--json", "-m", "llama2-70b", "--dtype", "int4", "--batch", "4", "-p", "8", "-n", "2"])
    assert (data["weights_dtype"], data["weights_dtype_from"], data["kv_dtype"], data["activation_dtype"]) == (
        "int4", "option", "fp16", "fp16")
    assert data["batch"] == 4
    decode = {c["name"]: c for c in data["decode"]["components"]}
    assert decode["attention.wk"]["flops"] == 2 * 4 * 8192 * 1024
    assert decode["attention.wk"]["weight_bytes"] == 1024 * 8192 // 32 * 18


def test_kvmem_json() -> None:
    data = _json(["kvmem", "--seq", "2000", "--dtype", "fp16", "--json"])
    jsonschema.validate(data, KVMEM_SCHEMA)
    assert data["size"]["bytes_per_token"] == 524_288
    assert data["size"]["total_bytes"] == 1_048_576_000
    # without --dtype: the cache `run --dry-run` allocates for a preset, fp32 (was fp16 before issue 31)
    default = _json(["kvmem", "--seq", "2000", "--json"])
    assert (default["size"]["dtype"], default["size"]["total_bytes"]) == ("fp32", 2 * 1_048_576_000)
    data = _json(["kvmem", "--seq", "4096", "-m", "llama2-70b", "--batch", "8", "--budget", "80GB", "--dtype", "fp16",
                  "--json"])
    jsonschema.validate(data, KVMEM_SCHEMA)
    assert data["size"]["total_bytes"] == 2 * 80 * 8 * 128 * 2 * 4096 * 8
    assert data["without_gqa"]["total_bytes"] == 8 * data["size"]["total_bytes"]
    assert data["budget"]["max_positions_kv_only"] == 80 * 10**9 // (327_680 * 8)


def test_models_json() -> None:
    data = _json(["models", "--json"])
    jsonschema.validate(data, MODELS_SCHEMA)
    rows = {m["name"]: m for m in data["models"]}
    assert rows["llama-7b"]["params"] == 6_738_415_616
    assert rows["llama3-8b"]["kv_bytes_per_token"] == 131_072
    assert rows["smollm2-135m"]["tie_embeddings"] is True
    assert {"llama-7b", "llama2-70b", "llama3-8b", "llama3.1-405b", "mistral-7b", "tinyllama-1.1b"} <= set(rows)


def test_models_json_windows() -> None:
    """A windowed model's KV/position holds only up to its window; past it, what kvmem's total grows by a position."""
    rows = {m["name"]: m for m in _json(["models", "--json"])["models"]}
    gemma = rows["gemma3-1b"]  # 26 layers, every sixth global, 1 KV head of 256, fp16: 2 * 256 * 2 B a layer
    assert (gemma["sliding_window"], gemma["windowed_layers"]) == (512, 22)
    assert gemma["kv_bytes_per_token"] == 26 * 1024 and gemma["kv_bytes_per_token_past_window"] == 4 * 1024
    grown = [_json(["kvmem", "--model", "gemma3-1b", "--seq", str(n), "--dtype", "fp16", "--json"])["size"]["total_bytes"]
             for n in (2000, 2001)]
    assert grown[1] - grown[0] == gemma["kv_bytes_per_token_past_window"]
    assert (rows["mistral-7b"]["windowed_layers"], rows["mistral-7b"]["kv_bytes_per_token_past_window"]) == (32, 0)
    assert (rows["llama-7b"]["sliding_window"], rows["llama-7b"]["windowed_layers"]) == (0, 0)
    assert rows["llama-7b"]["kv_bytes_per_token_past_window"] == rows["llama-7b"]["kv_bytes_per_token"]


# ---- tables -----------------------------------------------------------------------------------------------------


def test_flops_table() -> None:
    result = runner.invoke(app, ["flops"])
    assert result.exit_code == 0
    out = result.stdout
    for text in ("Parameters 6,738,415,616", "Prefill of 128 tokens", "One decode step at context L=128",
                 "Whole generation: prefill of 128 + 127 decode steps", "2·BT·d·H·D = 2·1·4096·4096", "33.55 MFLOP",
                 "2·B·H·P·D = 2·1·32·8,256·128", "Kernels: fused kernels", "2 FLOPs per multiply-add", "Rule of thumb 2 × parameters = 13.48 GFLOP"):
        assert text in out, text


def test_flops_macs() -> None:
    out = runner.invoke(app, ["flops", "--macs"]).stdout
    assert "16.78 MMAC" in out  # wq on one decode token: 4096 * 4096 multiply-accumulates
    assert "1 MAC = 2 FLOPs" in out


def test_kvmem_table() -> None:
    out = runner.invoke(app, ["kvmem", "--seq", "2000", "--dtype", "fp16"]).stdout
    assert "524,288 B = 524.3 kB (512.0 KiB)" in out
    assert "Total: 1.049 GB (0.9766 GiB)" in out
    assert "← --seq" in out and "model max" in out
    out = runner.invoke(app, ["kvmem", "--seq", "2000", "-m", "llama3-8b", "--budget", "24GiB", "--dtype", "fp16"]).stdout
    assert "Without GQA (32 KV heads instead of 8)" in out and "4.00× more" in out
    assert "196,608 positions per sequence of KV cache alone" in out  # 24 GiB / 128 KiB


def test_models_table() -> None:
    out = runner.invoke(app, ["models"]).stdout
    assert "llama2-70b" in out and "512.0 KiB" in out and "smollm2-135m" in out


def test_flops_on_a_checkpoint_shows_its_real_parameters(make_tiny_llama: Callable[..., Path]) -> None:
    folder = make_tiny_llama("cli-flops", shards=2)
    data = _json(["flops", "--json", "-m", str(folder), "-p", "4", "-n", "2"])
    assert data["checkpoint"]["format"] == "safetensors"
    assert data["checkpoint"]["n_params"] == data["params"]["total"]
    assert data["weights_dtype"] == "fp32" and data["weights_dtype_from"] == "checkpoint"


def test_flops_prompt_counts_with_the_model_tokenizer(tiny_llama_dir: Path) -> None:
    import sentencepiece

    sp = sentencepiece.SentencePieceProcessor(model_file=str(tiny_llama_dir / "tokenizer.model"))
    text = "The sky is blue because"
    data = _json(["flops", "--json", "-m", str(tiny_llama_dir), "--prompt", text, "-n", "3"])
    assert data["prompt_len"] == 1 + len(sp.encode(text))
    assert data["prompt_tokenizer"] == str(tiny_llama_dir)


# ---- bad input: one line on stderr, exit 2 ----------------------------------------------------------------------


def _bad_gguf(tmp_path: Path) -> str:
    file = tmp_path / "truncated.gguf"
    file.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 1, 5) + b"\x10")
    return str(file)


def _bad_safetensors_folder(tmp_path: Path) -> str:
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 100, "hidden_size": 64,
        "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 96}))
    (folder / "model.safetensors").write_bytes(struct.pack("<Q", 500) + b'{"w": ')
    return str(folder)


def _config_lacking_field(tmp_path: Path) -> str:
    file = tmp_path / "config.json"
    file.write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "vocab_size": 100, "hidden_size": 64,
                                "num_attention_heads": 4, "intermediate_size": 96}))
    return str(file)


def _config_unreadable(tmp_path: Path) -> str:
    file = tmp_path / "config.json"
    file.write_text("{oops")
    return str(file)


BAD_INPUTS: dict[str, tuple[Callable[[Path], list[str]], str]] = {
    "unknown preset": (lambda t: ["flops", "--model", "llama-7c"], "did you mean llama-7b"),
    "unknown preset kvmem": (lambda t: ["kvmem", "-m", "lama2-70b"], "did you mean llama2-70b"),
    "seq zero": (lambda t: ["kvmem", "--seq", "0"], "'--seq'"),
    "seq negative": (lambda t: ["kvmem", "--seq", "-5"], "'--seq'"),
    "seq not a number": (lambda t: ["kvmem", "--seq", "abc"], "'abc'"),
    "prompt-len zero": (lambda t: ["flops", "--prompt-len", "0"], "'--prompt-len'"),
    "new-tokens not a number": (lambda t: ["flops", "--new-tokens", "many"], "'many'"),
    "unknown dtype flops": (lambda t: ["flops", "--dtype", "fp7"],
                            "'--dtype': unknown dtype 'fp7'; choose one of fp32, bf16, fp16, fp8, int8, int4"),
    "unknown dtype kvmem": (lambda t: ["kvmem", "--dtype", "int3"], "unknown dtype 'int3'; choose one of"),
    "unknown kv dtype roofline": (lambda t: ["roofline", "--kv-dtype", "int3"], "unknown dtype 'int3'; choose one of"),
    "tf32 is no storage dtype": (lambda t: ["models", "--dtype", "tf32"], "cannot use 'tf32'; choose one of fp32"),
    "unknown option": (lambda t: ["kvmem", "--sequence", "5"], "No such option"),
    "bad budget": (lambda t: ["kvmem", "--budget", "12XB"], "memory size"),
    "config missing": (lambda t: ["flops", "-m", str(t / "absent" / "config.json")], "no such file or folder"),
    "config unreadable": (lambda t: ["kvmem", "-m", _config_unreadable(t)], "not valid JSON"),
    "config lacks a field": (lambda t: ["flops", "-m", _config_lacking_field(t)], "missing field 'num_hidden_layers'"),
    "gguf truncated": (lambda t: ["flops", "-m", _bad_gguf(t)], "truncated"),
    "safetensors malformed": (lambda t: ["flops", "-m", _bad_safetensors_folder(t)], "truncated"),
    "prompt on a preset": (lambda t: ["flops", "--prompt", "hello"], "--prompt-len"),
    "prompt and prompt-len": (lambda t: ["flops", "--prompt", "hi", "--prompt-len", "3"], "not both"),
}


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_input_is_one_line_exit_2(case: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    make_args, expected = BAD_INPUTS[case]
    code, out, err = invoke_main(make_args(tmp_path), capsys)
    assert code == 2
    assert out == ""
    lines = err.splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("llmtrace: error: ")
    assert expected in lines[0]


@pytest.mark.parametrize("case", ["unknown preset", "config lacks a field", "gguf truncated", "safetensors malformed",
                                  "prompt on a preset", "bad budget"])
def test_library_errors_through_clirunner(case: str, tmp_path: Path) -> None:
    make_args, expected = BAD_INPUTS[case]
    result = runner.invoke(app, make_args(tmp_path))
    assert result.exit_code == 2
    assert result.stdout == ""
    assert result.stderr.count("\n") == 1 and expected in result.stderr


def test_bad_input_in_a_real_process(tmp_path: Path) -> None:
    for args, expected in ((["kvmem", "--seq", "abc"], "'abc'"), (["flops", "-m", _bad_gguf(tmp_path)], "truncated")):
        proc = run_llmtrace(args)
        assert proc.returncode == 2
        assert proc.stdout == ""
        assert len(proc.stderr.splitlines()) == 1 and expected in proc.stderr
        assert "Traceback" not in proc.stderr


def test_debug_env_shows_the_traceback() -> None:
    proc = run_llmtrace(["flops", "-m", "llama-7c"], env={"LLMTRACE_DEBUG": "1"})
    assert proc.returncode != 0
    assert "Traceback" in proc.stderr and "UnknownPresetError" in proc.stderr


# ---- no torch, no numpy -----------------------------------------------------------------------------------------


def _imported_modules(importtime_stderr: str) -> set[str]:
    """Module names from `python -X importtime` lines: 'import time: self | cumulative | <indent>name'."""
    return {line.rsplit("|", 1)[1].strip() for line in importtime_stderr.splitlines() if line.startswith("import time:")}


@pytest.mark.parametrize("args", [
    ["kvmem", "--seq", "2000"],
    ["flops"],
    ["models"],
    ["flops", "--json"],
    ["flops", "--model", "BUNDLED"],
    ["flops", "--model", "BUNDLED", "--prompt", "今天天气真"],
    ["kvmem", "--model", "BUNDLED"],
    ["roofline"],
    ["roofline", "--model", "BUNDLED", "--dtype", "int4", "--json"],
    ["hardware"],
    ["hardware", "--json"],
    ["flops", "--model", "TINY", "--prompt", "hello"],  # an HF folder: safetensors headers and its tokenizer
    ["kvmem", "--model", "TINY", "--dtype", "q8_0"],
    ["show", "tests/data/readme_run.trace.json.gz"],  # a saved run rendered: records only, no model
    ["--help"],
    ["flops", "--help"],
])
def test_analytical_commands_never_import_torch_or_numpy(args: list[str], tiny_llama_dir: Path) -> None:
    named = {"BUNDLED": str(bundled_model_path()), "TINY": str(tiny_llama_dir)}
    args = [named.get(a, a) for a in args]
    proc = run_llmtrace(args, python_flags=("-X", "importtime"))
    assert proc.returncode == 0, proc.stderr[-2000:]
    modules = _imported_modules(proc.stderr)
    assert "llmtrace.cli.app" in modules  # the parse works: the entry point itself is listed
    assert not {m for m in modules if m.split(".")[0] in ("torch", "numpy")}
