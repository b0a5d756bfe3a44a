"""Code size of the runtime package (test doubles in `tandem/testing` left out): the line
counts of named files, the largest file, the longest functions, and every violation of the
size limits: a module over 400 lines, a class over 250, a function over 60 (a Triton kernel
body, a function decorated `triton.jit` or handed to `JITFunction` / `InterpretedFunction`, is
exempt, and does not count towards the function that defines it). Prints a table and writes JSON to benchmarks/results/code_size.json;
`--check` exits 1 when a limit is broken.

    python benchmarks/code_size.py [--root src/tandem] [--files models/deepseek.py ...] [--check]
    python -m tandem.testing.code_size ...   (the same)
"""

from __future__ import annotations

import argparse
import ast
import json
from pathlib import Path

TEST_DOUBLES = "testing"
#: The limits: lines per module, per class, per function.
MAX_MODULE_LINES, MAX_CLASS_LINES, MAX_FUNCTION_LINES = 400, 250, 60


def runtime_files(root: Path) -> list[Path]:
    return [p for p in sorted(root.rglob("*.py")) if p.relative_to(root).parts[0] != TEST_DOUBLES]


#: Triton's kernel wrappers: a function handed to one of these is a kernel like a decorated one
#: (a module that picks the interpreted or the compiled mode itself wraps its kernels by hand).
_KERNEL_WRAPPERS = ("JITFunction", "InterpretedFunction")


def _wrapped_kernels(tree: ast.AST) -> set[str]:
    """Names of the functions passed to a Triton kernel wrapper anywhere in the module, the
    wrapper called by its own name or by the alias an import gave it."""
    wrappers = set(_KERNEL_WRAPPERS)
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("triton"):
            wrappers.update(alias.asname or alias.name for alias in node.names if alias.name in _KERNEL_WRAPPERS)
    return {
        node.args[0].id for node in ast.walk(tree)
        if isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Name)
        and ast.unparse(node.func).split(".")[-1] in wrappers
    }


def _is_triton_kernel(node: ast.AST, wrapped: set[str] = frozenset()) -> bool:
    if getattr(node, "name", None) in wrapped and isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return True
    return any(ast.unparse(d).split("(")[0].endswith("triton.jit") for d in getattr(node, "decorator_list", []))


def _kernel_lines(node: ast.AST, wrapped: set[str]) -> int:
    """Lines of the Triton kernels defined (at any depth) inside `node`."""
    total = 0
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) and _is_triton_kernel(child, wrapped):
            total += child.end_lineno - child.lineno + 1
        else:
            total += _kernel_lines(child, wrapped)
    return total


def definitions(path: Path, root: Path) -> list[tuple[str, int, str]]:
    """`(kind, lines, "file:qualified.name")` of every class, function and method, nested ones
    included; a function's lines leave out the Triton kernels it defines, which are not listed."""
    found = []

    def walk(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                if _is_triton_kernel(child, wrapped):
                    continue
                name = f"{prefix}{child.name}"
                lines = child.end_lineno - child.lineno + 1
                kind = "class" if isinstance(child, ast.ClassDef) else "function"
                found.append((kind, lines - (_kernel_lines(child, wrapped) if kind == "function" else 0),
                              f"{path.relative_to(root)}:{name}"))
                walk(child, name + ".")
            else:
                walk(child, prefix)

    tree = ast.parse(path.read_text(encoding="utf-8"))
    wrapped = _wrapped_kernels(tree)
    walk(tree, "")
    return found


def violations(lines: dict[str, int], defs: list[tuple[str, int, str]]) -> dict[str, int]:
    """`"module|class|function name": lines` of everything over its limit, longest first."""
    limit = {"class": MAX_CLASS_LINES, "function": MAX_FUNCTION_LINES}
    over = {f"module {name}": n for name, n in lines.items() if n > MAX_MODULE_LINES}
    over.update({f"{kind} {name}": n for kind, n, name in defs if n > limit[kind]})
    return dict(sorted(over.items(), key=lambda item: -item[1]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", default=str(Path(__file__).resolve().parents[1]))
    parser.add_argument("--files", nargs="*", default=["models/deepseek.py", "models/decoder.py"])
    parser.add_argument("--top", type=int, default=3)
    parser.add_argument("--check", action="store_true", help="exit 1 when a size limit is broken")
    parser.add_argument("--out", default="benchmarks/results/code_size.json")
    args = parser.parse_args()
    root = Path(args.root)
    files = runtime_files(root)
    lines = {str(p.relative_to(root)): len(p.read_text(encoding="utf-8").splitlines()) for p in files}
    defs = [d for p in files for d in definitions(p, root)]
    longest = sorted(((n, name) for kind, n, name in defs if kind == "function"), reverse=True)[: args.top]
    largest = sorted(lines.items(), key=lambda item: -item[1])[: args.top]
    result = {
        "root": str(root),
        "runtime_lines": sum(lines.values()),
        "files": {name: lines.get(name) for name in args.files},
        "largest_files": dict(largest),
        "longest_functions": {name: n for n, name in longest},
        "limits": {"module": MAX_MODULE_LINES, "class": MAX_CLASS_LINES, "function": MAX_FUNCTION_LINES},
        "violations": violations(lines, defs),
    }
    print(f"runtime package ({root}, without tandem/{TEST_DOUBLES}): {result['runtime_lines']} lines")
    rows = (("file", result["files"]), ("largest file", result["largest_files"]),
            ("longest function", result["longest_functions"]), ("over the limit", result["violations"]))
    for title, named in rows:
        for name, n in named.items():
            print(f"  {title:<17} {name:<70} {n if n is not None else '(absent)':>6}")
    if not result["violations"]:
        print(f"  no module over {MAX_MODULE_LINES} lines, class over {MAX_CLASS_LINES}, function over {MAX_FUNCTION_LINES}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    if args.check and result["violations"]:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
