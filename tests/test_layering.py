"""The import graph of `src/tandem` is layered and acyclic.

Every module is parsed (ast: nothing is imported, so no side effects), every `import` is
an edge, including imports inside functions: an import deferred into a function to dodge
a cycle is still a cycle in the design (modules named in strings for `importlib`, as the
loader's family table does, are not seen). The layers are listed in one place,
`tandem.testing.layers` (harness code: nothing at run time needs them; this test and
`benchmarks/config_flow.py` read them); docs/layering.md and README's layout name the same order.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"

from tandem.testing.layers import LAYERS  # noqa: E402

#: Test doubles and harnesses (fake DeepEP / DeepGEMM, the gloo launcher, the greedy model
#: harness). They may import any layer; no runtime module may import them.
TEST_SUPPORT = "testing"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module_name(path): path for path in sorted((SRC / "tandem").rglob("*.py"))}


def _resolve(name: str, modules: dict[str, Path]) -> str | None:
    """The longest prefix of dotted `name` that is a module of the package (an imported
    function or class resolves to the module that defines it)."""
    while name:
        if name in modules:
            return name
        name = name.rpartition(".")[0]
    return None


def _imports(module: str, path: Path, modules: dict[str, Path]) -> set[str]:
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            names = [f"{base}.{alias.name}" for alias in node.names] or [base]
        else:
            continue
        for name in names:
            target = _resolve(name, modules)
            # A module always runs its parent packages first; that is not an edge it chose.
            if target is not None and target != module and not module.startswith(target + "."):
                found.add(target)
    return found


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {module: _imports(module, path, modules) for module, path in modules.items()}


def _layer(module: str) -> str:
    parts = module.split(".")
    if len(parts) == 1 or parts[1] == "__main__":
        return "api"
    return parts[1]


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for succ in sorted(graph[node]):
            if succ not in index:
                visit(succ)
                low[node] = min(low[node], low[succ])
            elif succ in on_stack:
                low[node] = min(low[node], index[succ])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return components


def test_every_module_is_in_a_known_layer():
    unknown = sorted(m for m in _graph() if _layer(m) not in LAYERS and _layer(m) != TEST_SUPPORT)
    assert not unknown, f"modules outside the layer list in tests/test_layering.py: {unknown}"


def test_no_import_cycles():
    cycles = _cycles(_graph())
    assert not cycles, "import cycles (imports inside functions count):\n" + "\n".join(" <-> ".join(c) for c in cycles)


def test_no_import_runs_up_the_layers():
    rank = {layer: i for i, layer in enumerate(LAYERS)}
    upward = [
        f"{module} ({_layer(module)}) imports {target} ({_layer(target)})"
        for module, targets in sorted(_graph().items())
        if _layer(module) != TEST_SUPPORT
        for target in sorted(targets)
        if _layer(target) != TEST_SUPPORT and rank[_layer(target)] > rank[_layer(module)]
    ]
    assert not upward, "imports from a lower layer to a higher one:\n" + "\n".join(upward)


def test_the_runtime_never_imports_test_support():
    offenders = [
        f"{module} imports {target}"
        for module, targets in sorted(_graph().items())
        if _layer(module) != TEST_SUPPORT
        for target in sorted(targets)
        if _layer(target) == TEST_SUPPORT
    ]
    assert not offenders, f"the runtime imports tandem.{TEST_SUPPORT}:\n" + "\n".join(offenders)


def test_the_checker_sees_a_cycle_and_an_upward_import():
    """The graph code itself: a planted cycle and a planted upward edge are found."""
    graph = {"tandem.a": {"tandem.b"}, "tandem.b": {"tandem.c"}, "tandem.c": {"tandem.a"}, "tandem.d": set()}
    assert _cycles(graph) == [["tandem.a", "tandem.b", "tandem.c"]]
    modules = {"tandem.contexts.dbo": Path(), "tandem.engine.core": Path()}
    assert _resolve("tandem.engine.core.Engine", modules) == "tandem.engine.core"
    assert _layer("tandem.contexts.dbo") == "contexts" and _layer("tandem") == "api"


@pytest.mark.parametrize("layer", LAYERS[:-1])
def test_each_layer_is_a_folder_or_module(layer):
    assert (SRC / "tandem" / layer).is_dir() or (SRC / "tandem" / f"{layer}.py").is_file()
