"""`--model org/name` from the local Hugging Face cache: a fake cache laid out as huggingface_hub lays it out, checked
against huggingface_hub's own offline look-up (snapshot_download(local_files_only=True)) and cache location."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Callable

import pytest
from typer.testing import CliRunner

from llmtrace.cli.app import app
from llmtrace.tracer.checkpoint.hub_cache import HubSpec, find_cached, hub_cache_dir, parse_hub_id
from llmtrace.tracer.core.errors import ConfigError

REPO_ID = "TinyOrg/tiny-llama"
MAIN, TAGGED = "a" * 40, "b" * 40
runner = CliRunner()


@pytest.fixture(autouse=True)
def _no_hub_env(private_dirs: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HOME", "XDG_CACHE_HOME"):
        monkeypatch.delenv(name, raising=False)


def _add_snapshot(cache: Path, repo_id: str, commit: str, files: dict[str, Path | bytes], ref: str | None) -> Path:
    """Files stored as huggingface_hub stores them: content in blobs/, symlinked from snapshots/<commit>/."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (repo / "blobs").mkdir(exist_ok=True)
    for name, content in files.items():
        data = content.read_bytes() if isinstance(content, Path) else content
        blob = repo / "blobs" / f"{commit[:8]}-{name}"
        blob.write_bytes(data)
        (snapshot / name).symlink_to(os.path.relpath(blob, snapshot))
    if ref is not None:
        (repo / "refs").mkdir(exist_ok=True)
        (repo / "refs" / ref).write_text(commit)
    return snapshot


@pytest.fixture
def hf_cache(tmp_path: Path, tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A cache holding the tiny LLaMA at main, and a second commit (with 3 layers in its config) tagged v2."""
    cache = tmp_path / "hf-hub"
    files = {p.name: p for p in tiny_llama_dir.iterdir() if p.is_file()}
    _add_snapshot(cache, REPO_ID, MAIN, files, "main")
    config = json.loads((tiny_llama_dir / "config.json").read_text())
    _add_snapshot(cache, REPO_ID, TAGGED, {"config.json": json.dumps({**config, "num_hidden_layers": 3}).encode()},
                  "v2")
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    return cache


def test_parse_hub_ids() -> None:
    assert parse_hub_id("HuggingFaceTB/SmolLM2-135M-Instruct") == HubSpec("HuggingFaceTB/SmolLM2-135M-Instruct",
                                                                          None, None)
    assert parse_hub_id("org/name@v1.0") == HubSpec("org/name", "v1.0", None)
    assert parse_hub_id("org/name:model-Q4_K_M.gguf") == HubSpec("org/name", None, "model-Q4_K_M.gguf")
    assert parse_hub_id("org/name@refs/pr/1:m.gguf") == HubSpec("org/name", "refs/pr/1", "m.gguf")
    for path_or_preset in ("./org/name", "/abs/path", "~/models/x", "a/b/c", "llama-2-7b", "org/na..me", "org--x/y",
                           "models/x.gguf/extra", "org/name:notes.txt"):
        assert parse_hub_id(path_or_preset) is None, path_or_preset


@pytest.mark.parametrize("env", [
    {"HF_HUB_CACHE": "{tmp}/hub-cache"},
    {"HUGGINGFACE_HUB_CACHE": "{tmp}/legacy"},
    {"HF_HOME": "{tmp}/hf-home"},
    {"XDG_CACHE_HOME": "{tmp}/xdg"},
    {"HF_HOME": "{tmp}/hf-home", "HF_HUB_CACHE": "{tmp}/wins"},
    {},
], ids=lambda env: "+".join(env) or "default")
def test_cache_dir_is_huggingface_hubs(env: dict[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    values = {key: value.format(tmp=tmp_path) for key, value in env.items()}
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    for key, value in values.items():
        monkeypatch.setenv(key, value)
    theirs = subprocess.run([sys.executable, "-c", "import huggingface_hub.constants as c; print(c.HF_HUB_CACHE)"],
                            capture_output=True, text=True, check=True, env=os.environ.copy()).stdout.strip()
    assert hub_cache_dir() == Path(theirs)


def test_finds_the_snapshot_huggingface_hub_finds(hf_cache: Path) -> None:
    from huggingface_hub import snapshot_download

    for revision, commit in ((None, MAIN), ("main", MAIN), ("v2", TAGGED), (TAGGED, TAGGED)):
        found = find_cached(HubSpec(REPO_ID, revision, None))
        theirs = snapshot_download(REPO_ID, revision=revision, local_files_only=True, cache_dir=hf_cache)
        assert found.commit == commit and found.path == Path(theirs), revision


def test_not_cached_says_how_to_fetch(hf_cache: Path) -> None:
    with pytest.raises(ConfigError) as exc:
        find_cached(HubSpec("Other/model", None, None))
    message = str(exc.value)
    assert "\n" not in message
    assert f"Other/model: not a file or folder here, nor in the Hugging Face cache ({hf_cache})" in message
    assert "`hf download Other/model`" in message
    with pytest.raises(ConfigError, match="tiny-llama@v9: not a file.*`hf download TinyOrg/tiny-llama --revision v9`"):
        find_cached(HubSpec(REPO_ID, "v9", None))


def test_a_repo_of_several_ggufs_needs_a_file_name(hf_cache: Path) -> None:
    _add_snapshot(hf_cache, "Quants/tiny-GGUF", MAIN, {"tiny-Q4_K_M.gguf": b"GGUF", "tiny-Q8_0.gguf": b"GGUF"}, "main")
    with pytest.raises(ConfigError) as exc:
        find_cached(HubSpec("Quants/tiny-GGUF", None, None))
    assert "holds 2 GGUF files; name one as Quants/tiny-GGUF:FILE (cached: tiny-Q4_K_M.gguf, tiny-Q8_0.gguf)" in \
        str(exc.value)
    picked = find_cached(HubSpec("Quants/tiny-GGUF", None, "tiny-Q8_0.gguf"))
    assert picked.path.name == "tiny-Q8_0.gguf" and picked.path.parent.name == MAIN
    with pytest.raises(ConfigError, match="no tiny-Q2_K.gguf in the cached snapshot aaaaaaaaaaaa"):
        find_cached(HubSpec("Quants/tiny-GGUF", None, "tiny-Q2_K.gguf"))


# ---- through the commands --------------------------------------------------------------------------------------


def test_flops_names_the_model_by_its_repo_id(hf_cache: Path) -> None:
    result = runner.invoke(app, ["flops", "--model", REPO_ID, "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["model"]["name"] == REPO_ID and report["model"]["n_layers"] == 2
    tagged = json.loads(runner.invoke(app, ["kvmem", "--model", f"{REPO_ID}@v2", "--json"]).stdout)
    assert tagged["model"] == REPO_ID and tagged["size"]["n_layers"] == 3


def test_run_loads_from_the_cache(hf_cache: Path) -> None:
    result = runner.invoke(app, ["run", "capital", "--model", REPO_ID, "--max-new-tokens", "2", "--no-roofline",
                                 "--detail", "summary"])
    assert result.exit_code == 0, result.output
    assert REPO_ID in result.output and MAIN not in result.output


@pytest.mark.parametrize("command", [["flops"], ["kvmem"], ["roofline"], ["run", "capital", "--no-roofline"]])
def test_not_cached_is_one_line_exit_2(command: list[str], hf_cache: Path) -> None:
    result = runner.invoke(app, [*command, "--model", "Nobody/nothing"])
    assert result.exit_code == 2 and "Traceback" not in result.output
    errors = [line for line in result.output.splitlines() if "error" in line]
    assert len(errors) == 1 and "hf download Nobody/nothing" in errors[0], result.output
