"""No test imports another test module (or a conftest): what tests share lives in
`tests/support/`, so running, moving or deleting one test file never breaks another."""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parent


def _is_test_module(dotted: str) -> bool:
    last = dotted.rpartition(".")[2]
    return last.startswith("test_") or last == "conftest"


def imported_test_modules(path: Path) -> list[str]:
    """The test modules `path` imports, relative imports resolved against its package."""
    package = ".".join(path.relative_to(TESTS.parent).with_suffix("").parts[:-1])
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            found += [alias.name for alias in node.names if _is_test_module(alias.name)]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            # `from tests.x import test_y` imports a module too.
            candidates = [base] + [f"{base}.{alias.name}" for alias in node.names]
            found += [name for name in candidates if _is_test_module(name)]
    return found


def test_the_rule_sees_absolute_relative_and_submodule_imports(monkeypatch):
    sample = TESTS / "serving" / "_probe.py"
    source = ("from tests.serving.test_app import FakeEngine\nfrom . import test_faults\n"
              "import tests.engine.test_engine\nfrom .conftest import X\nfrom tests.support.live_app import LiveServer\n")
    monkeypatch.setattr(Path, "read_text", lambda self, encoding=None: source)
    assert imported_test_modules(sample) == ["tests.serving.test_app", "tests.serving.test_faults",
                                             "tests.engine.test_engine", "tests.serving.conftest"]


def test_no_test_imports_another_test_module():
    offenders = {str(path.relative_to(TESTS.parent)): names
                 for path in sorted(TESTS.rglob("*.py")) if (names := imported_test_modules(path))}
    assert offenders == {}, f"move the shared helpers to tests/support/: {offenders}"


BENCHMARKS = TESTS.parent / "benchmarks"


def _top_level_imports(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            names |= {alias.name.partition(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            names.add(node.module.partition(".")[0])
    return names


def _changes_sys_path(path: Path) -> bool:
    return any(isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute)
               and ast.unparse(node.value) == "sys.path" and node.attr in ("insert", "append", "extend")
               for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))))


def test_harness_code_has_one_import_direction():
    """Tests and benchmarks share harness code through `tandem.testing` only: no benchmark
    imports `tests`, no test imports a benchmark script or puts `benchmarks/` on sys.path (a
    test may still run a benchmark as a subprocess)."""
    scripts = {path.stem for path in BENCHMARKS.glob("*.py")} | {"benchmarks"}
    from_benchmarks = sorted(p.name for p in BENCHMARKS.glob("*.py") if "tests" in _top_level_imports(p))
    from_tests = sorted(str(p.relative_to(TESTS.parent)) for p in TESTS.rglob("*.py")
                        if p.name != Path(__file__).name and (_top_level_imports(p) & scripts or _changes_sys_path(p)))
    assert from_benchmarks == [], f"benchmarks importing tests (move the helper to tandem.testing): {from_benchmarks}"
    assert from_tests == [], f"tests importing benchmarks (move the helper to tandem.testing): {from_tests}"
