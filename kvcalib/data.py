"""Text sources and token windows.

A dataset spec is one of:
- `pydoc` (the default): Python's own documentation, which every Python ships. The topics of
  `pydoc_data.topics`, sorted by name, are split by a fixed rule: every fourth topic (index % 4 == 3)
  is the evaluation part, the rest the calibration part. The calibration part continues with the
  docstrings of the standard library's modules (read with `ast`, never imported), file by file in
  sorted order, so it holds well over 256 x 512 tokens. The two parts share no text.
- a local `.txt` file (read as one document), or `.json`/`.jsonl` or `.parquet` (loaded through
  `datasets`); the whole file serves both parts (give different files for calibration and evaluation);
- `name[:config]` on the Hugging Face hub (online): the `train` split for calibration, the `test`
  split (else `validation`) for evaluation.

Windows: documents are tokenized in order (without special tokens), joined by a blank line, and
cut into contiguous, non-overlapping windows of `seq_len` tokens from the start, so two tools given
the same source and lengths score the same tokens.
"""

from __future__ import annotations

import ast
import logging
import sysconfig
from collections.abc import Iterator
from pathlib import Path
from typing import Literal

import torch

from .errors import DatasetError

log = logging.getLogger(__name__)

DEFAULT_DATASET = "pydoc"
Part = Literal["calibration", "evaluation"]
_LOCAL_BUILDERS = {".txt": "text", ".json": "json", ".jsonl": "json", ".parquet": "parquet"}
_SEPARATOR = "\n\n"


def _pydoc_topics(part: Part) -> Iterator[str]:
    from pydoc_data.topics import topics

    for i, name in enumerate(sorted(topics)):
        if (i % 4 == 3) == (part == "evaluation"):
            yield topics[name]


def _stdlib_docstrings() -> Iterator[str]:
    skip = {"test", "idlelib", "site-packages", "lib2to3", "tkinter", "turtledemo"}
    return source_docstrings(Path(sysconfig.get_paths()["stdlib"]), skip)


def source_docstrings(root: Path, skip: set[str]) -> Iterator[str]:
    """Docstrings over 200 characters of the .py files under root (read with `ast`, never imported),
    file by file in sorted order, skipping files under a folder named in `skip`."""
    for path in sorted(root.rglob("*.py")):
        if skip & set(path.relative_to(root).parts):
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


def _pydoc(part: Part) -> Iterator[str]:
    yield from _pydoc_topics(part)
    if part == "calibration":
        yield from _stdlib_docstrings()


def _check_utf8(path: Path, spec: str) -> None:
    """datasets reports a file that is not text as "an error occurred while generating the dataset"."""
    try:
        with open(path, encoding="utf-8") as f:
            while f.read(1 << 20):
                pass
    except UnicodeDecodeError as err:
        raise DatasetError(f"dataset {spec} is not UTF-8 text (byte {err.start} cannot be decoded); give a text "
                           "file, or .jsonl/.parquet with --text-field") from None


def _datasets_rows(spec: str, text_field: str, part: Part) -> Iterator[str]:
    path = Path(spec).expanduser()
    local = path.suffix in _LOCAL_BUILDERS or path.exists()
    if local:
        if not path.is_file():
            raise DatasetError(f"dataset file {spec} does not exist")
        builder = _LOCAL_BUILDERS.get(path.suffix)
        if builder is None:
            raise DatasetError(f"dataset file {spec}: unsupported type; use .txt, .json, .jsonl or .parquet")
        if path.stat().st_size == 0:
            raise DatasetError(f"dataset {spec} ({part} part) holds no text")
        if builder == "text":
            _check_utf8(path, spec)
            # The file as one document, read without `datasets`, as its text builder's lines joined
            # by newlines gave it: universal newlines, less one final newline.
            yield path.read_text(encoding="utf-8").removesuffix("\n")
            return
    import datasets

    datasets.logging.set_verbosity_error()
    datasets.disable_progress_bars()
    if local:
        try:
            ds = datasets.load_dataset(builder, data_files=str(path), split="train")
        except Exception as err:  # datasets wraps parse errors in many types
            raise DatasetError(f"could not read dataset {spec}: {str(err).splitlines()[0]}") from err
    else:
        name, _, config = spec.partition(":")
        splits = ["train"] if part == "calibration" else ["test", "validation"]
        ds, errors = None, []
        for split in splits:
            try:
                ds = datasets.load_dataset(name, config or None, split=split)
                break
            except Exception as err:
                errors.append(err)
        if ds is None:
            raise DatasetError(
                f"could not load dataset {spec!r} (split {'/'.join(splits)}) from the Hugging Face hub: "
                f"{str(errors[-1]).splitlines()[0] if str(errors[-1]) else type(errors[-1]).__name__}"
            )
    if text_field not in ds.column_names:
        raise DatasetError(f"dataset {spec} has no field {text_field!r} (fields: {', '.join(ds.column_names)}); pass --text-field")
    for row in ds[text_field]:
        if isinstance(row, str) and row.strip():
            yield row


def documents(spec: str = DEFAULT_DATASET, part: Part = "calibration", text_field: str = "text") -> Iterator[str]:
    """The documents of a text source, in their fixed order."""
    if spec == DEFAULT_DATASET:
        return _pydoc(part)
    return _datasets_rows(spec, text_field, part)


def token_windows(tokenizer, spec: str, part: Part, num_samples: int, seq_len: int,
                  text_field: str = "text") -> torch.Tensor:
    """`num_samples` contiguous windows of `seq_len` tokens, as a (num_samples, seq_len) LongTensor."""
    if num_samples < 1 or seq_len < 1:
        raise DatasetError("--num-samples and --seq-len must be positive")
    need = num_samples * seq_len
    ids: list[int] = []
    batch: list[str] = []

    def flush() -> None:
        for enc in tokenizer([d + _SEPARATOR for d in batch], add_special_tokens=False)["input_ids"]:
            ids.extend(enc)
        batch.clear()

    for doc in documents(spec, part, text_field):
        batch.append(doc)
        if len(batch) == 64:
            flush()
            if len(ids) >= need:
                break
    if batch:
        flush()
    if not ids:
        raise DatasetError(f"dataset {spec} ({part} part) holds no text")
    if len(ids) < need:
        raise DatasetError(
            f"dataset {spec} ({part} part) has {len(ids)} tokens, fewer than --num-samples {num_samples} x "
            f"--seq-len {seq_len} = {need}; lower one of them"
        )
    return torch.tensor(ids[:need], dtype=torch.long).reshape(num_samples, seq_len)


def describe(spec: str, part: Part, text_field: str) -> dict:
    return {"dataset": spec, "part": part, "text_field": text_field}
