import json

import pandas
import pytest

from kvcalib.data import documents, token_windows
from kvcalib.errors import DatasetError


def test_pydoc_calibration_and_evaluation_parts_share_no_text():
    calib_topics = set(list(documents("pydoc", "calibration"))[:60])
    evaluation = list(documents("pydoc", "evaluation"))
    assert len(evaluation) >= 15
    assert not calib_topics & set(evaluation)
    assert sum(len(d) for d in evaluation) > 50_000


def test_windows_are_contiguous_tokens_of_the_text_in_order(tokenizer, text_file):
    windows = token_windows(tokenizer, str(text_file), "evaluation", 3, 50)
    ids = tokenizer(text_file.read_text() + "\n\n", add_special_tokens=False)["input_ids"]
    assert windows.flatten().tolist() == ids[:150]


@pytest.mark.parametrize("kind", ["jsonl", "json", "parquet"])
def test_structured_files_read_the_text_field(tokenizer, tmp_path, kind):
    rows = [{"body": d, "n": i} for i, d in enumerate(list(documents("pydoc", "evaluation"))[:5])]
    path = tmp_path / f"data.{kind}"
    if kind == "jsonl":
        path.write_text("\n".join(json.dumps(r) for r in rows))
    elif kind == "json":
        path.write_text(json.dumps(rows))
    else:
        pandas.DataFrame(rows).to_parquet(path)
    assert list(documents(str(path), "evaluation", "body")) == [r["body"] for r in rows]
    with pytest.raises(DatasetError, match="no field 'text'"):
        list(documents(str(path), "evaluation"))
