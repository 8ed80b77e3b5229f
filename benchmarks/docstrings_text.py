"""Write the docstrings of an installed package (read with `ast`, never imported) to one .txt file:
an offline evaluation text from a source other than the pydoc default.

    python benchmarks/docstrings_text.py numpy runs/text/numpy-docs.txt
"""

from __future__ import annotations

import ast
import importlib.util
import sys
from pathlib import Path


def docstrings(package: str):
    root = Path(importlib.util.find_spec(package).submodule_search_locations[0])
    for path in sorted(root.rglob("*.py")):
        if "tests" in path.relative_to(root).parts:
            continue
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, OSError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node)
                if doc and len(doc) > 200:
                    yield doc


def main() -> None:
    package, out = sys.argv[1], Path(sys.argv[2])
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n\n".join(docstrings(package)) + "\n")
    print(f"{out}: {out.stat().st_size} bytes of {package} docstrings")


if __name__ == "__main__":
    main()
