"""Malformed but parseable input ends in one line and exit 2, never an internal error (issue 10, item 3 and 6):
every reader of outside data checks types, ranges, finite values, nesting and file kinds where the value enters."""

from __future__ import annotations

import json
import math
import os
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable

import pytest
from typer.testing import CliRunner

from llmtrace.cli.app import app
from llmtrace.tracer.checkpoint.gguf_header import read_gguf_header
from llmtrace.tracer.checkpoint.safetensors_header import read_safetensors_header
from llmtrace.tracer.core.config import ModelConfig
from llmtrace.tracer.core.errors import ConfigError, FileFormatError, LlmtraceError

runner = CliRunner()
REPO = Path(__file__).resolve().parent.parent
DEEP = "[" * 100_000 + "]" * 100_000


def _one_line_exit_2(result: Any, *needles: str) -> None:
    assert result.exit_code == 2, result.output
    assert result.stderr.count("\n") == 1, result.stderr
    assert "internal error" not in result.stderr and "Traceback" not in result.output
    for needle in needles:
        assert needle in result.stderr, result.stderr


# ---- config.json ---------------------------------------------------------------------------------------------------

def _hf(**changes: Any) -> dict[str, Any]:
    base = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 100, "hidden_size": 64,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 96,
            "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "max_position_embeddings": 256}
    base.update(changes)
    return base


@pytest.mark.parametrize("text, field", [
    (json.dumps(_hf(num_attention_heads="two")), "'num_attention_heads' must be a whole number"),
    (json.dumps(_hf(num_hidden_layers=2.5)), "'num_hidden_layers' must be a whole number"),
    (json.dumps(_hf(num_attention_heads=0)), "n_heads must be a positive integer"),
    (json.dumps(_hf(hidden_size=-64)), "dim must be a positive integer"),
    (json.dumps(_hf(vocab_size=2**62)), "vocab_size is 4,611,686,018,427,387,904, beyond any real model"),
    (json.dumps(_hf(rope_theta=0)), "rope_theta must be a finite number > 0"),
    (json.dumps(_hf(rms_norm_eps=-1e-5)), "norm_eps must be a finite number > 0"),
    (json.dumps(_hf(max_position_embeddings=float("nan"))), "'max_position_embeddings' must be a whole number"),
    (json.dumps(_hf(rope_theta=float("inf"))), "'rope_theta' must be a finite number"),
    (json.dumps(_hf(architectures=[["LlamaForCausalLM"]])), "'architectures' must be a list of names"),
    (json.dumps(_hf(model_type=["llama"])), "'model_type' must be a name"),
    (json.dumps(_hf(tie_word_embeddings="yes")), "'tie_word_embeddings' must be true or false"),
    (json.dumps(_hf(head_dim=[16])), "'head_dim' must be a whole number"),
    (json.dumps(_hf(rope_scaling={"rope_type": "llama3", "factor": "8", "low_freq_factor": 1,
                                  "high_freq_factor": 4, "original_max_position_embeddings": 8192})),
     "'rope_scaling.factor' must be a finite number"),
    ('{"a": ' + DEEP + "}", "nested too deeply"),
    ("\xff\xfe{}", "not valid JSON"),
])
def test_malformed_config_json_is_one_line(text: str, field: str, tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(text, encoding="latin-1" if text.startswith("\xff") else "utf-8")
    for command in (["flops", "-m", str(tmp_path)], ["kvmem", "-m", str(tmp_path / "config.json")]):
        _one_line_exit_2(runner.invoke(app, command), field, "config")


# ---- GGUF metadata -------------------------------------------------------------------------------------------------

def _gguf_meta(**changes: Any) -> dict[str, Any]:
    meta = {"general.architecture": "llama", "llama.block_count": 2, "llama.embedding_length": 64,
            "llama.feed_forward_length": 96, "llama.attention.head_count": 4, "llama.attention.head_count_kv": 2,
            "llama.context_length": 256, "llama.vocab_size": 100, "llama.rope.freq_base": 10000.0,
            "llama.attention.layer_norm_rms_epsilon": 1e-5}
    meta.update(changes)
    return meta


@pytest.mark.parametrize("change, field", [
    ({"llama.block_count": "2"}, "'llama.block_count' must be a whole number"),
    ({"llama.attention.head_count": 0}, "'llama.attention.head_count' is 0"),
    ({"llama.context_length": math.nan}, "'llama.context_length' must be a whole number"),
    ({"llama.rope.freq_base": 0.0}, "rope_theta must be a finite number > 0"),
    ({"llama.attention.layer_norm_rms_epsilon": math.inf}, "must be a finite number"),
    ({"llama.embedding_length": [64]}, "'llama.embedding_length' must be a whole number"),
    ({"llama.attention.key_length": -8}, "head_dim must be a positive integer"),
    ({"llama.block_count": 2**40}, "beyond any real model"),
])
def test_malformed_gguf_metadata_is_a_config_error(change: dict[str, Any], field: str) -> None:
    with pytest.raises(ConfigError, match=field.replace("(", r"\(").replace(")", r"\)")) as info:
        ModelConfig.from_gguf_metadata(_gguf_meta(**change), "m", "m.gguf")
    assert "\n" not in str(info.value)


def test_a_gguf_error_names_the_files_own_key() -> None:
    """The key as the file spells it, under its architecture's prefix (not llama's)."""
    meta = {k.replace("llama.", "qwen2."): v for k, v in _gguf_meta().items()} | {
        "general.architecture": "qwen2", "qwen2.attention.head_count": 0}
    with pytest.raises(ConfigError, match="'qwen2.attention.head_count' is 0; it must be at least 1"):
        ModelConfig.from_gguf_metadata(meta, "m", "m.gguf")


@pytest.mark.parametrize("shared", [0, -5, True, 2.5, "64", 2**25])
def test_a_shared_expert_width_that_is_not_a_width_is_one_line(shared: Any) -> None:
    """A trace's or preset's config with a shared expert (Qwen2-MoE) whose width is no positive whole number (a bool
    is not one) is a ConfigError naming the field, not a model built from it."""
    from llmtrace.tracer.core.config import MoeSpec

    with pytest.raises(ConfigError, match="shared_expert_dim must be an integer from 1 to 16,777,216, got"):
        ModelConfig("m", 100, 64, 1, 4, 2, 96, moe=MoeSpec(4, 2, "softmax"), shared_expert_dim=shared)
    assert ModelConfig("m", 100, 64, 1, 4, 2, 96, moe=MoeSpec(4, 2, "softmax"), shared_expert_dim=32
                       ).shared_expert_dim == 32


def _gguf_bytes(metadata: bytes, n_kv: int) -> bytes:
    return b"GGUF" + struct.pack("<IQQ", 3, 0, n_kv) + metadata


def _key(name: str) -> bytes:
    return struct.pack("<Q", len(name)) + name.encode()


def test_nested_gguf_metadata_arrays_are_refused(tmp_path: Path) -> None:
    depth = 5000
    value = struct.pack("<I", 9) + b"".join(struct.pack("<IQ", 9, 1) for _ in range(depth)) + struct.pack("<IQ", 4, 0)
    path = tmp_path / "nested.gguf"
    path.write_bytes(_gguf_bytes(_key("x") + value, 1))
    for decode in (False, True):
        with pytest.raises(FileFormatError, match="nested more than"):
            read_gguf_header(path, decode_arrays=decode)


def test_gguf_special_token_outside_the_vocabulary_is_refused(tmp_path: Path, sp_model_bytes: bytes,
                                                              make_tiny_llama: Callable[..., Path]) -> None:
    import gguf
    from tiny_gguf import sentencepiece_vocab, write_tiny_gguf

    from llmtrace.tracer.load.hf_loader import load_hf_state_dict
    from llmtrace.tracer.load.loader import load_model

    folder = make_tiny_llama("hostile-bos")
    config = ModelConfig.from_hf_json(folder)
    path = tmp_path / "bad-bos.gguf"
    write_tiny_gguf(path, config, load_hf_state_dict(folder, config), vocab=sentencepiece_vocab(sp_model_bytes))
    reader = gguf.GGUFReader(str(path), "r+")
    field = reader.fields["tokenizer.ggml.bos_token_id"]
    field.parts[field.data[0]][0] = 10**6  # in place, through the memory map
    del reader
    with pytest.raises(FileFormatError, match="bos_token_id is 1000000, outside the vocabulary"):
        load_model(str(path), use_cache=False)


# ---- safetensors headers -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("header, message", [
    ({"w": {"dtype": ["F32"], "shape": [1], "data_offsets": [0, 4]}}, "unknown dtype ['F32']"),
    ({"w": {"dtype": "F32", "shape": "1", "data_offsets": [0, 4]}}, "malformed shape"),
    ({"w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4.0]}}, "malformed data_offsets"),
    ({"__metadata__": ["x"]}, "'__metadata__' is not a JSON object"),
    (None, "nested too deeply"),
])
def test_malformed_safetensors_headers_are_file_format_errors(header: Any, message: str, tmp_path: Path) -> None:
    raw = (json.dumps(header) if header is not None else DEEP).encode()
    path = tmp_path / "model.safetensors"
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + b"\0" * 4)
    with pytest.raises(FileFormatError) as info:
        read_safetensors_header(path)
    assert message in str(info.value) and "\n" not in str(info.value)


# ---- file kinds ----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name, command", [
    ("x.gguf", ["flops", "-m"]),
    ("x.gguf", ["run", "sky", "--no-roofline", "-m"]),
    ("model.bin", ["run", "sky", "--no-roofline", "-m"]),
])
def test_a_fifo_as_model_is_refused_not_waited_on(name: str, command: list[str], tmp_path: Path) -> None:
    fifo = tmp_path / name
    os.mkfifo(fifo)
    proc = subprocess.run([sys.executable, "-m", "llmtrace", *command, str(fifo)], cwd=REPO, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert any(words in proc.stderr for words in ("not a regular file", "not a model folder", "not a file or folder"))


# ---- numeric options -----------------------------------------------------------------------------------------------

BIG = str(10**30)


@pytest.mark.parametrize("args, needle", [
    (["run", "sky", "--threads", BIG], "--threads must be between 1 and the"),
    (["run", "sky", "--threads", "100000"], "more threads than CPUs"),
    (["run", "--model", "llama-7b", "--dry-run", "--prompt-tokens", BIG], "holds 2048 positions"),
    (["run", "sky", "--temperature", "nan"], "--temperature must be a finite number"),
    (["run", "sky", "--top-p", "2", "--temperature", "1"], "--top-p must be in (0, 1]"),
    (["run", "sky", "--seed", BIG, "--temperature", "1"], "--seed must be a whole number"),
    (["run", "", "--literal"], "the prompt is empty"),
    (["hardware", "--measure", "--copy-mib", BIG], "give a smaller --copy-mib"),
    (["hardware", "--measure", "--repeats", BIG], "repeats must be at most 1000"),
])
def test_argument_checks_come_before_any_model_is_loaded(args: list[str], needle: str,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    from llmtrace.tracer.load import loader

    def never(*a: object, **k: object) -> None:
        raise AssertionError("the model was loaded before the arguments were checked")

    if "--dry-run" not in args:
        monkeypatch.setattr(loader, "load_model", never)
    result = runner.invoke(app, args)
    _one_line_exit_2(result, needle)
    if "--dry-run" not in args:  # the prompt length is checked against the preset's context once it is known
        assert "layers ·" not in result.output  # no model header printed


def test_generation_of_10_to_the_30_tokens_is_costed_in_closed_form() -> None:
    """A loop over decode steps never finished; the sum is now exact and instant (tests/test_estimate.py checks
    it against step-by-step sums)."""
    result = runner.invoke(app, ["flops", "--new-tokens", BIG, "--json"])
    assert result.exit_code == 0, result.output
    generation = json.loads(result.stdout)["generation"]
    assert generation["new_tokens"] == 10**30 and generation["decode_steps"] == 10**30 - 1
    assert generation["final_kv_len"] == 128 + 10**30 - 1 and generation["exceeds_max_seq_len"] is True


def test_closed_form_equals_the_step_by_step_sum() -> None:
    from llmtrace.tracer.analytic import estimate
    from llmtrace.tracer.core.dtypes import get_dtype
    from llmtrace.tracer.core.presets import get_preset

    cfg = get_preset("llama3-8b")
    for kernels in (estimate.Kernels.EAGER, estimate.Kernels.FUSED):
        dtypes = estimate.Dtypes.for_weights(get_dtype("fp16"))
        whole = estimate.generation(cfg, 37, 41, dtypes, batch=3, kernels=kernels).totals
        pre = estimate.prefill(cfg, 37, dtypes, 3, kernels).totals
        steps = [estimate.decode_step(cfg, c, dtypes, 3, kernels).totals for c in range(37, 37 + 40)]
        assert whole.total_flops == pre.total_flops + sum(s.total_flops for s in steps)
        assert whole.total_bytes == pre.total_bytes + sum(s.total_bytes for s in steps)
        assert whole.kv_read_bytes == pre.kv_read_bytes + sum(s.kv_read_bytes for s in steps)


def test_non_finite_logits_mid_run_are_one_line(tiny_llama_dir: Path, tmp_path: Path) -> None:
    """NaN weights (a broken conversion) reach the logits only after the report has begun: a typed error."""
    import shutil

    from safetensors.torch import load_file, save_file

    folder = tmp_path / "nan-model"
    shutil.copytree(tiny_llama_dir, folder)
    state = load_file(folder / "model.safetensors")
    name = next(k for k in state if k.endswith("norm.weight") and "layers" not in k)
    state[name][:] = float("nan")
    save_file(state, folder / "model.safetensors")
    result = runner.invoke(app, ["run", "sky", "--model", str(folder), "--max-new-tokens", "2", "--no-roofline"])
    _one_line_exit_2(result, "logits at prefill step 0 are not finite")


# ---- traces --------------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def saved_trace(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    path = tmp_path_factory.mktemp("trace") / "run.json"
    result = runner.invoke(app, ["run", "sky", "--model", str(tiny_llama_dir), "--max-new-tokens", "2",
                                 "--no-roofline", "--json", str(path), "--temperature", "0.7", "--seed", "1"])
    assert result.exit_code == 0, result.output
    return json.loads(path.read_text(encoding="utf-8"))


def _paths(value: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Every leaf and container position in a JSON document (lists: their first element only)."""
    out = [prefix] if prefix else []
    if isinstance(value, dict):
        for k, v in value.items():
            out += _paths(v, prefix + (k,))
    elif isinstance(value, list) and value:
        out += _paths(value[0], prefix + (0,))
    return out


def _replace(doc: Any, path: tuple[Any, ...], new: Any) -> Any:
    doc = json.loads(json.dumps(doc))
    target = doc
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = new
    return doc


SWAPS = ["text", -1, 0, 10**30, 2.5, float("nan"), None, True, [], {}, [[1]]]


def _show(doc: Any, tmp_path: Path) -> Any:
    path = tmp_path / "t.json"
    path.write_text(json.dumps(doc), encoding="utf-8")
    return runner.invoke(app, ["show", str(path), "--detail", "ops"])


def test_a_stage_without_shapes_is_refused_on_reading(saved_trace: dict[str, Any], tmp_path: Path) -> None:
    for key in ("input_shapes", "output_shapes"):
        result = _show(_replace(saved_trace, ("stage_work", 3, key), []), tmp_path)
        _one_line_exit_2(result, "at least one shape", "does not match the schema")


def test_every_field_of_a_trace_with_a_wrong_type_is_one_line_or_shown(saved_trace: dict[str, Any],
                                                                      tmp_path: Path) -> None:
    """Every field (and a first element of each list) swapped for a wrong value: `show` renders it or says in one
    line what is wrong, never an internal error halfway through the render. (Every swap of every field was run once
    by hand, 612 s; only empty shape lists failed, now refused on reading.)"""
    failures = []
    paths = [p for p in _paths(saved_trace) if p[0] not in ("schema", "schema_version")]
    for index, path in enumerate(paths):  # one wrong value per position, every kind of value in turn (~1 s each)
        for swap in (SWAPS[index % len(SWAPS)],):
            result = _show(_replace(saved_trace, path, swap), tmp_path)
            if result.exit_code == 0:
                continue
            if result.exit_code != 2 or result.stderr.count("\n") != 1 or "internal error" in result.stderr:
                failures.append((path, swap, result.exit_code, (result.stderr or repr(result.exception))[-300:]))
    assert not failures, failures[:10]


def test_a_deeply_nested_trace_is_one_line(tmp_path: Path) -> None:
    path = tmp_path / "t.json"
    path.write_text(DEEP)
    _one_line_exit_2(runner.invoke(app, ["show", str(path)]), "nested too deeply", str(path))


# ---- terminal escapes ----------------------------------------------------------------------------------------------

def test_escape_sequences_in_model_metadata_are_shown_not_obeyed(saved_trace: dict[str, Any], tmp_path: Path) -> None:
    """A GGUF's general.name, token pieces and generated text are outside text: ESC would retitle or clear the
    user's terminal. Every console writes control characters as visible escapes."""
    doc = json.loads(json.dumps(saved_trace))
    doc["config"]["name"] = "evil\x1b]0;pwned\x07\x1b[2J"
    doc["generated_text"] = "text\x1b[31mred"
    doc["steps"][0]["piece"] = "\x1b[2J"
    result = _show(doc, tmp_path)
    assert result.exit_code == 0, result.output
    assert "\x1b" not in result.output and "evil\\x1b]0;pwned" in result.output and "\\x1b[2J" in result.output


def test_escape_sequences_in_an_error_message_are_shown_not_obeyed(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(_hf(architectures=["evil\x1b[2J"])))
    result = runner.invoke(app, ["flops", "-m", str(tmp_path)])
    assert result.exit_code == 2 and "\x1b" not in result.stderr and "evil\\x1b[2J" in result.stderr
