"""kvcalib.tensorfile: shards written straight from tensor memory are safetensors' own bytes, and read back
tensor by tensor against their own hashes."""

import hashlib
import io

import pytest
import torch
from safetensors.torch import save

from kvcalib.errors import ArtifactError
from kvcalib.tensorfile import HEADER, read_header, read_into, write_tensors

MIXED = {"q": torch.randn(2, 3, 5, 4).half(), "positions": torch.arange(10).reshape(2, 5).int(),
         "a": torch.randn(3).double(), "b": torch.randn(3).bfloat16(), "c": torch.arange(3), "empty": torch.zeros(0, 4),
         "scalar": torch.tensor(2.0), "mask": torch.ones(3, dtype=torch.bool)}


def _written(tensors):
    f = io.BytesIO()
    sha, sums = write_tensors(f, tensors)
    return f.getvalue(), sha, sums


def test_written_bytes_are_safetensors_save_s_and_the_hashes_are_the_bytes():
    """Same layout (dtype order, then name), same header and padding as the library's `save`; the file's hash
    and each range's hash computed while writing are those of the bytes written."""
    raw, sha, sums = _written(MIXED)
    assert raw == save(MIXED)
    assert sha == hashlib.sha256(raw).hexdigest()
    f = io.BytesIO(raw)
    entries, start = read_header(f, "x", len(raw), sums[HEADER])
    assert sums[HEADER] == hashlib.sha256(raw[:start]).hexdigest()
    for name, (_dtype, _shape, begin, end) in entries.items():
        assert sums[name] == hashlib.sha256(raw[start + begin : start + end]).hexdigest()
    for name, t in MIXED.items():
        out = torch.empty_like(t)
        read_into(f, start, entries[name], out, "x", sums[name])
        assert torch.equal(out, t), name


def test_a_damaged_tensor_header_or_truncation_is_refused_in_one_line():
    raw, _sha, sums = _written({"k": torch.randn(4, 8).half(), "v": torch.randn(4, 8).half()})
    entries, start = read_header(io.BytesIO(raw), "x", len(raw), sums[HEADER])
    bad = bytearray(raw)
    bad[start + entries["v"][2] + 3] ^= 1
    f = io.BytesIO(bytes(bad))
    read_into(f, start, entries["k"], torch.empty(4, 8, dtype=torch.float16), "x", sums["k"])  # k is intact
    with pytest.raises(ArtifactError, match="checksum mismatch"):
        read_into(f, start, entries["v"], torch.empty(4, 8, dtype=torch.float16), "x", sums["v"])
    bad = bytearray(raw)
    bad[12] ^= 1  # inside the header's JSON
    with pytest.raises(ArtifactError, match="header"):
        read_header(io.BytesIO(bytes(bad)), "x", len(bad), sums[HEADER])
    cut = raw[: start + entries["v"][2] + 5]
    entries_cut, start_cut = read_header(io.BytesIO(raw), "x", len(raw))
    with pytest.raises(ArtifactError, match="ends inside a tensor"):
        read_into(io.BytesIO(cut), start_cut, entries_cut["v"], torch.empty(4, 8, dtype=torch.float16), "x", sums["v"])
    with pytest.raises(ArtifactError, match="header"):
        read_header(io.BytesIO(raw[:6]), "x", 6)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_the_finiteness_check_agrees_with_isfinite_on_every_16_bit_pattern(dtype):
    """`check_finite` tests exponent bits on an integer view (benchmarks/shard_io.py: 25x isfinite on float16):
    against torch.isfinite on all 65536 values, one at a time, so a wrong mask or bound shows on its value."""
    from kvcalib.tensorfile import _finite

    every = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(dtype)
    assert torch.equal(torch.isfinite(every), torch.tensor([_finite(every[i : i + 1]) for i in range(2**16)]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_the_finiteness_check_finds_one_nan_or_inf_among_finite_extremes(dtype):
    from kvcalib.tensorfile import _finite

    info = torch.finfo(dtype)
    x = torch.tensor([info.max, -info.max, info.tiny, info.tiny / 2, 0.0, -0.0, 1.0], dtype=dtype)
    assert _finite(x)
    for bad in (float("nan"), float("inf"), -float("inf")):
        y = x.clone()
        y[3] = bad
        assert not _finite(y)
        with pytest.raises(ArtifactError, match="NaN or Inf in y"):
            from kvcalib.tensorfile import check_finite

            check_finite({"y": y}, "z")


def _file(header, data: bytes = b"") -> bytes:
    text = header if isinstance(header, bytes) else __import__("json").dumps(header).encode()
    return len(text).to_bytes(8, "little") + text + data


CRAFTED = {
    "a dtype that is a list": _file({"a": {"dtype": ["F16"], "shape": [1], "data_offsets": [0, 2]}}, b"xx"),
    "a dtype that is an object": _file({"a": {"dtype": {}, "shape": [1], "data_offsets": [0, 2]}}, b"xx"),
    "an offset of 5000 digits": _file(b'{"a":{"dtype":"F16","shape":[1],"data_offsets":[0,' + b"9" * 5000 + b"]}}"),
    "JSON nested 100000 deep": _file(b"[" * 100000 + b"]" * 100000),
    "offsets that are a long string": _file({"a": {"dtype": "F16", "shape": [1], "data_offsets": "x" * 1000}}),
    "offsets that are booleans": _file({"a": {"dtype": "F16", "shape": [1], "data_offsets": [False, True]}}, b"xx"),
    "a shape of booleans": _file({"a": {"dtype": "F16", "shape": [True], "data_offsets": [0, 2]}}, b"xx"),
    "a shape that disagrees with the range": _file({"a": {"dtype": "F16", "shape": [2], "data_offsets": [0, 2]}}, b"xx"),
}


@pytest.mark.parametrize("case", CRAFTED)
def test_a_crafted_header_is_refused_as_corrupted_by_both_readers(case):
    """Untrusted headers: every malformed one is an ArtifactError (one line at the CLI), never another
    exception from the JSON parser, a type check or an allocation."""
    from kvcalib.tensorfile import read_tensors

    raw = CRAFTED[case]
    with pytest.raises(ArtifactError, match="corrupted"):
        read_header(io.BytesIO(raw), "x", len(raw))
    with pytest.raises(ArtifactError, match="corrupted"):
        read_tensors(raw, "x")
