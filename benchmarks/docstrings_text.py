"""Write the docstrings of an installed third-party package to a .txt file: an evaluation text
from another source than the calibration text (pydoc), built offline.

    python benchmarks/docstrings_text.py numpy runs/numpy-docstrings.txt
"""

from __future__ import annotations

import ast
import importlib.util
import sys
from pathlib import Path


def docstrings(package: str):
    root = Path(importlib.util.find_spec(package).origin).parent
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


if __name__ == "__main__":
    package, out = sys.argv[1], Path(sys.argv[2])
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n\n".join(docstrings(package)) + "\n")
    print(f"{out}: {out.stat().st_size} bytes")
