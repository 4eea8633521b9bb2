"""The house's rules, checked from the code's own imports: arrows only run down the layers, no module cycles,
and pyproject installs every package folder under the one `llmtrace` namespace."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import tomllib

ROOT = Path(__file__).resolve().parents[1]

# tracer/'s layers, lowest first (tracer/__init__.py draws the same picture). The CLI sits above them all.
LAYERS = ("core", "hardware", "checkpoint", "analytic", "roofline", "model", "load", "trace", "run")
CLI = len(LAYERS)


def _module_name(path: Path) -> str:
    parts = ["llmtrace", *path.relative_to(ROOT).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _source_files() -> list[Path]:
    return sorted([*ROOT.glob("tracer/**/*.py"), *ROOT.glob("cli/**/*.py"), ROOT / "__main__.py"])


MODULES = {_module_name(p): p for p in _source_files()}


def _imports(path: Path) -> set[str]:
    """Every llmtrace module `path` imports, at any depth of the file: lazy and TYPE_CHECKING imports count."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("llmtrace"):
            for alias in node.names:  # `from pkg import module` names a module; `from module import name` does not
                sub = f"{node.module}.{alias.name}"
                found.add(sub if sub in MODULES else node.module)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("llmtrace"))
    return found


def _layer(module: str) -> int:
    parts = module.split(".")
    if parts[1] == "cli" or module == "llmtrace.__main__":
        return CLI
    if parts[1] == "tracer" and len(parts) > 2:
        return LAYERS.index(parts[2])
    return -1  # the llmtrace.tracer package itself: a docstring, importable from anywhere


GRAPH = {name: _imports(path) for name, path in MODULES.items()}


def test_every_tracer_folder_is_a_known_layer():
    folders = {p.name for p in (ROOT / "tracer").iterdir() if (p / "__init__.py").exists()}
    assert folders == set(LAYERS)
    loose = sorted(p.name for p in (ROOT / "tracer").glob("*.py") if p.name != "__init__.py")
    assert not loose, f"modules belong in a layer's folder, not beside them: {loose}"


@pytest.mark.parametrize("module", sorted(GRAPH))
def test_imports_only_run_down(module):
    upward = sorted(t for t in GRAPH[module] if _layer(t) > _layer(module))
    assert not upward, f"{module} (layer {_layer(module)}) imports a higher layer: {upward}"


def test_no_import_cycles():
    seen: dict[str, int] = {}  # 1: on the current path, 2: done
    cycles: list[list[str]] = []

    def visit(module: str, path: list[str]) -> None:
        seen[module] = 1
        for target in sorted(GRAPH.get(module, ())):
            if seen.get(target) == 1:
                cycles.append(path[path.index(target):] + [target])
            elif target not in seen:
                visit(target, [*path, target])
        seen[module] = 2

    for module in sorted(GRAPH):
        if module not in seen:
            visit(module, [module])
    assert not cycles, f"import cycles: {cycles}"


def test_the_engine_never_imports_the_cli_or_rich():
    for module, path in MODULES.items():
        if _layer(module) < CLI:
            tree = ast.parse(path.read_text(encoding="utf-8"))
            names = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
            names |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
            assert not names & {"rich", "typer"}, module


def test_pyproject_installs_every_package_folder_under_llmtrace():
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert setuptools["package-dir"] == {"llmtrace": "."}
    folders = {_module_name(p) for p in [*ROOT.glob("tracer/**/__init__.py"), *ROOT.glob("cli/**/__init__.py")]}
    data = {"llmtrace.sample_prompts"}  # sample_prompts/: package data only (run's sample prompts)
    assert set(setuptools["packages"]) == folders | data | {"llmtrace"}


@pytest.mark.parametrize("layer", LAYERS)
def test_each_layer_says_what_it_owns_and_may_import(layer):
    doc = ast.get_docstring(ast.parse((ROOT / "tracer" / layer / "__init__.py").read_text()))
    assert doc and "May import:" in doc, f"tracer/{layer}/__init__.py must say what it owns and what it may import"
    allowed = doc.split("May import:")[1].split("\n\n")[0]
    below = LAYERS[: LAYERS.index(layer)] or ("nothing",)
    assert all(name in allowed for name in below), f"tracer/{layer}: 'May import:' must name {below}"
