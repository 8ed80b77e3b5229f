"""The package's structure, read from its code as text: module-level imports form no cycle, the codecs and their
kernel layouts stand below the runtime (no module-level import of it, nor of CuPy: their CUDA fast paths, e.g.
`quant.quantize` on a GPU, import the kernels inside the function that launches them), and docs/layout.md's table of where each
method is names every registered method with files that exist. `python -m pytest tests/test_layout.py` is the
command that shows the structure holds; each check has a planted fault beside it."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _modules(package: str = "kvcalib") -> dict[str, Path]:
    out = {}
    for path in (ROOT / package).rglob("*.py"):
        name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
        out[name.removesuffix(".__init__")] = path
    return out


def _imports(name: str, path: Path, known: set[str]) -> set[str]:
    """What a module imports when it is imported: its module-level imports (a function's own imports and those under
    `if TYPE_CHECKING` run later or never), as modules of `known`, or any top-level name for the others."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            continue
        for n in node.body if isinstance(node, ast.Try) else [node]:
            if isinstance(n, ast.Import):
                out |= {a.name for a in n.names}
            elif isinstance(n, ast.ImportFrom):
                base = n.module or ""
                if n.level:
                    parts = package.split(".")
                    base = ".".join(parts[: len(parts) - n.level + 1] + ([n.module] if n.module else []))
                out |= {f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in n.names}
    return {m for m in out if m != name}


def _graph() -> dict[str, set[str]]:
    mods = _modules()
    return {m: _imports(m, p, set(mods)) for m, p in mods.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iteratively)."""
    index, low, on, stack, found, counter = {}, {}, set(), [], [], 0
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start] & graph.keys())))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on.add(start)
        while work:
            v, children = work[-1]
            for w in children:
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(graph[w] & graph.keys()))))
                    break
                if w in on:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    component = []
                    while True:
                        w = stack.pop()
                        on.discard(w)
                        component.append(w)
                        if w == v:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
    return found


def test_the_package_imports_without_a_cycle():
    assert _cycles(_graph()) == []


def test_the_cycle_finder_finds_a_planted_cycle():
    graph = _graph()
    graph["kvcalib.quant"] = graph["kvcalib.quant"] | {"kvcalib.methods.kivi"}  # kivi imports quant: a loop
    assert any({"kvcalib.quant", "kvcalib.methods.kivi"} <= set(c) for c in _cycles(graph))


BELOW_THE_RUNTIME = ("kvcalib.methods", "kvcalib.formats", "kvcalib.quant", "kvcalib.vq",
                     "kvcalib.attention", "kvcalib.hadamard")


def _reaches_the_runtime(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    low = [m for m in graph if m.startswith(BELOW_THE_RUNTIME)]
    return {m: {i for i in graph[m] if i.startswith(("kvcalib.runtime", "kernels_cupy", "cupy"))} for m in low}


def test_codecs_and_their_layouts_do_not_import_the_runtime_or_cupy():
    """A method's codec and the layouts import on any machine (the CPU included); the runtime reads them, never the
    other way round (at module level)."""
    assert {m: i for m, i in _reaches_the_runtime(_graph()).items() if i} == {}


def test_a_codec_importing_the_runtime_is_caught():
    graph = _graph()
    graph["kvcalib.methods.oscar"] = graph["kvcalib.methods.oscar"] | {"kvcalib.runtime.cache"}
    assert _reaches_the_runtime(graph)["kvcalib.methods.oscar"] == {"kvcalib.runtime.cache"}


def _layout_rows(text: str) -> dict[str, str]:
    table = text[text.index("| method | codec |"):].split("\n\n")[0].splitlines()[2:]
    return {re.sub(r"[`| ]", "", row.split("|")[1]): row for row in table}


def _missing(rows: dict[str, str]) -> list[str]:
    from kvcalib.methods import METHOD_NAMES

    problems = [f"{name}: no row" for name in METHOD_NAMES if name not in rows]
    for name, row in rows.items():
        for path in re.findall(r"`([\w/]+\.(?:py|cu))[`:]", row):
            where = ROOT / path if path.startswith("kernels_cupy/") else ROOT / "kvcalib" / path
            if not where.exists():
                problems.append(f"{name}: {path} does not exist")
    return problems


def test_docs_layout_names_every_method_with_files_that_exist():
    assert _missing(_layout_rows((ROOT / "docs" / "layout.md").read_text())) == []


@pytest.mark.parametrize("plant", ["a method without a row", "a file that moved"])
def test_a_stale_layout_table_is_caught(plant):
    rows = _layout_rows((ROOT / "docs" / "layout.md").read_text())
    if plant == "a method without a row":
        del rows["vecinfer"]
    else:
        rows["kivi"] = rows["kivi"].replace("methods/kivi.py", "methods/kivi_codec.py")
    assert _missing(rows)


def _declarations(method) -> dict[str, bool]:
    from kvcalib.formats.registry import FORMATS

    return {fmt.name: fmt.declaration(method, 0) is not None for fmt in FORMATS}


def test_a_format_reads_the_methods_whose_class_takes_its_declaration_class_and_no_other():
    """Each kernel family is its folder: a method's class takes the family's `coded.py` class to be read by it, and
    `Method` carries no member of any family (a new family adds none there)."""
    from kvcalib.methods import KernelLayout, MethodSettings, build_method
    from kvcalib.models import AttentionShape

    shape = AttentionShape(num_layers=1, num_heads=4, num_kv_heads=2, head_dim=64)
    family = ("int2_spec", "int2_parts", "vq_books", "vq_parts", "codebook_spec", "codebook_parts", "codebook_groups",
              "codebook_blocks")
    assert not [name for name in family if hasattr(KernelLayout, name)]
    read = {name: _declarations(build_method(name, shape, MethodSettings())) for name in ("fp16", "kivi", "turboquant")}
    assert read == {"fp16": {"INT2": False, "VecInfer": False, "codebook": False},
                    "kivi": {"INT2": True, "VecInfer": False, "codebook": True},
                    "turboquant": {"INT2": False, "VecInfer": False, "codebook": True}}


def test_a_method_naming_a_family_member_without_its_class_is_not_read():
    """Planted: fp16 given an `int2_spec` and a `codebook_groups` of its own is still read by no kernel (a format asks
    the class, not the name)."""
    from kvcalib.methods import MethodSettings, build_method
    from kvcalib.models import AttentionShape

    method = build_method("fp16", AttentionShape(num_layers=1, num_heads=4, num_kv_heads=2, head_dim=64), MethodSettings())
    method.int2_spec = lambda: object()
    method.codebook_groups = lambda layer: [object()]
    assert not any(_declarations(method).values())
