"""Loading HF model folders: end to end, memory-mapped, sharded, and every kind of bad folder as a typed error."""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path
from typing import Callable

import pytest
import torch
from safetensors.torch import load_file, save_file

from llmtrace.tracer.checkpoint.safetensors_header import read_safetensors_header
from llmtrace.tracer.checkpoint.tokenizer import SentencePieceTokenizer, load_tokenizer
from llmtrace.tracer.core.config import ModelConfig
from llmtrace.tracer.core.contract import expected_shapes, hf_to_ours, ours_to_hf
from llmtrace.tracer.core.dtypes import BF16, FP32
from llmtrace.tracer.core.errors import CheckpointError, ConfigError, FileFormatError
from llmtrace.tracer.load.hf_loader import load_hf_for_run, load_hf_state_dict
from llmtrace.tracer.model.transformer import build_meta_model


def copy_folder(source: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(source, tmp_path / "model"))


def test_tiny_folder_loads_end_to_end_and_generates(tiny_llama_dir: Path) -> None:
    config = ModelConfig.from_hf_json(tiny_llama_dir)
    state = load_hf_state_dict(tiny_llama_dir, config)
    assert set(state) == set(expected_shapes(config))
    stored = load_file(tiny_llama_dir / "model.safetensors")
    assert torch.equal(state["layers.1.feed_forward.w1.weight"], stored["model.layers.1.mlp.gate_proj.weight"])
    model = build_meta_model(config)
    model.load_weights(state)
    tokenizer = load_tokenizer(tiny_llama_dir)
    assert isinstance(tokenizer, SentencePieceTokenizer) and tokenizer.vocab_size == config.vocab_size
    ids = torch.tensor([tokenizer.encode("The capital of France is")])
    assert ids[0, 0].item() == tokenizer.bos_id == 1
    model.setup_cache(1, 32)
    logits = model.prefill(ids)
    assert logits.shape == (1, config.vocab_size) and torch.isfinite(logits).all()
    assert not any(p.is_meta for p in model.parameters())


def test_weights_are_views_of_one_memory_map_not_copies(tiny_llama_dir: Path) -> None:
    config = ModelConfig.from_hf_json(tiny_llama_dir)
    state = load_hf_state_dict(tiny_llama_dir, config)
    storages = {t.untyped_storage().data_ptr() for t in state.values()}
    assert len(storages) == 1  # every tensor shares the storage of the mapped file
    file_size = (tiny_llama_dir / "model.safetensors").stat().st_size
    assert next(iter(state.values())).untyped_storage().nbytes() == file_size
    model = build_meta_model(config)
    model.load_weights(state)
    attention = model.layers[0].attention
    assert attention.wo.weight.untyped_storage().data_ptr() in storages  # assign=True: no copy
    assert model.norm.weight.untyped_storage().data_ptr() in storages
    # but Q|K|V (and gate|up), which the file does not hold in that order, laid out as one product each at load
    # (tracer/model/packing.py; load_hf_for_run, what `run` loads, writes them so and the load copies nothing)
    packed = {attention.wq.weight.untyped_storage().data_ptr(), attention.wv.weight.untyped_storage().data_ptr()}
    assert len(packed) == 1 and packed.isdisjoint(storages)
    for_run = load_hf_for_run(tiny_llama_dir, config, FP32)
    held = {name: t.data_ptr() for name, t in for_run.items()}
    model.load_weights(for_run)
    assert {name: t.data_ptr() for name, t in model.state_dict().items()} == held


def test_dtype_conversion_on_load(tiny_llama_dir: Path) -> None:
    config = ModelConfig.from_hf_json(tiny_llama_dir)
    state = load_hf_state_dict(tiny_llama_dir, config, dtype=BF16)
    assert {t.dtype for t in state.values()} == {torch.bfloat16}


def test_sharded_checkpoint_equals_single_file(make_tiny_llama: Callable[..., Path], tiny_llama_dir: Path) -> None:
    sharded = make_tiny_llama("default-sharded", shards=3)  # same seed and config as the default
    assert not (sharded / "model.safetensors").exists() and len(list(sharded.glob("*.safetensors"))) == 3
    config = ModelConfig.from_hf_json(sharded)
    one, many = load_hf_state_dict(tiny_llama_dir, config), load_hf_state_dict(sharded, config)
    assert set(one) == set(many) and all(torch.equal(one[k], many[k]) for k in one)


def test_tied_checkpoint_may_carry_a_redundant_lm_head(make_tiny_llama: Callable[..., Path], tmp_path: Path) -> None:
    folder = copy_folder(make_tiny_llama("tied", tie=True), tmp_path)
    tensors = load_file(folder / "model.safetensors")
    assert "lm_head.weight" not in tensors
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
    save_file(tensors, str(folder / "model.safetensors"))
    config = ModelConfig.from_hf_json(folder)
    state = load_hf_state_dict(folder, config)
    assert "output.weight" not in state
    model = build_meta_model(config)
    model.load_weights(state)
    assert model.output.weight is model.tok_embeddings.weight


def rewrite(folder: Path, edit: Callable[[dict[str, torch.Tensor]], None]) -> None:
    tensors = load_file(folder / "model.safetensors")
    edit(tensors)
    save_file(tensors, str(folder / "model.safetensors"))


def test_missing_tensor_is_named(tiny_llama_dir: Path, tmp_path: Path) -> None:
    folder = copy_folder(tiny_llama_dir, tmp_path)
    rewrite(folder, lambda t: t.pop("model.layers.1.self_attn.k_proj.weight"))
    with pytest.raises(CheckpointError, match=r"1 missing: model\.layers\.1\.self_attn\.k_proj\.weight"):
        load_hf_state_dict(folder, ModelConfig.from_hf_json(folder))


def test_unexpected_tensor_is_named(tiny_llama_dir: Path, tmp_path: Path) -> None:
    folder = copy_folder(tiny_llama_dir, tmp_path)
    rewrite(folder, lambda t: t.update({"model.layers.0.self_attn.q_proj.bias": torch.zeros(64)}))
    with pytest.raises(CheckpointError, match=r"1 unexpected: model\.layers\.0\.self_attn\.q_proj\.bias"):
        load_hf_state_dict(folder, ModelConfig.from_hf_json(folder))


def test_wrong_shape_is_named_with_both_shapes(tiny_llama_dir: Path, tmp_path: Path) -> None:
    folder = copy_folder(tiny_llama_dir, tmp_path)
    data = json.loads((folder / "config.json").read_text())
    data["intermediate_size"] = 128  # the weights have 96
    (folder / "config.json").write_text(json.dumps(data))
    with pytest.raises(CheckpointError, match=r"6 wrong shape: model\.layers\.0\.mlp\.gate_proj\.weight is \[96, 64\], "
                                              r"config wants \[128, 64\]"):
        load_hf_state_dict(folder, ModelConfig.from_hf_json(folder))


def test_every_problem_is_reported_at_once(tiny_llama_dir: Path, tmp_path: Path) -> None:
    folder = copy_folder(tiny_llama_dir, tmp_path)

    def edit(t: dict[str, torch.Tensor]) -> None:
        t.pop("model.norm.weight")
        t["extra.weight"] = torch.zeros(2)
        t["model.layers.0.input_layernorm.weight"] = torch.ones(65)

    rewrite(folder, edit)
    with pytest.raises(CheckpointError) as info:
        load_hf_state_dict(folder, ModelConfig.from_hf_json(folder))
    message = str(info.value)
    assert "1 missing: model.norm.weight" in message and "1 unexpected: extra.weight" in message
    assert "model.layers.0.input_layernorm.weight is [65]" in message and "\n" not in message


def test_truncated_safetensors_is_a_file_format_error(tiny_llama_dir: Path, tmp_path: Path) -> None:
    folder = copy_folder(tiny_llama_dir, tmp_path)
    path = folder / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 1000])
    with pytest.raises(FileFormatError, match="truncated"):
        load_hf_state_dict(folder, ModelConfig.from_hf_json(folder))
    path.write_bytes(data[:100])  # cut inside the header
    with pytest.raises(FileFormatError, match="truncated"):
        load_hf_state_dict(folder, ModelConfig.from_hf_json(folder))
    path.write_bytes(b"\x05")
    with pytest.raises(FileFormatError, match="truncated"):
        load_hf_state_dict(folder, ModelConfig.from_hf_json(folder))


def test_corrupt_header_is_a_file_format_error(tiny_llama_dir: Path, tmp_path: Path) -> None:
    folder = copy_folder(tiny_llama_dir, tmp_path)
    path = folder / "model.safetensors"
    header = b"{not json" + b" " * 7
    path.write_bytes(struct.pack("<Q", len(header)) + header + b"\0" * 64)
    with pytest.raises(FileFormatError, match="not valid JSON"):
        read_safetensors_header(path)
    header = json.dumps({"w": {"dtype": "F32", "shape": [4, 4], "data_offsets": [0, 60]}}).encode()
    path.write_bytes(struct.pack("<Q", len(header)) + header + b"\0" * 64)
    with pytest.raises(FileFormatError, match="needs 64"):
        read_safetensors_header(path)


def test_missing_folder_no_config_and_no_weights(tiny_llama_dir: Path, tmp_path: Path) -> None:
    config = ModelConfig.from_hf_json(tiny_llama_dir)
    with pytest.raises(CheckpointError, match="no such folder"):
        load_hf_state_dict(tmp_path / "absent", config)
    folder = copy_folder(tiny_llama_dir, tmp_path)
    (folder / "config.json").unlink()
    with pytest.raises(ConfigError, match="no config.json"):
        load_hf_state_dict(folder, config)
    with pytest.raises(ConfigError):
        ModelConfig.from_hf_json(folder)
    shutil.copy(tiny_llama_dir / "config.json", folder / "config.json")
    (folder / "model.safetensors").unlink()
    (folder / "pytorch_model.bin").write_bytes(b"pickle")
    with pytest.raises(CheckpointError, match="no model.safetensors.*pickled"):
        load_hf_state_dict(folder, config)


def test_index_naming_a_missing_shard(make_tiny_llama: Callable[..., Path], tmp_path: Path) -> None:
    folder = copy_folder(make_tiny_llama("default-sharded", shards=3), tmp_path)
    (folder / "model-00002-of-00003.safetensors").unlink()
    with pytest.raises(CheckpointError, match="model-00002-of-00003.safetensors"):
        load_hf_state_dict(folder, ModelConfig.from_hf_json(folder))


def test_name_mapping_round_trips_every_tensor() -> None:
    config = ModelConfig("t", 10, 8, 3, 2, 1, 12)
    for name in expected_shapes(config):
        assert hf_to_ours(ours_to_hf(name)) == name
    assert hf_to_ours("model.layers.2.mlp.up_proj.weight") == "layers.2.feed_forward.w3.weight"
    assert hf_to_ours("model.layers.2.self_attn.rotary_emb.inv_freq") is None
