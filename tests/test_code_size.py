"""The size limits of the runtime package (issues 25 and 33): no module over 400 lines, no
class over 250, no function over 60 (Triton kernel bodies and `tandem/testing` aside), as
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
    (package / "long.py").write_text("def f():\n" + "    x = 1\n" * 61, encoding="utf-8")
    files = code_size.runtime_files(package)
    lines = {str(p.relative_to(package)): len(p.read_text(encoding="utf-8").splitlines()) for p in files}
    defs = [d for p in files for d in code_size.definitions(p, package)]
    assert list(code_size.violations(lines, defs)) == ["function long.py:f"]


def test_a_kernel_wrapped_by_hand_is_exempt_like_a_decorated_one(tmp_path):
    """A module that picks Triton's interpreted or compiled mode itself hands its kernel to
    `JITFunction` / `InterpretedFunction` (here under an alias) instead of decorating it."""
    package = tmp_path / "tandem"
    package.mkdir()
    body = "    x = 1\n" * 70
    (package / "kernels.py").write_text(
        f"def kernel(x_ptr):\n{body}\n\ndef plain():\n{body}\n\n"
        "def pick(interpret):\n"
        "    if interpret:\n        from triton.runtime.interpreter import InterpretedFunction as wrap\n"
        "    else:\n        from triton.runtime.jit import JITFunction as wrap\n"
        "    return wrap(kernel)\n", encoding="utf-8")
    defs = code_size.definitions(package / "kernels.py", package)
    assert [name for _, _, name in defs] == ["kernels.py:plain", "kernels.py:pick"]
