"""`kvcalib make-model`: a random-initialised model of a given shape, saved as a directory that
`--model` takes, with the embedded tokenizer; its weights at transformers' initial scale, the same bytes
for the same seed, in shards of bounded size; bad input refused in one line with nothing left behind."""

import json
import math

import pytest
import torch
from safetensors.torch import load_file

from kvcalib.cli import main
from kvcalib.collect import Activations, collect
from kvcalib.models import attention_shape, load_model
from kvcalib.random_model import SHAPES, make_model
from conftest import tiny_config


@pytest.fixture(scope="module")
def shape_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("shape") / "tiny.json"
    path.write_text(tiny_config().to_json_string())
    return path


def test_a_made_model_loads_collects_and_draws_its_weights_as_transformers_does(shape_file, tmp_path, text_file):
    out = make_model(str(shape_file), tmp_path / "m", dtype="float32", seed=3)
    lm = load_model(str(out), device="cpu")
    assert attention_shape(lm.config) == attention_shape(tiny_config())
    assert lm.config.vocab_size == len(lm.tokenizer)  # the embedded tokenizer's vocabulary
    weights = dict(lm.model.named_parameters())
    assert (weights["model.norm.weight"] == 1).all() and (weights["model.layers.0.input_layernorm.weight"] == 1).all()
    w = weights["model.layers.1.mlp.down_proj.weight"].double()
    # A sample standard deviation of n normal draws is within 6 standard errors, std / sqrt(2n), of std (the
    # Irwin-Hall draw's negative excess kurtosis, -0.3, makes its standard error smaller still).
    assert abs(w.std().item() - 0.02) < 6 * 0.02 / math.sqrt(2 * w.numel())
    acts = collect(tmp_path / "acts", lm, dataset=str(text_file), num_samples=2, seq_len=32)
    assert Activations(acts).num_layers == 2


def test_the_same_seed_gives_the_same_bytes_and_shards_stay_under_their_bound(shape_file, tmp_path):
    one = make_model(str(shape_file), tmp_path / "a", dtype="bfloat16", seed=0)
    two = make_model(str(shape_file), tmp_path / "b", dtype="bfloat16", seed=0, shard_bytes=64 * 1024)
    other = make_model(str(shape_file), tmp_path / "c", dtype="bfloat16", seed=1)
    whole = load_file(one / "model.safetensors")
    index = json.loads((two / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 2
    sharded = {}
    for f in files:
        assert (two / f).stat().st_size <= 64 * 1024 + 4096 or len(load_file(two / f)) == 1  # header aside
        sharded |= load_file(two / f)
    assert sharded.keys() == whole.keys() and all(torch.equal(sharded[k], whole[k]) for k in whole)
    assert not torch.equal(load_file(other / "model.safetensors")["model.embed_tokens.weight"], whole["model.embed_tokens.weight"])
    assert (one / "model.safetensors").read_bytes() == (make_model(str(shape_file), tmp_path / "d", seed=0) / "model.safetensors").read_bytes()


def test_the_named_shapes_are_the_published_llama_3_1_configs():
    assert {k: SHAPES["llama-3.1-8b"][k] for k in ("num_hidden_layers", "hidden_size", "num_key_value_heads")} == \
        {"num_hidden_layers": 32, "hidden_size": 4096, "num_key_value_heads": 8}
    assert {k: SHAPES["llama-3.1-70b"][k] for k in ("num_hidden_layers", "hidden_size", "intermediate_size")} == \
        {"num_hidden_layers": 80, "hidden_size": 8192, "intermediate_size": 28672}


@pytest.mark.parametrize("args,message", [
    (["--shape", "llama-9"], "name one of llama-3.1-8b, llama-3.1-70b"),
    (["--shape", "{tmp}/none.json"], "no such file"),
    (["--shape", "{tmp}/bad.json"], "not a readable JSON config"),
    (["--shape", "{shape}", "--out", "/proc/nope/m"], "cannot create anything"),
    (["--shape", "{shape}", "--tokenizer", "{tmp}"], "not a directory holding a saved tokenizer"),
])
def test_make_model_bad_input_gives_one_line_exit_2_and_no_output(args, message, shape_file, tmp_path, capsys):
    (tmp_path / "bad.json").write_text("{not json")
    args = [a.format(tmp=tmp_path, shape=shape_file) for a in args]
    if "--out" not in args:
        args += ["--out", str(tmp_path / "out")]
    with pytest.raises(SystemExit) as exc:
        main(["make-model", *args])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and err.startswith("kvcalib: error:") and err.count("\n") == 1, err
    assert message in err
    assert not (tmp_path / "out").exists()


def test_a_saved_tokenizer_replaces_the_embedded_one(shape_file, tmp_path):
    """--tokenizer DIR: a machine without the embedded GGUF makes the model with a tokenizer carried to it;
    the model directory is byte for byte the one made with the embedded tokenizer."""
    from transformers import AutoTokenizer

    from kvcalib.models import DEFAULT_MODEL, _resolve

    target, kwargs = _resolve(DEFAULT_MODEL)
    AutoTokenizer.from_pretrained(target, **kwargs).save_pretrained(tmp_path / "tok")
    embedded = make_model(str(shape_file), tmp_path / "a", seed=0)
    carried = make_model(str(shape_file), tmp_path / "b", seed=0, tokenizer=str(tmp_path / "tok"))
    files = sorted(p.name for p in embedded.iterdir())
    assert files == sorted(p.name for p in carried.iterdir()) and "tokenizer.json" in files
    for name in files:
        assert (embedded / name).read_bytes() == (carried / name).read_bytes(), name



@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_generated_weights_load_as_the_written_ones_bit_for_bit(shape_file, tmp_path, dtype):
    """`--weights generated` writes no weights and `--model DIR` draws the written model's tensors at load:
    the same state, tensor for tensor, on one device and spread by `--device-map auto` (the CPU here), with
    fewer threads than tensors (each tensor its own generator: the threads change nothing)."""
    from kvcalib.models import _load_cached
    from kvcalib.random_weights import GENERATED, generated_model

    written = make_model(str(shape_file), tmp_path / "w", dtype=dtype, seed=4)
    generated = make_model(str(shape_file), tmp_path / "g", dtype=dtype, seed=4, weights="generated")
    assert not list(generated.glob("*.safetensors")) and (generated / GENERATED).exists()
    want = load_model(str(written), device="cpu", dtype=torch.float32).model.state_dict()
    _load_cached.cache_clear()
    for got in (load_model(str(generated), device="cpu", dtype=torch.float32).model.state_dict(),
                load_model(str(generated), device_map="auto", dtype=torch.float32).model.state_dict(),
                generated_model(generated, torch.float32, "cpu", threads=2).state_dict()):
        _load_cached.cache_clear()
        assert got.keys() == want.keys()
        assert all(torch.equal(got[k], want[k]) for k in want), [k for k in want if not torch.equal(got[k], want[k])]
    other = make_model(str(shape_file), tmp_path / "o", dtype=dtype, seed=5, weights="generated")
    assert not torch.equal(load_model(str(other), device="cpu", dtype=torch.float32).model.state_dict()["lm_head.weight"],
                           want["lm_head.weight"])
    _load_cached.cache_clear()


@pytest.mark.parametrize("content", ["{", '{"format": 2, "seed": "x", "dtype": "bfloat16"}', '{"format": 3, "seed": 0, "dtype": "bfloat16"}',
                                     '{"format": 1, "seed": 0, "dtype": "bfloat16"}'])  # 1: torch's CPU generator
def test_a_damaged_generated_weights_file_is_refused_in_one_line(shape_file, tmp_path, capsys, content):
    from kvcalib.random_weights import GENERATED

    model = make_model(str(shape_file), tmp_path / "g", seed=0, weights="generated")
    (model / GENERATED).write_text(content)
    with pytest.raises(SystemExit) as exc:
        main(["collect", "--model", str(model), "--num-samples", "1", "--seq-len", "8", "--device", "cpu",
              "--out", str(tmp_path / "acts")])
    err = capsys.readouterr().err.strip().splitlines()
    assert exc.value.code == 2 and len(err) == 1 and GENERATED in err[0], err
    assert not (tmp_path / "acts").exists()


def test_a_generated_model_that_would_need_disk_offload_is_refused_in_one_line(shape_file, tmp_path, monkeypatch):
    """accelerate maps what fits in no memory to "disk"; drawn weights have no file to offload to."""
    import accelerate

    from kvcalib.errors import SettingsError
    from kvcalib.random_weights import generated_model

    model = make_model(str(shape_file), tmp_path / "g", seed=0, weights="generated")
    monkeypatch.setattr(accelerate, "infer_auto_device_map", lambda *a, **k: {"model": "cpu", "lm_head": "disk"})
    with pytest.raises(SettingsError, match="does not fit"):
        generated_model(model, torch.float32, "auto-map")


def _mix32(v: int) -> int:
    m = 0xFFFFFFFF
    v ^= v >> 16
    v = (v * 0x7FEB352D) & m
    v ^= v >> 15
    v = (v * 0x2C1B3C6D) & m
    return v ^ (v >> 16)


@pytest.mark.parametrize("chunk", [1 << 18, 1000])
def test_the_draw_is_its_documented_integer_rule_whatever_the_chunking(chunk, monkeypatch):
    """`initial`'s element i from the counters 2i and 2i + 1 (plain Python integers here, the rule as its
    docstring states it), the same with any chunking of the tensor; the four 16-bit sums have the variance
    that the scale assumes, so the std is the one asked for."""
    import zlib

    import kvcalib.random_weights as rw

    monkeypatch.setattr(rw, "DRAW_CHUNK", chunk)
    name, shape, std, seed = "model.layers.3.self_attn.k_proj.weight", (300, 70), 0.02, 9
    got = rw.initial(name, shape, std, seed).flatten()
    key = _mix32((seed * 1_000_003 + zlib.crc32(name.encode())) & 0xFFFFFFFF)
    scale = torch.tensor(std / ((4 * (65536**2 - 1) / 12) ** 0.5), dtype=torch.float32)
    for i in [0, 1, 999, 1000, 12345, got.numel() - 1]:
        a, b = _mix32((2 * i + key) & 0xFFFFFFFF), _mix32((2 * i + 1 + key) & 0xFFFFFFFF)
        total = (a & 0xFFFF) + (a >> 16) + (b & 0xFFFF) + (b >> 16) - 131070
        assert got[i].item() == (torch.tensor(float(total)) * scale).item(), i
    assert torch.equal(got, rw.initial(name, shape, std, seed, "cpu").flatten())
    assert not torch.equal(got, rw.initial(name, shape, std, seed + 1).flatten())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: the GPU's draw against the CPU's")
def test_a_gpu_draws_the_same_bytes_as_the_cpu(monkeypatch):
    """A generated model's GPU tensors are drawn on the GPU (integer operations and one float32 product: the
    same bits as the CPU's draw, which `make-model --weights written` saves), in chunks of any size."""
    import kvcalib.random_weights as rw

    for name, shape in [("model.layers.0.mlp.up_proj.weight", (1024, 4096)), ("lm_head.weight", (3, 5))]:
        cpu = rw.initial(name, shape, 0.02, 7)
        assert torch.equal(rw.initial(name, shape, 0.02, 7, "cuda").cpu(), cpu), name
        assert torch.equal(rw.initial(name, shape, 0.02, 7, "cuda").cpu().to(torch.bfloat16), cpu.to(torch.bfloat16))
        monkeypatch.setattr(rw, "DRAW_CHUNK_GPU", 1000)
        assert torch.equal(rw.initial(name, shape, 0.02, 7, "cuda").cpu(), cpu), name
        monkeypatch.undo()


# (layers, query heads, KV heads, head_dim, sliding layers) of each named shape, as its published config has them
PUBLISHED = {"llama-3.1-8b": (32, 32, 8, 128, 0), "llama-3.1-70b": (80, 64, 8, 128, 0), "qwen3-8b": (36, 32, 8, 128, 0),
             "mistral-7b": (32, 32, 8, 128, 0), "phi-3-mini": (32, 32, 32, 96, 0), "gemma-2-9b": (42, 16, 8, 256, 21),
             "gemma-3-4b": (34, 8, 4, 256, 29), "gemma-3-27b": (62, 32, 16, 128, 52)}


@pytest.mark.parametrize("shape", list(SHAPES))
def test_each_named_shape_makes_the_published_attention_layout(shape, tmp_path):
    """`--weights generated`: the config alone (no tensors drawn), which transformers reads back as the architecture
    with the published attention: layers, heads, head_dim, and which layers slide over a window."""
    from transformers import AutoConfig

    from kvcalib.models import attention_shape

    assert set(PUBLISHED) == set(SHAPES)
    config = AutoConfig.from_pretrained(make_model(shape, tmp_path / "m", weights="generated"))
    a = attention_shape(config)
    sliding = sum(t == "sliding_attention" for t in (getattr(config, "layer_types", None) or []))
    assert (a.num_layers, a.num_heads, a.num_kv_heads, a.head_dim, sliding) == PUBLISHED[shape]
    assert config.model_type == SHAPES[shape]["model_type"]


TINY = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2,
            head_dim=32, max_position_embeddings=512)  # a same-architecture variant small enough for the CPU


@pytest.mark.parametrize("shape", ["qwen3-8b", "mistral-7b", "phi-3-mini", "gemma-2-9b", "gemma-3-4b"])
def test_a_small_model_of_each_architecture_evaluates_through_a_compressed_cache(shape, tmp_path):
    """The architecture of each named shape at a CPU size (its other settings kept: Gemma's windows shortened to 16
    tokens so that they slide within the text, its soft-capping, Qwen3's QK norms): `eval` of KIVI-2 beside fp16 on the
    same windows gives a finite perplexity and honest bits, the sliding layers attended over their windows."""
    import json as json_

    from kvcalib.evaluate import evaluate

    fields = SHAPES[shape] | TINY
    if "sliding_window" in fields and fields["sliding_window"]:
        fields["sliding_window"] = 16
    file = tmp_path / "shape.json"
    file.write_text(json_.dumps(fields))
    model = str(make_model(str(file), tmp_path / "m", dtype="float32", seed=1))
    fp16 = evaluate(model=model, method="fp16", num_samples=1, seq_len=64, device="cpu")
    kivi = evaluate(model=model, method="kivi", bits=2, group_size=16, residual=16, num_samples=1, seq_len=64,
                    device="cpu")
    assert all(torch.isfinite(torch.tensor(r.perplexity)) for r in (fp16, kivi))
    assert kivi.perplexity != fp16.perplexity and kivi.effective_bits < 16 < fp16.effective_bits + 1e-9
