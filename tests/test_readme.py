"""The README's results table says only what benchmarks/RESULTS.md says: each row names a RESULTS section
that exists, and every figure of the row (each number with a decimal point or of three digits and more, and
durations such as "8 min 5 s") appears in that section's text. A figure retyped wrong, or left behind when
a table is rerun, fails here; so does a doc pointing at a RESULTS section that moved to history."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FIGURE = re.compile(r"\d+ min \d+ s|\d+\.\d+|\b\d{3,}\b")


def _rows() -> list[list[str]]:
    text = (ROOT / "README.md").read_text()
    table = text[text.index("| what | kvcalib | against | RESULTS section |"):].split("\n\n")[0].splitlines()[2:]
    return [[c.strip() for c in line.strip("|").split("|")] for line in table]


def _sections() -> dict[str, str]:
    """Each heading of RESULTS.md (its title without the date) with its text up to the next heading of its level
    or above: a `##` section holds its `###` tables."""
    text = (ROOT / "benchmarks" / "RESULTS.md").read_text()
    heads = list(re.finditer(r"^(#{2,3}) (.+)$", text, re.M))
    out = {}
    for i, h in enumerate(heads):
        end = next((n.start() for n in heads[i + 1:] if len(n.group(1)) <= len(h.group(1))), len(text))
        out[re.sub(r" \(\d{4}-\d{2}-\d{2}\)$", "", h.group(2))] = text[h.start():end]
    return out


def test_the_readme_has_a_results_table_of_six_to_ten_rows():
    assert 6 <= len(_rows()) <= 10


def _check(row: list[str], sections: dict[str, str]) -> None:
    what, ours, theirs, section = row
    found = [text for title, text in sections.items() if title.startswith(section)]
    assert found, f"no RESULTS.md section starts with {section!r}"
    body = "\n".join(found)
    figures = FIGURE.findall(f"{ours} {theirs}")
    assert figures, row
    for figure in figures:
        assert figure in body, f"{figure} ({what}) is not in RESULTS.md's section {section!r}"


@pytest.mark.parametrize("row", _rows(), ids=lambda r: r[0][:40])
def test_every_readme_figure_is_the_one_in_its_results_section(row):
    _check(row, _sections())


def test_a_figure_one_digit_off_or_a_missing_section_fails():
    """The check on planted errors: the first row's first figure with its last digit changed, and a section
    name that RESULTS.md does not have."""
    row, sections = _rows()[0], _sections()
    figure = FIGURE.findall(row[1])[0]
    off = figure[:-1] + str((int(figure[-1]) + 1) % 10)
    with pytest.raises(AssertionError, match="is not in"):
        _check([row[0], row[1].replace(figure, off), row[2], row[3]], sections)
    with pytest.raises(AssertionError, match="no RESULTS.md section"):
        _check(row[:3] + ["A section nobody wrote"], sections)


# A doc's pointer into the results: `RESULTS.md, "Title"` (a line break inside the title reads as a space).
POINTER = re.compile(r'RESULTS\.md, "([^"]+)"')


def _pointers(text: str) -> list[str]:
    return [" ".join(m.group(1).split()) for m in POINTER.finditer(text)]


def _dangling(text: str, sections: dict[str, str]) -> list[str]:
    """The pointers of `text` that no RESULTS.md heading starts with (a table moved to history, or renamed)."""
    return [p for p in _pointers(text) if not any(title.startswith(p) for title in sections)]


@pytest.mark.parametrize("doc", ["README.md", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md"))])
def test_the_docs_point_only_at_results_sections_that_exist(doc):
    """Where a doc says `RESULTS.md, "Title"`, RESULTS.md has a section of that title: one moved to history is
    pointed at in its history file instead. Planted: a pointer at a section nobody wrote is dangling."""
    sections = _sections()
    assert _dangling((ROOT / doc).read_text(), sections) == []
    assert _dangling('see benchmarks/RESULTS.md, "A section\nnobody wrote"', sections) == ["A section nobody wrote"]
