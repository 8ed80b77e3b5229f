import json

import pytest
import torch
from safetensors.torch import load_file
from transformers import DynamicCache

from kvcalib.collect import Activations, collect, shard_name
from kvcalib.data import token_windows
from kvcalib.errors import ArtifactError, SettingsError
from tolerances import U16


@pytest.fixture
def run(tmp_path, tiny_lm, text_file):
    def go(out="acts", **kwargs):
        args = dict(model=tiny_lm, dataset=str(text_file), num_samples=5, seq_len=32, chunk_size=2)
        args.update(kwargs)
        return collect(tmp_path / out, **args)

    return go


def _assert_collected_as_cached(acts: Activations, tiny_lm, text_file, sample: int, window: int) -> None:
    """The collected keys and values of `sample` against the DynamicCache of a forward over `window`.

    Both are float16 roundings of float32 keys and values; collect's pass attends through kvcalib's
    attention, this one through eager attention, so from the second layer on the float32 values may
    differ by round-off (~1e-6 relative, three orders below float16's spacing of 2^-10 relative). Their
    float16 roundings are then equal or, for a value that close to a rounding midpoint, adjacent:
    at most one float16 spacing apart, <= 2 u16 |x| (2^-24 below 2^-14, where float16 is subnormal).
    """
    windows = token_windows(tiny_lm.tokenizer, str(text_file), "calibration", 5, 32)
    cache = DynamicCache(config=tiny_lm.model.config)
    with torch.no_grad():
        tiny_lm.model(windows[window : window + 1], past_key_values=cache, use_cache=True)
    for layer in range(tiny_lm.config.num_hidden_layers):
        data = acts.layer(layer)
        for got, want in ((data["k"][sample], cache.layers[layer].keys[0]), (data["v"][sample], cache.layers[layer].values[0])):
            torch.testing.assert_close(got.float(), want.half().float(), rtol=2 * U16, atol=2.0**-24)


def test_collect_saves_exactly_the_cached_keys_values_per_layer(run, tiny_lm, text_file):
    out = run()
    acts = Activations(out)
    for layer in range(tiny_lm.config.num_hidden_layers):
        data = acts.layer(layer)
        assert data["q"].shape == (5, 4, 32, 16)
        assert data["k"].shape == data["v"].shape == (5, 2, 32, 16)
        assert data["k"].dtype == torch.float16
    _assert_collected_as_cached(acts, tiny_lm, text_file, sample=3, window=3)
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["tokens_per_layer"] == 160
    assert manifest["model_fingerprint"]["num_kv_heads"] == 2


def test_the_comparison_catches_activations_of_the_neighbouring_sample(run, tiny_lm, text_file):
    acts = Activations(run())  # as a chunk offset off by one would store them
    for sample in (2, 4):
        with pytest.raises(AssertionError):
            _assert_collected_as_cached(acts, tiny_lm, text_file, sample=sample, window=3)


def test_rerun_skips_finished_shards_and_rewrites_missing_ones(run):
    out = run()
    mtimes = {p.name: p.stat().st_mtime_ns for p in out.glob("*.safetensors")}
    (out / shard_name(1, 2)).unlink()
    (out / ".tmp-deadbeef-layer001-chunk0002.safetensors").write_bytes(b"half a shard")
    run()
    for name, mtime in mtimes.items():
        if name != shard_name(1, 2):
            assert (out / name).stat().st_mtime_ns == mtime
    assert (out / shard_name(1, 2)).exists()
    assert not list(out.glob(".tmp-*"))
    Activations(out).layer(1)


def test_rerun_with_other_settings_into_the_same_directory_is_refused(run):
    run()
    with pytest.raises(SettingsError, match="other settings"):
        run(seq_len=16)


def test_max_tokens_keeps_the_same_seeded_positions_in_every_layer(run):
    a = Activations(run("a", max_tokens=40, seed=3))
    b = Activations(run("b", max_tokens=40, seed=3))
    c = Activations(run("c", max_tokens=40, seed=4))
    pa = a.layer(0)["positions"]
    assert pa.shape == (5, 8)
    assert torch.equal(pa, a.layer(1)["positions"])
    assert torch.equal(pa, b.layer(0)["positions"])
    assert not torch.equal(pa, c.layer(0)["positions"])
    assert (pa.diff(dim=1) > 0).all()
    full = Activations(run("full")).layer(0)
    assert torch.equal(a.layer(0)["k"][2], full["k"][2][:, pa[2].long()])
    assert not a.full_sequences


def test_corrupted_or_unfinished_collections_are_refused(run, tmp_path):
    out = run()
    path = out / shard_name(0, 1)
    data = bytearray(path.read_bytes())
    data[-5] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(ArtifactError, match="corrupted"):
        Activations(out).layer(0)
    with pytest.raises(ArtifactError, match="not a finished"):
        Activations(tmp_path)
    assert load_file(str(out / shard_name(1, 0)))["k"].shape[0] == 2


@pytest.mark.parametrize("damage", ["flipped byte", "truncated", "truncated before the manifest"])
def test_rerun_records_a_damaged_shard_anew(run, damage):
    """A shard damaged after it was written (the message of `Activations` says to re-run collect):
    checked against the finished run's manifest, or parsed when the run never finished."""
    out = run()
    path = out / shard_name(1, 1)
    good = path.read_bytes()
    if damage == "flipped byte":
        path.write_bytes(good[:-5] + bytes([good[-5] ^ 0xFF]) + good[-4:])
    else:
        path.write_bytes(good[: len(good) // 2])
    if damage == "truncated before the manifest":
        (out / "manifest.json").unlink()
    run()
    assert path.read_bytes() == good
    Activations(out).layer(1)


def test_chunks_are_sized_to_a_host_memory_bound_and_recorded_resolved(run, tmp_path):
    """A chunk of every layer's Q, K, V in float16 is held in host memory before it is written: at most
    1 GiB of them, or one sample where a sample is larger, whatever the number of samples."""
    from kvcalib.collect import HOST_CHUNK_BYTES, chunk_samples
    from kvcalib.models import AttentionShape

    smollm, llama8b, llama70b = AttentionShape(30, 9, 3, 64), AttentionShape(32, 32, 8, 128), AttentionShape(80, 64, 8, 128)
    assert chunk_samples(smollm, 512) == 8  # 29.5 MB a sample: the old fixed 8
    assert chunk_samples(llama8b, 2048) == 1 and chunk_samples(llama70b, 2048) == 1  # 805 MB, 3.4 GB a sample
    assert chunk_samples(llama8b, 512) == 5  # 201 MB a sample: five within 1 GiB
    per_sample = 32 * 48 * 512 * 128 * 2
    assert 5 * per_sample <= HOST_CHUNK_BYTES < 6 * per_sample
    path = run("auto", chunk_size=None)
    settings = json.loads((path / "plan.json").read_text())["settings"]
    assert settings["chunk_size"] == 8  # the tiny model's samples are small: the cap


def test_a_layer_read_by_name_onto_a_device_equals_the_whole_layer(run, monkeypatch):
    """`layer(i, names, device)` fills its result shard by shard: the same values as a plain concatenation
    of the shards (3 chunks here, of 2, 2 and 1 samples), only the names asked for; and no more shards are
    held at once than the READERS in flight."""
    out = run()
    acts = Activations(out)
    shards = [load_file(str(out / shard_name(1, c))) for c in range(3)]
    whole = {key: torch.cat([s[key] for s in shards]) for key in shards[0]}
    got = acts.layer(1)
    assert got.keys() == whole.keys() and all(torch.equal(got[k], whole[k]) for k in whole)
    some = acts.layer(1, ("k", "positions"), device="cpu")
    assert some.keys() == {"k", "positions"} and torch.equal(some["k"], whole["k"])
    import weakref

    import kvcalib.collect as module

    alive, most = [], [0]
    real = module.Activations._read_shard

    def counted(self, *args):  # every shard read so far whose tensors are still referenced
        part = real(self, *args)
        alive[:] = [r for r in alive if r() is not None] + [weakref.ref(part["k"])]
        most[0] = max(most[0], len(alive))
        return part

    monkeypatch.setattr(module.Activations, "_read_shard", counted)
    acts.layer(1, device="meta")  # a result off the CPU: each shard is read into a buffer of its own
    assert 1 <= most[0] <= module.READERS
    monkeypatch.setattr(module, "READERS", 1)  # one in flight: never two shards' buffers at once
    alive.clear()
    most[0] = 0
    again = acts.layer(1)
    assert most[0] == 1 and all(torch.equal(again[k], whole[k]) for k in whole)


def test_a_layer_whose_shards_disagree_with_the_manifest_is_refused(run):
    out = run()
    manifest = json.loads((out / "manifest.json").read_text())
    manifest["settings"]["num_samples"] = 4  # the shards hold 5
    (out / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ArtifactError, match="more samples than its manifest"):
        Activations(out).layer(0)
    manifest["settings"]["num_samples"] = 6
    (out / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ArtifactError, match="its manifest says 6"):
        Activations(out).layer(0)


def test_a_layer_s_first_samples_read_only_the_shards_that_hold_them(run, monkeypatch):
    """`layer(i, samples=N)` (diagnose --max-samples): the first N samples, as the whole layer's first N,
    and only the shards holding them are read (3 of 2 samples each hold 5; N = 3 reads the first two)."""
    import kvcalib.collect as module

    acts = Activations(run())
    whole = acts.layer(1)
    read = []
    real = module.Activations._read_shard
    monkeypatch.setattr(module.Activations, "_read_shard", lambda self, path, *a: read.append(path) or real(self, path, *a))
    for n, shards in ((1, 1), (3, 2), (4, 2), (5, 3), (9, 3)):
        read.clear()
        got = acts.layer(1, samples=n)
        assert len(read) == shards, (n, read)
        assert all(torch.equal(got[k], whole[k][:n]) for k in whole), n


def test_layers_read_ahead_yield_each_layer_as_layer_does_and_raise_a_damaged_one_when_reached(run):
    """`layers` reads the next layer on a thread while the caller works: the same tensors as `layer`, in the
    order asked; a damaged shard of a later layer surfaces only when that layer is reached (the layers
    before it are yielded intact), with `layer`'s error."""
    out = run()
    acts = Activations(out)
    got = list(acts.layers([1, 0], ("k",)))
    assert [i for i, _ in got] == [1, 0]
    for i, data in got:
        assert data.keys() == {"k"} and torch.equal(data["k"], acts.layer(i)["k"])
    path = out / shard_name(1, 2)
    raw = bytearray(path.read_bytes())
    raw[-3] ^= 0xFF
    path.write_bytes(bytes(raw))
    seen = []
    with pytest.raises(ArtifactError, match="corrupted"):
        for i, _ in acts.layers([0, 1]):
            seen.append(i)
    assert seen == [0]
    assert list(acts.layers([])) == []


def _flip_in(path, tensor: str) -> None:
    """Flip one byte inside `tensor`'s bytes of the shard at `path` (its header and other tensors untouched)."""
    from kvcalib.tensorfile import read_header

    raw = bytearray(path.read_bytes())
    with open(path, "rb") as f:
        entries, start = read_header(f, str(path), len(raw))
    begin, end = entries[tensor][2:]
    raw[start + (begin + end) // 2] ^= 0x40
    path.write_bytes(bytes(raw))


def test_the_manifest_holds_each_shard_s_and_each_tensor_s_hash_as_the_files_give_them(run):
    """collect hashes while it writes (one pass, `write_tensors`); the hashes must be those of the bytes that
    landed: the file's, and its header's and each tensor's byte range's."""
    import hashlib

    from kvcalib.collect import shard_sums

    out = run()
    manifest = json.loads((out / "manifest.json").read_text())
    assert set(manifest["shards"]) == set(manifest["tensor_sha256"]) and len(manifest["shards"]) == 2 * 3
    for name, sha in manifest["shards"].items():
        assert sha == hashlib.sha256((out / name).read_bytes()).hexdigest()
        assert shard_sums(out / name) == (sha, manifest["tensor_sha256"][name])
        assert set(manifest["tensor_sha256"][name]) == {"__header__", "q", "k", "v", "positions"}


def test_a_layer_read_by_name_reads_and_checks_only_those_tensors(run):
    """With per-tensor hashes a reader of keys (fit-codebook) reads the keys' bytes and checks them alone: a
    damaged query tensor does not stop it, and is refused, with the shard named, where queries are read."""
    out = run()
    whole = Activations(out).layer(1)
    _flip_in(out / shard_name(1, 1), "q")
    acts = Activations(out)
    some = acts.layer(1, ("k", "positions"))
    assert torch.equal(some["k"], whole["k"]) and torch.equal(some["positions"], whole["positions"])
    with pytest.raises(ArtifactError, match=r"layer001-chunk0001.*checksum mismatch"):
        acts.layer(1)
    _flip_in(out / shard_name(1, 2), "k")
    with pytest.raises(ArtifactError, match=r"layer001-chunk0002.*checksum mismatch"):
        acts.layer(1, ("k",))


def test_a_collection_without_per_tensor_hashes_is_read_and_checked_whole(run):
    """A manifest from before per-tensor hashes (only each file's): the same tensors, each shard checked as
    one file, so a damaged byte anywhere in it is refused whichever tensors are asked for."""
    out = run()
    whole = Activations(out).layer(1)
    manifest = json.loads((out / "manifest.json").read_text())
    del manifest["tensor_sha256"]
    (out / "manifest.json").write_text(json.dumps(manifest))
    got = Activations(out).layer(1)
    assert all(torch.equal(got[k], whole[k]) for k in whole)
    _flip_in(out / shard_name(1, 0), "q")
    with pytest.raises(ArtifactError, match="checksum mismatch"):
        Activations(out).layer(1, ("k",))


def test_the_shard_writer_holds_at_most_its_write_ahead_and_raises_a_failed_write(tmp_path, monkeypatch):
    """`ShardWriter` hands shards to threads and waits, before taking another, while more than WRITE_AHEAD bytes
    are not yet written (writes slowed here so that they queue): what it holds stays within the bound, every
    shard lands whole with the hashes of its bytes; a write that fails is raised to the recording side."""
    import hashlib
    import time

    import kvcalib.collect as module

    shard = {"k": torch.randn(2, 3, 8).half(), "positions": torch.arange(3, dtype=torch.int32)[None]}
    size = sum(t.numel() * t.element_size() for t in shard.values())
    monkeypatch.setattr(module, "WRITE_AHEAD", 3 * size)
    real = module.ShardWriter._one

    def slow(self, path, tensors):
        time.sleep(0.02)
        if path.name == "bad":
            raise OSError(28, "No space left on device")
        real(self, path, tensors)

    monkeypatch.setattr(module.ShardWriter, "_one", slow)
    sums, most = {}, 0
    with module.ShardWriter(sums) as writer:
        for n in range(12):
            writer.write(tmp_path / f"s{n}", shard)
            most = max(most, writer.held)
    assert size <= most <= 3 * size
    for n in range(12):
        raw = (tmp_path / f"s{n}").read_bytes()
        assert sums[f"s{n}"][0] == hashlib.sha256(raw).hexdigest()
    with pytest.raises(OSError, match="No space left"):
        with module.ShardWriter({}) as writer:
            for name in ("a", "bad", "c", "d", "e", "f"):
                writer.write(tmp_path / name, shard)


def _rewrite(out, layer: int, chunk: int, change) -> None:
    """Rewrite one shard as `change(tensors)` gives it, with its manifest hashes made to match (a collection
    intact on disk whose shards disagree among themselves)."""
    from kvcalib.collect import shard_sums
    from kvcalib.tensorfile import write_tensors

    path = out / shard_name(layer, chunk)
    tensors = change({k: t.clone() for k, t in load_file(str(path)).items()})  # not the file's mapped pages
    with open(path, "wb") as f:
        write_tensors(f, {k: t.contiguous() for k, t in tensors.items()})
    manifest = json.loads((out / "manifest.json").read_text())
    manifest["shards"][path.name], manifest["tensor_sha256"][path.name] = shard_sums(path)
    (out / "manifest.json").write_text(json.dumps(manifest))


@pytest.mark.parametrize("how,message", [
    ("a first shard of one sample, then shards of two", "holds 2 samples where its chunk holds 1"),
    ("keys of fewer samples than the positions", r"its tensors hold \[1, 2\] samples"),
    ("a shard of no samples", r"its tensors hold \[0\] samples"),
])
def test_shards_that_disagree_on_their_samples_are_refused_though_their_hashes_hold(run, how, message):
    """The layer is read shard by shard at offsets of whole chunks, in place: a collection whose shards do not
    hold whole chunks (or whose tensors disagree within a shard) is refused in one line, never read past,
    overlapped or left with rows unwritten."""
    out = run()
    if how.startswith("a first shard"):
        _rewrite(out, 1, 0, lambda t: {k: x[:1] for k, x in t.items()})
    elif how.startswith("keys"):
        _rewrite(out, 1, 1, lambda t: {**t, "k": t["k"][:1]})
    else:
        _rewrite(out, 1, 2, lambda t: {k: x[:0] for k, x in t.items()})
    with pytest.raises(ArtifactError, match=message):
        Activations(out).layer(1)
