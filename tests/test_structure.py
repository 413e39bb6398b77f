"""The shape of the code: import direction between the layers, the router free of the GPU
stack, and docs/structure.md naming only paths that exist.

Layers, lowest first: kernels < common < services < cli (a layer imports only its own and
lower ones). Inside common/: errors.py < parallel < model < engine < runtime < transfer.
No import cycles. Every import counts, the ones inside functions and under TYPE_CHECKING
too: a lazy import is still a dependency.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
LAYERS = ["kernels", "common", "services", "cli"]
COMMON_ORDER = ["errors", "parallel", "model", "engine", "runtime", "transfer"]
GPU_STACK = ("torch", "nixl", "numpy")


def _module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(["pdserve", *parts])


def _imports(path: Path) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import in the file, relative ones resolved."""
    tree = ast.parse(path.read_text(), str(path))
    package = _module_name(path)
    if path.name != "__init__.py":
        package = package.rpartition(".")[0]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            found.append((node.lineno, module))
    return found


def _sources(layer: str) -> list[Path]:
    return sorted((ROOT / layer).rglob("*.py"))


def _rank_in_common(module: str) -> int | None:
    """The position in COMMON_ORDER of a pdserve.common.* module (None: common itself)."""
    parts = module.split(".")
    if len(parts) < 3:
        return None
    return COMMON_ORDER.index(parts[2]) if parts[2] in COMMON_ORDER else None


def test_every_common_part_is_ordered() -> None:
    """A new sub-package of common/ (or top-level module) gets a place in the order."""
    parts = {p.stem for p in (ROOT / "common").iterdir() if p.name != "__init__.py"}
    parts = {p for p in parts if p != "__pycache__"}
    assert parts <= set(COMMON_ORDER), f"place {sorted(parts - set(COMMON_ORDER))} in COMMON_ORDER"


@pytest.mark.parametrize("layer", LAYERS)
def test_layers_import_downwards(layer: str) -> None:
    higher = LAYERS[LAYERS.index(layer) + 1 :]
    bad = []
    for path in _sources(layer):
        for line, module in _imports(path):
            top = module.split(".")
            if top[0] in ("common", "kernels", "services", "cli"):
                # bare names: `kernels` is also a Hugging Face package (ARCHITECTURE.md)
                bad.append(f"{path.relative_to(ROOT)}:{line} imports bare {module}")
            elif top[0] == "pdserve" and len(top) > 1 and top[1] in higher:
                bad.append(f"{path.relative_to(ROOT)}:{line} imports {module}")
    assert not bad, f"{layer} imports a higher layer:\n" + "\n".join(bad)


def test_common_parts_import_downwards() -> None:
    bad = []
    for path in _sources("common"):
        own = _rank_in_common(_module_name(path))
        if own is None:
            continue
        for line, module in _imports(path):
            if not module.startswith("pdserve.common."):
                continue
            other = _rank_in_common(module)
            if other is not None and other > own:
                bad.append(f"{path.relative_to(ROOT)}:{line} imports {module}")
    assert not bad, f"order {' < '.join(COMMON_ORDER)} broken:\n" + "\n".join(bad)


def _dependencies(path: Path, modules: set[str]) -> set[str]:
    """The repository modules ``path`` imports (``from a.b import c`` names a.b.c when
    that is a module), its own packages left out."""
    own = _module_name(path)
    tree = ast.parse(path.read_text(), str(path))
    names = [module for _, module in _imports(path)]
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names += [f"{node.module}.{alias.name}" for alias in node.names]
    found = set()
    for name in names:
        parts = name.split(".")
        while parts and ".".join(parts) not in modules:
            parts.pop()
        target = ".".join(parts)
        if parts and target != own and not own.startswith(target + "."):
            found.add(target)
    return found


def test_no_import_cycles() -> None:
    """No two modules import each other, even lazily or for types only: each seam has one
    owner (services/*/service.py <-> worker.py and cli/bench/bench_serve.py <-> bench_serve_hf.py
    were such cycles)."""
    paths = {_module_name(p): p for layer in LAYERS for p in _sources(layer)}
    graph = {m: _dependencies(p, set(paths)) for m, p in paths.items()}
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    cycles: list[list[str]] = []

    def visit(module: str, path: list[str]) -> None:
        state[module] = 1
        for dep in sorted(graph[module]):
            if state.get(dep) == 1:
                cycles.append([*path[path.index(dep) :], dep])
            elif dep not in state:
                visit(dep, [*path, dep])
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_router_imports_no_gpu_stack() -> None:
    """The router and the SDK start fast: no torch, NIXL or numpy, even transitively."""
    modules = [_module_name(p) for p in _sources("services/router")]
    code = (
        "import importlib, sys\n"
        f"for m in {modules!r}: importlib.import_module(m)\n"
        f"print(','.join(m for m in {GPU_STACK!r} if m in sys.modules))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "", f"importing the router loads {out.stdout.strip()}"


# -- docs/structure.md ----------------------------------------------------------------------

_PATHLIKE = re.compile(r"^[\w.*-]+(/[\w.*-]*)*$")
_SUFFIXES = (".py", ".md", ".sh", ".toml", ".json", ".service", ".target")


def _named_paths(line: str) -> list[str]:
    """Backticked names in a line that are repository paths: `dir/file.py`, `dir/`, or a
    bare `file.py` (taken in the directory of the line's first path)."""
    tokens = [t for t in re.findall(r"`([^`]+)`", line) if _PATHLIKE.match(t)]
    paths = [t for t in tokens if "/" in t or t.endswith(_SUFFIXES)]
    out, folder = [], None
    for token in paths:
        if "/" in token:
            folder = folder or (token if token.endswith("/") else token.rpartition("/")[0] + "/")
            out.append(token)
        elif folder is not None:
            out.append(folder + token)
        else:
            out.append(token)
    return out


def test_structure_doc_names_existing_paths() -> None:
    doc = ROOT / "docs" / "structure.md"
    missing = []
    for number, line in enumerate(doc.read_text().splitlines(), 1):
        for name in _named_paths(line):
            if name.startswith(("http", "pdserve:")):
                continue
            found = list(ROOT.glob(name.rstrip("/"))) if "*" in name else [ROOT / name]
            if not any(p.exists() for p in found):
                missing.append(f"docs/structure.md:{number}: {name}")
    assert not missing, "docs/structure.md names paths that do not exist:\n" + "\n".join(missing)


def test_bare_kernels_name_is_hugging_faces_where_installed() -> None:
    """transformers (>= 5.25 requires Hugging Face's ``kernels``) imports ``kernels`` by
    its bare name; with the repository root on sys.path (python -m, pytest) our folder
    answered and the import failed. Now the installed package answers, and
    ``pdserve.kernels`` stays ours."""
    import importlib.machinery

    root = Path(__file__).resolve().parents[1]
    elsewhere = [p for p in sys.path if Path(p or ".").resolve() != root]
    installed = importlib.machinery.PathFinder.find_spec("kernels", elsewhere)
    code = (
        "import kernels, pdserve.kernels as ours; print(kernels.__file__); print(ours.__file__)"
        + ("; import transformers.activations" if installed else "")
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-2000:]
    bare, ours = (Path(line) for line in out.stdout.split())
    assert ours == root / "kernels" / "__init__.py"
    if installed:
        assert bare == Path(installed.origin)
    else:
        assert bare == ours
