"""Two GPUs of one host: every CuPy kernel on the second GPU while the first is current, `eval` and both
runtime caches on a model whose layers are split over the two GPUs (accelerate's dispatch, as
`--device-map auto` places a model larger than one GPU), and data-parallel `collect` with one process
per GPU. Each is held to the one-GPU result bit for bit: both GPUs are the same card, so the same
kernels run on the same inputs; only where the tensors live differs."""

from __future__ import annotations

import copy

import pytest
import torch

if torch.cuda.device_count() < 2:
    pytest.skip("fewer than two CUDA devices: these tests put a model's layers and the kernels' tensors on a second GPU",
                allow_module_level=True)
cupy = pytest.importorskip("cupy", reason="the CuPy kernels need cupy (pip install kvcalib[cuda13] or [cuda12])")

import test_int2_kernel_gpu as int2_tests  # noqa: E402
import test_quantize_gpu as quantize_tests  # noqa: E402
import test_vq_kernel_gpu as vq_tests  # noqa: E402
from conftest import tiny_model  # noqa: E402
from test_runtime_cache import _kvlinc_with_adapters, _method, _plan, _vecinfer_with_sinks  # noqa: E402

from kvcalib.methods import MethodSettings, build_method  # noqa: E402
from kvcalib.models import LoadedModel, attention_shape, layer_devices  # noqa: E402

SECOND = "cuda:1"


@pytest.fixture
def on_second_gpu(monkeypatch):
    """The kernel tests' tensors on cuda:1 while cuda:0 stays current; after the test, both torch and
    CuPy still name cuda:0 current (a launch that switched devices switched back)."""
    torch.cuda.set_device(0)
    for module in (int2_tests, vq_tests):
        monkeypatch.setattr(module, "DEV", SECOND)
    yield
    assert torch.cuda.current_device() == 0 and cupy.cuda.runtime.getDevice() == 0


@pytest.mark.parametrize("bits,axis", [(2, "tokens"), (2, "channels"), (3, "tokens")])
def test_quantize_on_the_second_gpu_equals_torch(on_second_gpu, bits, axis):
    x = torch.randn(2, 3, 256, 64, device=SECOND)
    got = quantize_tests._same(x, bits, 32, axis)
    assert got.codes.device == torch.device(SECOND)


def test_reorder_on_the_second_gpu_equals_the_cpu(on_second_gpu):
    from kvcalib.formats.int2.layout import reorder_packed

    keys = torch.randint(-2**31, 2**31 - 1, (2, 2, 4, 64), dtype=torch.int32)  # (.., T/16, D) packed along tokens
    values = torch.randint(-2**31, 2**31 - 1, (2, 2, 64, 4), dtype=torch.int32)  # (.., T, D/16) along channels
    for words, which in ((keys, "k"), (values, "v")):
        got = reorder_packed(words.to(SECOND), which)
        assert got.device == torch.device(SECOND) and torch.equal(got.cpu(), reorder_packed(words, which)), which


@pytest.mark.parametrize("loader", ["auto", "cp.async"])
def test_int2_decode_on_the_second_gpu_matches_the_float64_reference(on_second_gpu, loader):
    int2_tests.test_fused_kivi_decode_matches_float64_reference(128, 4, 4224, 77, 3, torch.float16, loader)
    int2_tests.test_blocks_stored_in_the_hadamard_basis_are_read_in_it(128, 3, (True, True), torch.float16, 4224, 77)
    int2_tests.test_rows_with_device_counts_each_split_their_own_length_over_the_launch(32, True)


def test_vq_decode_on_the_second_gpu_matches_the_float64_reference(on_second_gpu):
    vq_tests.test_vq_kernel_matches_the_float64_reference_row_by_row("head", "d4b8", "d4b8", 3, 1037)
    vq_tests.test_vq_kernel_matches_the_float64_reference_row_by_row("layer", "d8b12", "d4b8", 0, 130)


def _models():
    """A 4-layer float16 model on cuda:0, and the same weights with layers 0-1 on cuda:0 and 2-3 (with the
    final norm and the head) on cuda:1."""
    from accelerate import dispatch_model

    one = tiny_model("llama", seed=5, head_dim=64, hidden_size=256, num_attention_heads=4, num_key_value_heads=2,
                     num_hidden_layers=4).half().to("cuda:0")
    placement = {"model.embed_tokens": 0, "model.rotary_emb": 0, "model.norm": 1, "lm_head": 1}
    placement |= {f"model.layers.{i}": 0 if i < 2 else 1 for i in range(4)}
    split = dispatch_model(copy.deepcopy(one), device_map=placement)
    assert [d.index for d in layer_devices(split, 4)] == [0, 0, 1, 1]
    return one, split


def _runtime_method(cache_class: str, name: str, shape):
    """The GPU tests' methods: adapters and codebooks built on the CPU (as an artifact loads them) for
    KvcalibCache, on cuda:0 for the static cache (tests/test_static_cache_gpu.py); either way a layer on
    cuda:1 takes its own copy."""
    if cache_class == "StaticKvcalibCache":
        from test_static_cache_gpu import _method as static_method

        return static_method(name, shape)
    if name == "kvlinc+adapters":
        return _kvlinc_with_adapters(shape, 16, 32)
    if name == "vecinfer+sinks":
        return _vecinfer_with_sinks(shape, 3, 32)
    return build_method(name, shape, MethodSettings(bits=2, group_size=16, residual=32))  # key groups >= 16: fused


def _generate(model, cache, ids, mask):
    model.generation_config.eos_token_id = None  # random weights: decode every step, whatever is drawn
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, past_key_values=cache, max_new_tokens=40, do_sample=False,
                             pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    return out.sequences.cpu(), torch.stack(out.logits, 1).cpu()


def _padded_batch():
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(1, 512, (n,), generator=gen) for n in (70, 37, 5)]
    ids = torch.zeros(3, 70, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, p in enumerate(prompts):
        ids[b, 70 - len(p):], mask[b, 70 - len(p):] = p, 1
    return ids.to("cuda:0"), mask.to("cuda:0")


@pytest.mark.parametrize("cache_class,name", [
    *[("KvcalibCache", n) for n in ("kivi", "kvlinc+adapters", "oscar", "vecinfer+sinks")],
    *[("StaticKvcalibCache", n) for n in ("kivi", "oscar", "kvlinc", "kvlinc-oscar", "vecinfer")]])  # what each holds
def test_runtime_caches_on_a_model_split_over_two_gpus_decode_as_on_one(cache_class, name):
    """`model.generate` through each runtime cache: every layer's cache lives on its layer's GPU and runs its
    kernels there, giving the one-GPU tokens and logits bit for bit (the static cache's step runs
    uncaptured when the layers span GPUs, the same kernels as the captured one)."""
    from kvcalib.runtime.cache import KvcalibCache
    from kvcalib.runtime.static_cache import StaticKvcalibCache

    one, split = _models()
    shape = attention_shape(one.config)
    ids, mask = _padded_batch()
    runs = []
    for model in (one, split):
        lm = LoadedModel(model=model, tokenizer=None, spec="tiny")
        method = _runtime_method(cache_class, name, shape)
        cache = (KvcalibCache(lm, method) if cache_class == "KvcalibCache"
                 else StaticKvcalibCache(lm, method, max_batch=3, max_length=128))
        runs.append(_generate(model, cache, ids, mask))
        if cache_class == "StaticKvcalibCache":
            assert [layer.flushed.device for layer in cache.layers] == layer_devices(model, 4)
    (tokens1, logits1), (tokens2, logits2) = runs
    assert torch.equal(tokens1, tokens2)
    assert torch.equal(logits1, logits2), (logits1 - logits2).abs().max()


@pytest.mark.parametrize("name", ["fp16", "kivi", "kvlinc+adapters", "oscar", "turboquant", "vecinfer+sinks", "plan"])
def test_eval_of_a_model_split_over_two_gpus_scores_as_on_one(name, tokenizer, text_file, monkeypatch):
    """`kvcalib eval` (the scoring loop, each layer's compression on its layer's GPU) gives the one-GPU
    perplexity, effective bits and per-layer attention errors exactly."""
    import kvcalib.evaluate as evaluate

    one, split = _models()
    shape = attention_shape(one.config)
    monkeypatch.setattr(evaluate, "build_method", lambda *a, **k: _method(name, shape))
    results = [evaluate.evaluate(LoadedModel(model=m, tokenizer=tokenizer, spec="tiny"), dataset=str(text_file),
                                 num_samples=3, seq_len=128, method=name.split("+")[0]) for m in (one, split)]
    a, b = (r.to_json() for r in results)
    for key in ("perplexity", "effective_bits", "tokens", "per_layer_attention_rel_error", "bits_breakdown"):
        assert a[key] == b[key], (key, a[key], b[key])


def test_data_parallel_collect_on_two_gpus_writes_the_bytes_one_gpu_writes(tmp_path, tiny_model_dir, text_file):
    """`torchrun --nproc-per-node 2 -m kvcalib collect --device cuda`: each rank records its share of the
    chunks on its own GPU; the directory equals the one-process run's byte for byte (the same float16
    forward of each sample on the same card)."""
    from test_parallel import _files, _run

    one = _run(1, tiny_model_dir, text_file, tmp_path / "one", tmp_path, device="cuda")
    assert one[0]["ok"], one[0]
    two = _run(2, tiny_model_dir, text_file, tmp_path / "two", tmp_path, device="cuda")
    assert all(r["ok"] for r in two), two
    assert [r["shares"] for r in two] == [[[0, 2]], [[1]]]
    a, b = _files(tmp_path / "one"), _files(tmp_path / "two")
    assert sorted(a) == sorted(b) and len(a) > 3
    differ = [n for n in a if a[n] != b[n] and n != "run.json"]
    assert not differ, f"files differ between one GPU and two: {differ}"


def _head_spec(plan, layer: int, head: int):
    """How the plan codes one KV head of a layer: its group's spec sliced to that head."""
    for group in plan.codebook_groups(layer):
        heads = group.heads or tuple(range(plan.shape.num_kv_heads))
        if head in heads:
            pos = [heads.index(head)]
            return type(group.spec)(group.spec.key.heads(pos), group.spec.value.heads(pos))
    raise AssertionError(f"layer {layer} has no group holding head {head}")


def _same_coding(held, spec) -> bool:
    """Whether a static layer's group codes as `spec` does: widths, layouts, books and bases."""
    def part(a, b) -> bool:
        same = (a.bits, a.dim, a.norm, a.token_group, a.channel_group) == (b.bits, b.dim, b.norm, b.token_group,
                                                                          b.channel_group)
        bases = (a.basis is None) == (b.basis is None) and (a.basis is None or torch.equal(a.basis.cpu(), b.basis.cpu()))
        return same and bases and a.book.shape == b.book.shape and torch.equal(a.book.cpu(), b.book.cpu())

    return part(held.key, spec.key) and part(held.value, spec.value)


def _tp_static_child(rank: int, size: int, port: int, model_dir: str, log: str) -> None:
    """One rank of `torchrun --nproc-per-node 2`: the model under transformers' tensor parallelism on cuda:<rank>
    (NCCL), its static cache's greedy tokens through kvcalib's serving loop, captured and eager (nothing compiled:
    the capture is what is under test), and through `model.generate` with the cache as made by default (its
    regions compiled); then a plan's static cache, eager and captured, and how its layers code their head (for
    each of the model's two KV heads: whether the rank's layer codes as the plan codes that head). Each stage is
    noted beside the log (`test_parallel.reached`)."""
    from test_parallel import as_rank, reached

    def work() -> dict:
        from transformers import AutoModelForCausalLM

        from kvcalib.runtime.captured import CapturedDecoder, generate
        from kvcalib.runtime.static_cache import StaticKvcalibCache

        torch.cuda.set_device(rank)
        reached(log, "started")
        from transformers.distributed import DistributedConfig

        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float16,
                                                     distributed_config=DistributedConfig(tp_plan="auto")).eval()
        model.generation_config.eos_token_id = None
        reached(log, "model loaded under tp_plan=auto")
        lm = LoadedModel(model=model, tokenizer=None, spec="tiny")
        gen = torch.Generator().manual_seed(4)
        prompts = [torch.randint(1, 512, (n,), generator=gen).to(f"cuda:{rank}") for n in (37, 20, 51)]
        settings = MethodSettings(bits=2, group_size=16, residual=16)
        served = {}
        for captured in (False, True):
            cache = StaticKvcalibCache(lm, "kivi", settings, max_batch=2, max_length=128, compile="none")
            served[captured] = generate(model, cache, prompts, max_new_tokens=30, captured=captured)
            reached(log, f"served, {'captured' if captured else 'eager'}")
        cache = StaticKvcalibCache(lm, "kivi", settings, max_batch=1, max_length=128)
        with torch.no_grad():
            out = model.generate(prompts[0][None], past_key_values=cache, max_new_tokens=30, do_sample=False)
        reached(log, "model.generate, regions compiled")
        captured_in_generate = isinstance(cache.decoder, CapturedDecoder)
        cache.close()  # before as_rank destroys the process group, which waits forever on a live graph's collectives
        reached(log, "closed")
        heads = cache.layers[0].layout.kres.shape[1]
        # a plan mixing every family per KV head, each head its own codebooks: the rank serves its own head's
        plan = _plan(attention_shape(model.config), 16, "head")
        plan_served, holds = {}, {}
        for captured in (False, True):
            cache = StaticKvcalibCache(lm, plan, max_batch=2, max_length=128, compile="none")
            plan_served[captured] = generate(model, cache, prompts, max_new_tokens=30, captured=captured)
            holds = {head: [_same_coding(layer.layout.groups[0].spec, _head_spec(plan, i, head))
                            for i, layer in enumerate(cache.layers)] for head in (0, 1)}
            cache.close()
            reached(log, f"plan served, {'captured' if captured else 'eager'}")
        return {"heads": heads, "served": served[True], "eager": served[False],
                "generate": out[0, 37:].tolist(), "captured_in_generate": captured_in_generate,
                "plan_served": plan_served[True], "plan_eager": plan_served[False], "plan_holds": holds}

    as_rank(rank, size, port, log, work)


def test_the_static_cache_under_tensor_parallelism_holds_each_ranks_heads_and_replays_its_captured_step(tmp_path,
                                                                                                      monkeypatch):
    """Two ranks (transformers' `tp_plan="auto"`, NCCL), each holding one of the model's two KV heads in its static
    cache. Each rank captures its own step, the all-reduces of the row-split projections inside the graph: the
    captured step's greedy tokens equal the eager step's on both ranks (the same kernels and collectives on the
    same inputs, as on one GPU: tests/test_static_cache_gpu.py), the ranks agree (every rank gets the all-reduced
    logits), and `model.generate` replays the captured step. The compiled regions of `model.generate`'s cache are
    held only to the ranks agreeing and 30 tokens (compiled code rounds otherwise than eager). Not compared with one
    process: the row-split sums round differently in float16, and a 2-bit code may flip with them."""
    import test_parallel
    from test_parallel import _free_port, run_processes

    monkeypatch.setattr(test_parallel, "TIMEOUT", 600)  # each rank compiles one cache's regions, cold
    model_dir = tmp_path / "model"
    tiny_model("llama", seed=5, head_dim=64, hidden_size=256, num_attention_heads=4, num_key_value_heads=2,
               num_hidden_layers=2).half().save_pretrained(model_dir)
    port, logs = _free_port(), [tmp_path / f"rank{r}.json" for r in range(2)]
    ranks = run_processes(_tp_static_child, [(r, 2, port, str(model_dir), str(logs[r])) for r in range(2)], logs)
    assert all(r["ok"] for r in ranks), [r.get("trace") for r in ranks]
    for r in ranks:
        assert r["heads"] == 1 and r["captured_in_generate"]
        assert r["served"] == r["eager"] and [len(t) for t in r["served"]] == [30, 30, 30]
        assert len(r["generate"]) == 30
    assert ranks[0]["served"] == ranks[1]["served"] and ranks[0]["generate"] == ranks[1]["generate"]
    # the plan: captured as eager, the ranks agreeing; rank r's layers code as the plan codes head r, and not as it
    # codes the other head (the planted error: a rank holding the other rank's part): in both layers of this model
    # the plan gives its two heads other schemes (`_plan`), and per-head books besides
    for rank, r in enumerate(ranks):
        holds = {int(h): v for h, v in r["plan_holds"].items()}
        assert r["plan_served"] == r["plan_eager"] and [len(t) for t in r["plan_served"]] == [30, 30, 30]
        assert all(holds[rank]), holds
        assert not any(holds[1 - rank]), holds
    assert ranks[0]["plan_served"] == ranks[1]["plan_served"]


def test_kvcalib_generate_under_torchrun_serves_the_static_cache_split_over_two_gpus(tmp_path, tokenizer, monkeypatch):
    """`torchrun --nproc-per-node 2 -m kvcalib generate ...` on two GPUs: each rank loads its share of the heads
    (tensor parallelism), serves `StaticKvcalibCache` (its step captured, the all-reduces inside), and the ranks
    write one text: rank 0 streams it, both return the same (every rank gets the all-reduced logits). Both ranks
    end: `generate` closes the cache before the process group goes (a live graph's collectives would hold it;
    `run_processes` fails a rank that does not end). Not compared with one process: float16's row-split sums round
    differently (test above)."""
    import test_parallel
    from test_parallel import _free_port, run_processes
    from test_tensor_parallel import _generate_child

    monkeypatch.setattr(test_parallel, "TIMEOUT", 600)  # each rank compiles the cache's regions, cold
    model_dir = tmp_path / "model"
    tiny_model("llama", seed=5, head_dim=64, hidden_size=256, num_attention_heads=4, num_key_value_heads=2,
               num_hidden_layers=2).half().save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    port, logs = _free_port(), [tmp_path / f"generate{r}.json" for r in range(2)]
    ranks = run_processes(_generate_child, [(r, 2, port, str(model_dir), str(logs[r]), "cuda") for r in range(2)],
                          logs)
    assert all(r["ok"] for r in ranks), [r.get("trace") for r in ranks]
    for r in ranks:
        assert r["ranks"] == 2 and r["cache"] == "StaticKvcalibCache"
    assert ranks[0]["text"] == ranks[1]["text"] != ""
    assert ranks[0]["streamed"].strip() == ranks[0]["text"].strip() and ranks[1]["streamed"] == ""
