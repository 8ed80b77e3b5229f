"""What `model.generate` promises a user of a kvcalib cache, on the torch path (CPU): a row that draws its EOS
stops while the others go on, seeded sampling gives the same tokens again, a streamer receives every token
`generate` returns, and `kvcalib generate` streams a continuation of the embedded model.

`tests/test_generate_gpu.py` holds the static cache to the same contract (`check_*` below) on the GPU,
where `model.generate` replays the captured step.
"""

import copy
import sys

import pytest
import torch
from transformers.generation.streamers import BaseStreamer

from kvcalib.errors import SettingsError
from kvcalib.methods import MethodSettings, build_method
from kvcalib.models import AttentionShape, LoadedModel, attention_shape
from kvcalib.runtime.cache import KvcalibCache, where_layers_run
from conftest import tiny_model

SETTINGS = MethodSettings(bits=2, group_size=16, residual=32)


class Collect(BaseStreamer):
    """A streamer that keeps what `generate` hands it: the prompt first, then each step's tokens."""

    def __init__(self):
        self.puts: list[torch.Tensor] = []

    def put(self, value):
        self.puts.append(value.cpu())

    def end(self):
        self.puts.append(None)


def left_padded(prompts: list[torch.Tensor], pad: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, attention_mask) of `prompts` padded on the left to the longest."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, p in enumerate(prompts):
        ids[b, width - len(p):], mask[b, width - len(p):] = p.cpu(), 1
    return ids, mask


def run(model, make_cache, ids, mask, steps: int, **kwargs):
    """`model.generate` with a fresh cache from `make_cache()`: (new tokens (B, <= steps), logits (B, <= steps, V))."""
    device = next(model.parameters()).device
    with torch.no_grad():
        out = model.generate(ids.to(device), attention_mask=None if mask is None else mask.to(device),
                             past_key_values=make_cache(), max_new_tokens=steps, pad_token_id=0, output_logits=True,
                             return_dict_in_generate=True, **kwargs)
    return out.sequences[:, ids.shape[1]:].cpu(), torch.stack(out.logits, 1).cpu()


def check_eos_stops_a_row(model, make_cache, prompts: list[torch.Tensor], steps: int = 24) -> None:
    """The token row 0 draws at step 5, made the EOS: row 0 ends there (padding after it), the other rows
    decode as before until the first of them draws it too, and a batch where every row has stopped ends."""
    ids, mask = left_padded(prompts)
    tokens, _ = run(model, make_cache, ids, mask, steps, do_sample=False)
    eos = int(tokens[0, 5])
    first = int((tokens[0] == eos).nonzero()[0])  # row 0 may draw it before step 5 already
    stopped, _ = run(model, make_cache, ids, mask, steps, do_sample=False, eos_token_id=eos)
    assert stopped[0, : first + 1].tolist() == tokens[0, : first + 1].tolist()
    assert (stopped[0, first + 1:] == 0).all()
    for b in range(1, len(prompts)):
        hits = (tokens[b] == eos).nonzero()
        end = int(hits[0]) + 1 if len(hits) else steps
        assert stopped[b, :end].tolist() == tokens[b, :end].tolist()
    alone, _ = run(model, make_cache, ids[:1, -len(prompts[0]):], None, steps, do_sample=False, eos_token_id=eos)
    assert alone.shape[1] == first + 1 and int(alone[0, -1]) == eos  # nothing decoded past the last EOS


def check_seeded_sampling_repeats(model, make_cache, prompts: list[torch.Tensor], steps: int = 16) -> None:
    """Sampling with transformers' processors (temperature, top-k, top-p, repetition penalty): the same seed
    gives the same tokens, another seed other tokens (random weights: near-uniform logits, so a repeat
    by chance has probability of order 1/vocab per token)."""
    ids, mask = left_padded(prompts)
    options = dict(do_sample=True, temperature=0.8, top_k=200, top_p=0.95, repetition_penalty=1.1)
    drawn = []
    for seed in (7, 7, 8):
        torch.manual_seed(seed)
        drawn.append(run(model, make_cache, ids, mask, steps, **options)[0])
    assert drawn[0].tolist() == drawn[1].tolist()
    assert drawn[0].tolist() != drawn[2].tolist()


def check_streamer_gets_every_token(model, make_cache, prompts: list[torch.Tensor], steps: int = 12) -> None:
    streamer = Collect()
    ids, mask = left_padded(prompts[:1])
    tokens, _ = run(model, make_cache, ids, mask, steps, do_sample=False, streamer=streamer)
    assert streamer.puts[-1] is None and streamer.puts[0].tolist() == ids.tolist()
    assert [int(t) for t in streamer.puts[1:-1]] == tokens[0].tolist()


def _tiny():
    model = tiny_model("llama", seed=5)
    model.generation_config.eos_token_id = None
    return model


def _dynamic(model, name: str = "kivi"):
    method = build_method(name, attention_shape(model.config), SETTINGS)
    lm = LoadedModel(model=model, tokenizer=None, spec="tiny")
    return lambda: KvcalibCache(lm, copy.copy(method))


def _prompts(seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(1, 512, (n,), generator=gen) for n in (37, 21, 5)]


def test_an_eos_stops_its_row_and_the_others_decode_on():
    model = _tiny()
    check_eos_stops_a_row(model, _dynamic(model), _prompts(1))


def test_seeded_sampling_gives_the_same_tokens_again_and_another_seed_others():
    model = _tiny()
    check_seeded_sampling_repeats(model, _dynamic(model, "oscar"), _prompts(2))


def test_a_streamer_receives_every_token_generate_returns():
    model = _tiny()
    check_streamer_gets_every_token(model, _dynamic(model), _prompts(3))


def test_the_eos_check_fails_when_the_eos_is_ignored():
    # A planted error: generate decodes past the EOS (its id never reaches the stopping criteria).
    model = _tiny()
    make_cache = _dynamic(model)
    real = model.generate

    def deaf(*args, eos_token_id=None, **kwargs):
        return real(*args, **kwargs)

    model.generate = deaf
    with pytest.raises(AssertionError):
        check_eos_stops_a_row(model, make_cache, _prompts(1))


def test_where_layers_run_names_the_kernel_and_the_faster_cache():
    shape = AttentionShape(num_layers=2, num_heads=8, num_kv_heads=2, head_dim=64)  # a head_dim the kernels read
    cuda = torch.device("cuda")  # `supports` reads the device's type only: no GPU needed to ask
    kivi = build_method("kivi", shape, SETTINGS)
    line = where_layers_run(kivi, shape, cuda)
    assert f"{shape.num_layers} layers on the fused INT2 path" in line and "StaticKvcalibCache" in line
    turbo = build_method("turboquant", shape, MethodSettings(bits=2, residual=32))
    line = where_layers_run(turbo, shape, cuda)
    assert f"{shape.num_layers} layers on the fused codebook path" in line and "StaticKvcalibCache" in line
    kivi3 = build_method("kivi", shape, MethodSettings(bits=3, group_size=16, residual=32))  # affine codes
    line = where_layers_run(kivi3, shape, cuda)
    assert f"{shape.num_layers} layers on the fused codebook path" in line and "StaticKvcalibCache" in line
    kivi8 = build_method("kivi", shape, MethodSettings(bits=3, group_size=8, residual=32))  # groups within a tile
    line = where_layers_run(kivi8, shape, cuda)
    assert f"{shape.num_layers} layers on the torch path" in line and "cannot hold this" in line


@pytest.mark.slow
def test_kvcalib_generate_streams_the_embedded_models_continuation(capsys):
    from kvcalib.generate import generate

    text = generate("What does a Python list hold?", method="oscar", max_new_tokens=12, device="cpu",
                    stream=sys.stdout)
    out = capsys.readouterr().out
    assert text.strip() and out.strip() == text.strip()
    with pytest.raises(SettingsError, match="context"):
        generate("x", max_new_tokens=10**6, device="cpu")


@pytest.mark.parametrize("args,says", [([], "one of --prompt"), (["--prompt", "x", "--prompt-file", "-"], "one of --prompt"),
                                       (["--prompt", "  "], "prompt is empty"),
                                       (["--prompt", "x", "--max-new-tokens", "0"], "must be positive")])
def test_kvcalib_generate_refuses_bad_input_in_one_line_before_loading_a_model(args, says, capsys):
    from kvcalib.cli import main

    with pytest.raises(SystemExit) as done:
        main(["generate", "--model", "no-such-model-dir", *args])
    err = capsys.readouterr().err
    assert done.value.code == 2 and says in err and len(err.strip().splitlines()) == 1
