"""`KvcalibCache` under transformers' tensor parallelism (`from_pretrained(...,
distributed_config=DistributedConfig(tp_plan="auto"))` under torchrun): two CPU processes joined by gloo, as
`torchrun --nproc-per-node 2` starts them, each holding half of every layer's heads and its own heads' cache. Greedy
decoding through `model.generate` gives the one-process tokens, and logits within float64 round-off: the model is
float64, so the ranks' partial sums of the row-split projections, added by the all-reduce in another order than one
process adds them, differ by ~1e-16 relative (1e-9 is a bound several orders above that and below any cache error: a
2-bit cache moves logits by ~1e-2). Methods that hold data per KV head (VecInfer's smoothing and codebooks, KVLinC's
adapters, calibrated TurboQuant's per-head codebooks, a plan's schemes) give each rank its own heads' part; one
without (VecInfer with shared codebooks and no smoothing) serves every rank as it is. The static cache runs on CUDA
only: here its construction is checked (its CUDA check set aside), each rank's buffers holding the rank's own KV
heads, and a VecInfer cache its own heads' smoothing (tests/test_multi_gpu.py decodes with it on two GPUs)."""

from __future__ import annotations

import pytest
import torch

from test_parallel import _free_port, as_rank, run_processes

METHODS = {"fp16": {}, "kivi": {"bits": 2, "group_size": 8, "residual": 16},
           "oscar": {"bits": 2, "group_size": 8, "residual": 16}, "turboquant": {"bits": 3, "residual": 16},
           "kvlinc": {"bits": 2, "group_size": 8, "residual": 16}}


def _decode(model_dir: str, tensor_parallel: bool) -> dict:
    """Each method's greedy tokens and logits through model.generate, and what a per-head method and the static
    cache say under tensor parallelism."""
    from transformers import AutoModelForCausalLM
    from transformers.distributed import DistributedConfig

    from kvcalib.errors import SettingsError
    from kvcalib.methods import MethodSettings
    from kvcalib.models import LoadedModel
    from kvcalib.runtime.cache import KvcalibCache
    from kvcalib.models import attention_shape
    from kvcalib.runtime.static_cache import StaticKvcalibCache
    from test_runtime_cache import _kvlinc_with_adapters, _plan, _turboquant_per_head, _vecinfer_with_sinks

    parallel = {"distributed_config": DistributedConfig(tp_plan="auto")} if tensor_parallel else {}
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64, **parallel)
    model.generation_config.eos_token_id = None
    lm = LoadedModel(model=model, tokenizer=None, spec="tiny")
    prompt = torch.randint(1, 512, (1, 37), generator=torch.Generator().manual_seed(0))
    shape = attention_shape(model.config)
    per_head = {"vecinfer": lambda: _vecinfer_with_sinks(shape, 0), "vecinfer-shared": lambda: _shared_books(shape),
                "kvlinc+adapters": lambda: _kvlinc_with_adapters(shape),
                "turboquant-per-head": lambda: _turboquant_per_head(shape), "plan": lambda: _plan(shape),
                "plan-per-head": lambda: _plan(shape, granularity="head")}
    out = {}
    for name in [*METHODS, *per_head]:
        method = per_head[name]() if name in per_head else name
        cache = KvcalibCache(lm, method, MethodSettings(**METHODS.get(name, {})))
        with torch.no_grad():
            got = model.generate(prompt, past_key_values=cache, max_new_tokens=25, do_sample=False,
                                 output_logits=True, return_dict_in_generate=True)
        heads = {layer.k_res.shape[1] for layer in cache.layers}
        out[name] = {"tokens": got.sequences[0, 37:].tolist(), "logits": torch.stack(got.logits, 1)[0].tolist(),
                     "heads": sorted(heads)}
    try:
        StaticKvcalibCache(lm, "kivi")
        out["refused"] = None
    except SettingsError as err:
        out["refused"] = str(err)
    import kvcalib.runtime.static_cache as static_cache

    static_cache.check_static = lambda *args: None  # the CUDA check: construction only, on the CPU
    kivi = StaticKvcalibCache(lm, "kivi", MethodSettings(bits=2, group_size=16, residual=16))
    vecinfer = StaticKvcalibCache(lm, per_head["vecinfer"](), MethodSettings(residual=16))
    out["static"] = {"heads": sorted({layer.layout.kres.shape[1] for layer in kivi.layers}),
                     "vecinfer_smooth": vecinfer.layers[0].layout.smooth.tolist()}
    return out


def _shared_books(shape):
    """VecInfer with one codebook pair a layer and no smoothing: nothing per KV head, so every rank takes the
    method as it is and reads its own heads' count from the codes it holds."""
    from test_runtime_cache import _vecinfer_with_sinks

    from kvcalib.methods.vecinfer import LayerCodebooks

    method = _vecinfer_with_sinks(shape, 0)
    method.layers = [LayerCodebooks(b.k, b.v, None) for b in method.layers]
    assert not method.per_kv_head
    return method


def _child(rank: int, size: int, port: int, model_dir: str, log: str, planted: bool = False) -> None:
    torch.set_num_threads(1)
    if planted:  # every rank takes rank 0's heads' part of a per-head method
        import kvcalib.runtime.cache as runtime_cache

        runtime_cache.tensor_parallel_rank = lambda model: 0
    as_rank(rank, size, port, log, lambda: _decode(model_dir, True))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from conftest import tiny_model

    path = tmp_path_factory.mktemp("tp-model")
    tiny_model("llama", seed=1).save_pretrained(path)  # 4 query and 2 KV heads: one KV head per rank
    return path


@pytest.fixture(scope="module")
def alone(model_dir) -> dict:
    torch.set_num_threads(1)
    return _decode(str(model_dir), False)


def _ranks(model_dir, tmp_path, planted: bool = False) -> list[dict]:
    port, logs = _free_port(), [tmp_path / f"rank{r}.json" for r in range(2)]
    ranks = run_processes(_child, [(r, 2, port, str(model_dir), str(logs[r]), planted) for r in range(2)], logs)
    assert all(r["ok"] for r in ranks), [r.get("trace") for r in ranks]
    return ranks


def _as_one_process(rank: dict, alone: dict, name: str) -> None:
    """A rank's tokens and logits of `name` against one process's: the module docstring's bound."""
    assert rank[name]["tokens"] == alone[name]["tokens"], name
    want = torch.tensor(alone[name]["logits"])
    torch.testing.assert_close(torch.tensor(rank[name]["logits"]), want, rtol=1e-9, atol=1e-9 * want.abs().max().item())


def test_kvcalib_cache_under_tensor_parallelism_decodes_as_one_process(model_dir, alone, tmp_path):
    torch.set_num_threads(1)
    ranks = _ranks(model_dir, tmp_path)
    for name in [n for n in alone if n not in ("refused", "static")]:
        assert alone[name]["heads"] == [2]
        for r in ranks:
            assert r[name]["heads"] == [1], name  # each rank's cache holds its own KV head
            _as_one_process(r, alone, name)
    assert "tensor parallelism" not in alone["refused"]  # the CPU's refusal, the same in every process
    assert alone["static"]["heads"] == [2]
    for rank, r in enumerate(ranks):
        assert r["refused"] == alone["refused"]
        assert r["static"]["heads"] == [1]  # each rank's static buffers: its own KV head
        assert r["static"]["vecinfer_smooth"] == alone["static"]["vecinfer_smooth"][rank : rank + 1]


PER_HEAD = ("vecinfer", "kvlinc+adapters", "turboquant-per-head", "plan", "plan-per-head")


def test_a_rank_given_another_ranks_heads_decodes_otherwise(model_dir, alone, tmp_path):
    """The planted error: rank 1 reading rank 0's smoothing, codebooks, adapters and schemes. The comparison above
    fails for every per-head method, while a method without per-head data, which takes no part of anything,
    still passes it."""
    torch.set_num_threads(1)
    ranks = _ranks(model_dir, tmp_path, planted=True)
    for name in PER_HEAD:
        with pytest.raises(AssertionError):
            _as_one_process(ranks[1], alone, name)
    _as_one_process(ranks[1], alone, "kivi")


def _generate(model_dir: str, device: str = "cpu") -> dict:
    """`kvcalib generate` as a process runs it from the command line (under torchrun: tensor parallelism): the
    text `generate` returns, what the command wrote to stdout, how the model it loaded is split and which cache
    served it."""
    import contextlib
    import io

    import kvcalib.generate as module
    from kvcalib.cli import main
    from kvcalib.runtime.cache import tensor_parallel_size

    loaded, caches, texts = [], [], []
    load, make, run = module.load_model, module.runtime_cache, module.generate
    module.load_model = lambda *args, **kwargs: loaded.append(load(*args, **kwargs)) or loaded[-1]  # what it loads,
    module.runtime_cache = lambda *args, **kwargs: caches.append(make(*args, **kwargs)) or caches[-1]  # serves
    module.generate = lambda *args, **kwargs: texts.append(run(*args, **kwargs)) or texts[-1]  # and returns
    stdout = io.StringIO()
    try:
        with contextlib.redirect_stdout(stdout):  # (an error exits: the rank's log then holds it)
            main(["generate", "--model", model_dir, "--method", "kivi", "--bits", "2", "--group-size", "16",
                  "--residual", "16", "--prompt", "The list holds", "--max-new-tokens", "12", "--device", device])
    finally:
        module.load_model, module.runtime_cache, module.generate = load, make, run
    return {"text": texts[-1], "streamed": stdout.getvalue(), "ranks": tensor_parallel_size(loaded[-1].model),
            "cache": type(caches[-1]).__name__}


def _generate_child(rank: int, size: int, port: int, model_dir: str, log: str, device: str = "cpu") -> None:
    torch.set_num_threads(1)
    as_rank(rank, size, port, log, lambda: _generate(model_dir, device))


@pytest.mark.skipif(torch.cuda.is_available(), reason="two CPU ranks: on a GPU machine generate puts each rank on its "
                    "GPU (tests/test_multi_gpu.py holds that run)")
def test_kvcalib_generate_under_torchrun_decodes_under_tensor_parallelism_as_one_process(tiny_model_dir, tmp_path):
    """`torchrun --nproc-per-node 2 -m kvcalib generate ...`: both ranks load the model split in two (each its share
    of the heads) and continue the prompt to one process's text, greedily; rank 0 alone streams it. (The model is
    float32 here: the ranks' partial sums, added in another order, move logits by ~1e-7 relative, far below the
    gaps between this random model's top tokens, so the greedy text is the same.)"""
    torch.set_num_threads(1)
    alone = _generate(str(tiny_model_dir))
    assert alone["ranks"] == 1 and alone["streamed"].strip() == alone["text"].strip() != ""
    assert alone["cache"] == "KvcalibCache"  # on the CPU (the static cache's own test is tests/test_multi_gpu.py)
    port, logs = _free_port(), [tmp_path / f"generate{r}.json" for r in range(2)]
    ranks = run_processes(_generate_child, [(r, 2, port, str(tiny_model_dir), str(logs[r])) for r in range(2)], logs)
    assert all(r["ok"] for r in ranks), [r.get("trace") for r in ranks]
    for r in ranks:
        assert r["ranks"] == 2 and r["text"] == alone["text"]
    assert ranks[0]["streamed"] == alone["streamed"] and ranks[1]["streamed"] == ""


def test_tensor_parallelism_refuses_in_one_line_what_it_cannot_split(tmp_path, tiny_model_dir, monkeypatch):
    """Before anything loads: outside torchrun (one process), a `make-model --weights generated` directory (its
    weights drawn at load, none on disk to read by shares), and heads the ranks cannot split evenly (the tiny
    model's 4 query and 2 KV heads over 3 ranks; 2 ranks split them)."""
    import torch.distributed as dist

    from kvcalib.errors import SettingsError
    from kvcalib.models import GENERATED, _check_tensor_parallel, load_model

    with pytest.raises(SettingsError, match="run under torchrun"):
        load_model(str(tiny_model_dir), tensor_parallel=True)
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / GENERATED).write_text("{}")
    with pytest.raises(SettingsError, match="tensor parallelism reads each rank's share"):
        _check_tensor_parallel(str(tmp_path), str(tmp_path), {"generated": True}, False)
    monkeypatch.setattr(dist, "get_world_size", lambda: 3)
    with pytest.raises(SettingsError, match="4 query and 2 KV heads, which 3 ranks cannot split evenly"):
        _check_tensor_parallel("tiny", str(tiny_model_dir), {}, False)
    monkeypatch.setattr(dist, "get_world_size", lambda: 2)
    _check_tensor_parallel("tiny", str(tiny_model_dir), {}, False)
