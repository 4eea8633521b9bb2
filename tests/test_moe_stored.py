"""A mixture of experts held at the file's precision (issue 29, item 1): a GGUF's 3-D ffn_*_exps tensors kept as
their blocks, one contiguous byte range per expert, each chosen expert's products run by the stored kernels the dense
matrices use; the logits those of the dequantized fp32 model (exact kernels), a step's weight bytes the real sizes of
what it read (attention, norms, router, the distinct experts its routing names, head), and a run's peak memory the
file's bytes, not the experts in fp32."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import gguf
import pytest
import torch
from test_memory_budget import CHILD, SLACK
from test_mixtral import mixtral_dict
from test_qwen2 import _bundled_vocab
from tiny_gguf import write_tiny_gguf
from tiny_llama import random_weights

from llmtrace.tracer.analytic.kvmem import kv_cache_bytes
from llmtrace.tracer.checkpoint.gguf_header import read_gguf_header
from llmtrace.tracer.core.config import ModelConfig
from llmtrace.tracer.core.contract import ours_to_gguf
from llmtrace.tracer.core.dtypes import FP32
from llmtrace.tracer.load.loader import load_model
from llmtrace.tracer.model import native_kernel
from llmtrace.tracer.model.weight_formats import ExpertWeights
from llmtrace.tracer.trace.hooks import Tracer
from llmtrace.tracer.trace.records import DECODE, PREFILL
from llmtrace.tracer.trace.routing import routing_step

REPO = Path(__file__).resolve().parent.parent
E, K, PROMPT, STEPS = 4, 2, 7, 6
EXPERT_ROLES = ("feed_forward.w1", "feed_forward.w3", "feed_forward.w2")

pytestmark = [pytest.mark.skipif(not native_kernel.available(), reason="llmtrace's C kernels are not built here"),
              pytest.mark.usefixtures("private_dirs")]


@pytest.fixture(scope="module", params=["Q4_0", "Q8_0"])
def tiny(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, ModelConfig]:
    """A tiny Mixtral-style 'llama' GGUF (4 experts of FFN 96, 2 a token) of random weights, every matrix in one
    type."""
    vocab = _bundled_vocab()
    folder = tmp_path_factory.mktemp("tiny-moe")
    (folder / "config.json").write_text(json.dumps(mixtral_dict(vocab)), encoding="utf-8")
    config = ModelConfig.from_hf_json(folder)
    weights = random_weights(config, seed=5)
    qtype = gguf.GGMLQuantizationType[request.param]
    path = write_tiny_gguf(folder / f"moe.{request.param}.gguf", config, weights, vocab, matrix_type=qtype,
                           tokenizer_model="gpt2",
                           extra_metadata={"llama.expert_count": E, "llama.expert_used_count": K})
    return path, config


@pytest.mark.parametrize("kernel", ["native", "i8dot"])
def test_each_expert_is_its_own_byte_range_of_the_files_tensor(tiny: tuple[Path, ModelConfig], kernel: str) -> None:
    """Every expert tensor is held once, as the file's bytes (i8dot's Q4_0 rows interleaved in place, the same
    size): expert e's blocks start e x one expert's bytes after expert 0's, and the stack's bytes are the tensor's
    in the file; the module's weight is a placeholder that holds nothing."""
    path, config = tiny
    model = load_model(str(path), weights=kernel).model
    infos = {info.name: info for info in read_gguf_header(path).tensors}
    for layer in range(config.n_layers):
        for role in EXPERT_ROLES:
            module = model.get_submodule(f"layers.{layer}.{role}")
            held = module.packed
            assert isinstance(held, ExpertWeights) and len(held) == E
            assert held.format.kernel == kernel
            assert module.weight.device.type == "meta" and tuple(module.weight.shape) == held.shape
            info = infos[ours_to_gguf(f"layers.{layer}.{role}.weight", config)]
            assert held.stored_bytes == info.n_bytes
            one = info.n_bytes // E
            (blocks,) = held[0].tensors.values()
            assert blocks.nbytes == one
            starts = [next(iter(w.tensors.values())).data_ptr() for w in held.experts]
            assert starts == [starts[0] + e * one for e in range(E)]


@torch.no_grad()
def _greedy(model: torch.nn.Module, prompt: torch.Tensor) -> tuple[list[int], torch.Tensor]:
    model.setup_cache(1, PROMPT + STEPS)
    logits = [model.prefill(prompt)[0]]
    ids = [int(logits[-1].argmax())]
    for _ in range(STEPS - 1):
        logits.append(model.decode_one(torch.tensor([[ids[-1]]]))[0])
        ids.append(int(logits[-1].argmax()))
    return ids, torch.stack(logits)


def test_exact_kernels_on_the_stored_experts_give_the_dequantized_models_logits(
        tiny: tuple[Path, ModelConfig]) -> None:
    """The native kernel (each block dequantized exactly, fp32 products) on the experts as stored: the greedy ids of
    the model dequantized to fp32 at load, and its logits within 1e-4."""
    path, config = tiny
    prompt = torch.randint(3, config.vocab_size, (1, PROMPT), generator=torch.Generator().manual_seed(8))
    want_ids, want = _greedy(load_model(str(path), weights="dense").model, prompt)
    ids, logits = _greedy(load_model(str(path), weights="native").model, prompt)
    assert ids == want_ids
    assert (logits - want).abs().max().item() < 1e-4
    assert want.abs().max().item() > 1.0


def test_a_steps_weight_bytes_are_the_tensors_it_read_in_the_file(tiny: tuple[Path, ModelConfig]) -> None:
    """Traced on the stored weights, each step's weight bytes are the file's sizes of what it read: every layer's
    attention matrices, norms and router, one expert's share of each expert tensor for every distinct expert the
    step's routing names in that layer, the final norm and the LM head, and the embedding rows looked up."""
    path, config = tiny
    model = load_model(str(path), weights="native").model
    infos = {info.name: info for info in read_gguf_header(path).tensors}
    nbytes = {name: infos[ours_to_gguf(name, config)].n_bytes for name in model.state_dict()}
    model.setup_cache(1, PROMPT + STEPS)
    generator = torch.Generator().manual_seed(2)
    routed = []
    with Tracer(model, mechanism="wrap") as tracer, torch.no_grad():
        for step in range(STEPS):
            ids = torch.randint(3, config.vocab_size, (1, PROMPT if step == 0 else 1), generator=generator)
            tracer.begin_step(PREFILL if step == 0 else DECODE, step)
            model.prefill(ids) if step == 0 else model.decode_one(ids)
            tracer.end_step()
            routed.append(routing_step(model, PREFILL if step == 0 else DECODE, step))
    records = tracer.records()
    row = nbytes["tok_embeddings.weight"] // config.vocab_size
    for step, routing in enumerate(routed):
        read = sum(r.weight_bytes_read for r in records if r.step == step)
        want = (PROMPT if step == 0 else 1) * row + nbytes["norm.weight"] + nbytes["output.weight"]
        for layer in routing.layers:
            prefix = f"layers.{layer.layer}."
            own = [n for n in nbytes if n.startswith(prefix) and not any(f".{r}." in n for r in EXPERT_ROLES)]
            one_expert = sum(nbytes[f"{prefix}{role}.weight"] for role in EXPERT_ROLES) // E
            want += sum(nbytes[n] for n in own) + layer.distinct * one_expert
        assert read == want, step
    assert max(layer.distinct for layer in routed[0].layers) > K  # the prompt's tokens spread over the experts


def test_peak_memory_is_the_files_bytes_not_the_experts_in_fp32(tmp_path: Path) -> None:
    """A two-layer mixtral-small (benchmarks/scale_models.py: dim 1024, 8 experts of FFN 2816; 111 MB as Q4_0, its
    experts 554 MB in fp32) run as `run` runs it, under the default kernels: the process's peak resident size grows by
    at most the file's bytes + the KV cache + test_memory_budget's SLACK, far below the experts in fp32."""
    sys.path.insert(0, str(REPO))
    from benchmarks.scale_models import SHAPES, write

    shape = SHAPES["mixtral-small"]
    shape = type(shape)(**{**shape.__dict__, "name": "two-layer-mixtral-small", "n_layers": 2})
    path = write(tmp_path / "two-layer-mixtral-small.Q4_0.gguf", shape, "Q4_0", say=lambda _: None)
    stored = sum(t.n_bytes for t in read_gguf_header(path).tensors)
    experts_fp32 = 2 * 3 * shape.experts * shape.ffn_dim * shape.dim * 4
    config = load_model(str(path), FP32, dry_run=True).config
    kv = kv_cache_bytes(config, 64, FP32)
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache"), "XDG_CONFIG_HOME": str(tmp_path / "config")}
    done = subprocess.run([sys.executable, "-c", CHILD, str(path), ""], capture_output=True, text=True, env=env,
                          check=False)
    assert done.returncode == 0, done.stderr
    before, peak = map(int, done.stdout.split()[-2:])
    assert peak - before <= stored + kv + SLACK
    assert stored + kv + SLACK < experts_fp32 / 2


def test_tune_and_weights_tuned_are_refused_in_one_line(tiny: tuple[Path, ModelConfig]) -> None:
    """`tune` times one layer's 2-D matrices, not a mixture of experts' 3-D stacks: refused before any measurement,
    as `run --weights tuned` is, in one line naming what to do instead (exit 2)."""
    from typer.testing import CliRunner

    from llmtrace.cli.app import app

    path, _ = tiny
    why = ("`llmtrace tune` does not measure a mixture of experts' kernels; leave --weights out (the default "
           "table's kernels) or name one (--weights stored, native, i8dot)")
    tuned = CliRunner().invoke(app, ["tune", "--model", str(path)])
    assert tuned.exit_code == 2 and tuned.stderr.strip() == f"llmtrace: error: {why}"
    run = CliRunner().invoke(app, ["run", "--model", str(path), "hi", "--weights", "tuned"])
    assert run.exit_code == 2 and run.stderr.strip().endswith(f"--weights tuned: {why}")
