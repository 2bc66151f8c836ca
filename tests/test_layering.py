"""The package layering and the absence of import cycles, read from every module's imports (ast).

Direction (a package may import only those to its left):

    memory  <-  replicas  <-  speculative  <-  cluster

`memory/` talks to the engine through protocols of its own (memory.kv_host); `speculative/` plugs into
the engine through the interfaces the engine owns (replicas.speculation_api) and imports only public
names of `replicas/`; `replicas/` never imports `speculative/` or `cluster/` (the engine is handed a
drafter factory by whoever builds it). Between files there is no cycle at all, also inside a package and
inside bench/ and tests/.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("memory", "replicas", "speculative", "cluster")
ALLOWED = {
    "memory": set(),
    "replicas": {"memory"},
    "speculative": {"memory", "replicas"},
    "cluster": {"memory", "replicas", "speculative"},
    "bench": {"memory", "replicas", "speculative", "cluster", "bench"},
    "grafana": {"cluster", "grafana"},
}
SCANNED = PACKAGES + ("bench", "grafana", "tests")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    found = {}
    for top in SCANNED:
        for path in sorted((REPO / top).rglob("*.py")):
            found[_module_name(path)] = path
    return found


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """Project modules `name` imports (resolved to files), with where each import stands."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    targets: set[str] = set()

    def resolve(dotted: str) -> str | None:
        while dotted:
            if dotted in modules:
                return dotted
            dotted = dotted.rpartition(".")[0]
        return None

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                hit = resolve(alias.name)
                if hit:
                    targets.add(hit)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                stem = ".".join(base + ([node.module] if node.module else []))
            else:
                stem = node.module or ""
            for alias in node.names:
                hit = resolve(f"{stem}.{alias.name}") or resolve(stem)
                if hit:
                    targets.add(hit)
    targets.discard(name)
    return targets


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def test_every_import_follows_the_package_direction(graph):
    wrong = []
    for name, targets in graph.items():
        top = name.split(".")[0]
        if top not in ALLOWED:
            continue
        for target in targets:
            other = target.split(".")[0]
            if other != top and other not in ALLOWED[top]:
                wrong.append(f"{name} -> {target}")
    assert not wrong, "imports against the layering:\n" + "\n".join(sorted(wrong))


def test_speculative_uses_only_public_names_of_replicas():
    private = []
    for path in sorted((REPO / "speculative").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("replicas"):
                private += [f"{path.relative_to(REPO)}: {node.module}.{a.name}"
                            for a in node.names if a.name.startswith("_")]
    assert not private, "\n".join(private)


def test_no_import_cycle_between_files(graph):
    """Tarjan's strongly connected components over the file graph: every component is one file."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(root: str) -> None:
        # Iterative DFS: the graph is deep enough to matter for recursion limits on some platforms.
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            advanced = False
            for child in children:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                    advanced = True
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            if advanced:
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    cycles.append(sorted(component))

    for name in sorted(graph):
        if name not in index:
            visit(name)
    assert not cycles, "import cycles:\n" + "\n".join(" <-> ".join(c) for c in cycles)
