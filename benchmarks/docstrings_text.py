"""Write the docstrings of an installed package (read with `ast`, never imported) to one .txt file:
an offline evaluation text from a source other than the pydoc default.

    python benchmarks/docstrings_text.py numpy runs/text/numpy-docs.txt
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

from kvcalib.data import source_docstrings


def main() -> None:
    package, out = sys.argv[1], Path(sys.argv[2])
    out.parent.mkdir(parents=True, exist_ok=True)
    root = Path(importlib.util.find_spec(package).submodule_search_locations[0])
    out.write_text("\n\n".join(source_docstrings(root, {"tests"})) + "\n")
    print(f"{out}: {out.stat().st_size} bytes of {package} docstrings")


if __name__ == "__main__":
    main()
