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
