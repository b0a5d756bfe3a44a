"""The size limits of the runtime package (issue 25): no module over 500 lines, no class over
300, no function over 80 (Triton kernel bodies and `tandem/testing` aside), as
`benchmarks/code_size.py` measures them."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

from tandem.testing import code_size  # noqa: E402


def test_no_module_class_or_function_is_over_its_limit():
    root = ROOT / "src" / "tandem"
    files = code_size.runtime_files(root)
    lines = {str(p.relative_to(root)): len(p.read_text(encoding="utf-8").splitlines()) for p in files}
    defs = [d for p in files for d in code_size.definitions(p, root)]
    assert code_size.violations(lines, defs) == {}


def test_the_check_sees_a_long_function(tmp_path):
    package = tmp_path / "tandem"
    package.mkdir()
    (package / "long.py").write_text("def f():\n" + "    x = 1\n" * 90, encoding="utf-8")
    files = code_size.runtime_files(package)
    lines = {str(p.relative_to(package)): len(p.read_text(encoding="utf-8").splitlines()) for p in files}
    defs = [d for p in files for d in code_size.definitions(p, package)]
    assert list(code_size.violations(lines, defs)) == ["function long.py:f"]
