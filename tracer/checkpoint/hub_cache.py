"""A Hugging Face Hub id (`org/name`, `org/name@revision`, `org/name:file.gguf`) -> its files in the local cache.

Offline and read-only: llmtrace never downloads. The cache is the one `huggingface_hub` and transformers fill, laid
out as huggingface_hub documents it (https://huggingface.co/docs/huggingface_hub/guides/manage-cache):

    <cache>/models--<org>--<name>/refs/<branch or tag>     the commit hash the name points at
    <cache>/models--<org>--<name>/snapshots/<commit>/...   the files of that commit (links into blobs/)

<cache> is $HF_HUB_CACHE, else $HUGGINGFACE_HUB_CACHE, else $HF_HOME/hub, else $XDG_CACHE_HOME/huggingface/hub,
else ~/.cache/huggingface/hub: huggingface_hub.constants' order (the tests hold it to that module). This reads
the layout itself rather than calling huggingface_hub.snapshot_download(local_files_only=True): importing that
costs over a second (it pulls in the HTTP stack), and the analytical commands must answer in a blink; nor is
huggingface_hub a dependency of llmtrace.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from llmtrace.tracer.core.errors import ConfigError

# org/name, optionally @revision, optionally :file.gguf (huggingface_hub's repo id rules: ASCII letters, digits,
# '-', '_', '.'). A leading '.', '/' or '~' is a path, never an id.
_HUB_ID = re.compile(r"^(?P<repo>[A-Za-z0-9][\w.-]{0,95}/[A-Za-z0-9][\w.-]{0,95})"
                     r"(?:@(?P<revision>[\w./-]+?))?(?::(?P<filename>[^/\\:]+\.gguf))?$", re.ASCII)
_COMMIT = re.compile(r"^[0-9a-f]{40}$")
_FETCH = "hf download"  # huggingface_hub's CLI (`huggingface-cli download` in older releases)


@dataclass(frozen=True, slots=True)
class HubSpec:
    repo_id: str  # "HuggingFaceTB/SmolLM2-135M-Instruct"
    revision: str | None  # a branch, tag or commit; None means "main"
    filename: str | None  # one .gguf file of the repo, when it holds several

    def __str__(self) -> str:
        return self.repo_id + (f"@{self.revision}" if self.revision else "") + (f":{self.filename}" if self.filename else "")

    @property
    def fetch_command(self) -> str:
        revision = f" --revision {self.revision}" if self.revision else ""
        filename = f" {self.filename}" if self.filename else ""
        return f"{_FETCH} {self.repo_id}{filename}{revision}"


@dataclass(frozen=True, slots=True)
class CachedModel:
    """A Hub id found in the cache: the snapshot folder, or the one .gguf file in it that the id names."""

    spec: HubSpec
    commit: str
    path: Path  # the snapshot folder (config.json there) or a .gguf file inside it

    @property
    def name(self) -> str:
        """What the model is called: its repo id (and the file, for one GGUF of a repo), never the commit hash."""
        return self.spec.repo_id + (f":{self.path.name}" if self.path.suffix == ".gguf" else "")

    @property
    def description(self) -> str:
        return f"{self.name} (Hugging Face cache, commit {self.commit[:12]})"


def parse_hub_id(spec: str) -> HubSpec | None:
    """The Hub id `spec` spells, or None when it cannot be one (then it is a path or a preset name)."""
    match = _HUB_ID.match(spec.strip())
    if match is None or ".." in match["repo"] or "--" in match["repo"]:
        return None
    return HubSpec(match["repo"], match["revision"], match["filename"])


def cached_model_for(spec: str) -> CachedModel | None:
    """What `spec` names in the Hugging Face cache when it spells a Hub id and is not a path on disk; None when it
    is a path or cannot be an id. Not cached: the one-line ConfigError of find_cached."""
    if Path(spec).expanduser().exists():
        return None
    hub = parse_hub_id(spec)
    return find_cached(hub) if hub is not None else None


def hub_cache_dir() -> Path:
    """Where huggingface_hub keeps downloaded repos, from the same environment variables, in the same order."""
    home = os.environ.get("HF_HOME", os.path.join(os.environ.get("XDG_CACHE_HOME", os.path.join("~", ".cache")),
                                                  "huggingface"))
    default = os.path.join(os.path.expandvars(os.path.expanduser(home)), "hub")
    cache = os.environ.get("HF_HUB_CACHE", os.environ.get("HUGGINGFACE_HUB_CACHE", default))
    return Path(os.path.expandvars(os.path.expanduser(cache)))


def find_cached(spec: HubSpec) -> CachedModel:
    """The cached snapshot of `spec` (its .gguf file when the id names one or the snapshot holds exactly one GGUF
    and no config.json); a one-line ConfigError saying how to fetch it when it is not cached."""
    cache = hub_cache_dir()
    repo = cache / ("models--" + spec.repo_id.replace("/", "--"))
    revision = spec.revision or "main"
    commit = _read_ref(repo / "refs" / revision) if (repo / "refs").is_dir() else None
    if commit is None and _COMMIT.match(revision):
        commit = revision
    snapshot = repo / "snapshots" / commit if commit else None
    if snapshot is None or not snapshot.is_dir():
        raise ConfigError(
            f"{spec}: not a file or folder here, nor in the Hugging Face cache ({cache}); fetch it with "
            f"`{spec.fetch_command}` (llmtrace never downloads) or check the path"
        )
    return CachedModel(spec, commit, _pick_file(spec, snapshot))


def _read_ref(ref: Path) -> str | None:
    try:
        commit = ref.read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError):
        return None
    return commit if _COMMIT.match(commit) else None


def _pick_file(spec: HubSpec, snapshot: Path) -> Path:
    ggufs = sorted(p.name for p in snapshot.glob("*.gguf"))
    if spec.filename is not None:
        if (snapshot / spec.filename).is_file():
            return snapshot / spec.filename
        held = f"it holds {_listing(ggufs)}" if ggufs else "it holds no .gguf file"
        raise ConfigError(f"{spec.repo_id}: no {spec.filename} in the cached snapshot {snapshot.name[:12]} ({held}); "
                          f"fetch it with `{spec.fetch_command}`")
    if (snapshot / "config.json").is_file() or not ggufs:
        return snapshot  # an HF model folder (the config reader names what is missing, if anything)
    if len(ggufs) == 1:
        return snapshot / ggufs[0]
    raise ConfigError(f"{spec.repo_id} holds {len(ggufs)} GGUF files; name one as {spec.repo_id}:FILE "
                      f"(cached: {_listing(ggufs)})")


def _listing(names: list[str], limit: int = 6) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")
