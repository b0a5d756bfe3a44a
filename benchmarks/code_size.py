"""Code size of the runtime package (test doubles in `tandem/testing` left out): the line
counts of named files, the largest file and the longest functions. Prints a table and
writes JSON to benchmarks/results/code_size.json.

    python benchmarks/code_size.py [--root src/tandem] [--files models/deepseek.py ...]
"""

from __future__ import annotations

import argparse
import ast
import json
from pathlib import Path

TEST_DOUBLES = "testing"


def runtime_files(root: Path) -> list[Path]:
    return [p for p in sorted(root.rglob("*.py")) if p.relative_to(root).parts[0] != TEST_DOUBLES]


def functions(path: Path, root: Path) -> list[tuple[int, str]]:
    """`(lines, "file:qualified.name")` of every function and method, nested ones included."""
    found = []

    def walk(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = f"{prefix}{child.name}"
                if not isinstance(child, ast.ClassDef):
                    found.append((child.end_lineno - child.lineno + 1, f"{path.relative_to(root)}:{name}"))
                walk(child, name + ".")
            else:
                walk(child, prefix)

    walk(ast.parse(path.read_text(encoding="utf-8")), "")
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", default=str(Path(__file__).resolve().parents[1] / "src" / "tandem"))
    parser.add_argument("--files", nargs="*", default=["models/deepseek.py", "models/decoder.py"])
    parser.add_argument("--top", type=int, default=3)
    parser.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "code_size.json"))
    args = parser.parse_args()
    root = Path(args.root)
    files = runtime_files(root)
    lines = {str(p.relative_to(root)): len(p.read_text(encoding="utf-8").splitlines()) for p in files}
    longest = sorted((f for p in files for f in functions(p, root)), reverse=True)[: args.top]
    largest = sorted(lines.items(), key=lambda item: -item[1])[: args.top]
    result = {
        "root": str(root),
        "runtime_lines": sum(lines.values()),
        "files": {name: lines.get(name) for name in args.files},
        "largest_files": dict(largest),
        "longest_functions": {name: n for n, name in longest},
    }
    print(f"runtime package ({root}, without tandem/{TEST_DOUBLES}): {result['runtime_lines']} lines")
    for title, rows in (("file", result["files"]), ("largest file", result["largest_files"]), ("longest function", result["longest_functions"])):
        for name, n in rows.items():
            print(f"  {title:<17} {name:<60} {n if n is not None else '(absent)':>6}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
