"""Decode steps over a `StaticKvcalibCache` replayed from one captured CUDA graph.

    decoder = CapturedDecoder(model, cache)   # warms up and captures the step for the cache's batch
    logits = decoder.step(tokens)             # (B,) each slot's newest token -> (B, vocab) float
    CapturedDecoder(model, cache, compile="step")  # the whole step compiled by torch.compile, then captured

How much of the step torch.compile sees (`compile`, the cache's `compile` unless given; `COMPILE_MODES`):
- `"regions"` (the cache's default): the model's small ops, where eager launches cost most and Inductor
  compiles least: each decoder layer but its attention module (norms, residual adds, MLP), the final norm,
  the norms the attention applies to its heads (Qwen3's, Gemma 3's), the rotary embedding's application, the
  cache's append of the step's token and a kept sliding layer's ring (`_Regions`). One compiled region serves
  every layer (its parameters and buffers are inputs), so the first call compiles a few small graphs (five for
  Llama), seconds, not the whole model's minutes. The masked flush and the fused attention stay eager;
- `"step"` (or True): the whole step, below (compiled once for each kind of step, `CapturedDecoder._kinds`);
- `"none"` (or False): nothing compiled.

The step is the model's forward on one token per slot, at each slot's own position (read from the
cache's device counts inside the graph), with the cache's append, masked flush and fused attention in
it: nothing in it depends on a host value that changes between steps but whether a window fills,
which the host knows (`StaticKvcalibCache.advance`): the step with its masked flush of every slot, with that of
the one slot whose window fills (a batch of several: its slot read on the device) and the step that appends only,
captured each, serve every position. `Decoder` runs the same step eagerly, and so does `step(..., captured=False)` (the tests compare).
Capturing needs a warm-up run, which appends a token: the counts (and a decoding state, KVLinC's) are restored after it, and what it
wrote lies past them, where the next real step overwrites it.

`compile=True` runs the step through `torch.compile(fullgraph=True)` first: Inductor fuses the model's
non-attention ops (norms, rotary, MLP activations, residual adds) and the cache's append and masked
flush (traced as torch ops, `kvcalib.quant.quantize`), and the fused attention stays one opaque
custom op (`torch.ops.kvcalib.int2_decode`). The compiled step is then captured like the eager one,
in the decoder's own graph rather than by `mode="reduce-overhead"`: one graph for the whole step,
with the warm-up and restore above, and no copies of the cache buffers into a graph pool. Inductor
rounds as the eager step does (`compile_options`), so the flushed codes equal
the eager step's bit for bit for the same float16 tokens; its fused kernels (RMSNorm's reduction among
them) order their float32 sums differently from eager's, so the model's float16 activations, and through
them the logits, differ from the eager step's by float16 round-off: on an H100, 1.5 float16 ulps of
the largest logit at most over 50 steps with flushes (tests/test_static_cache_gpu.py holds it to 4).

`generate` serves a list of prompts through the slots: each prompt prefilled alone into a free slot,
greedy steps for the whole batch, a finished sequence's slot refilled with the next prompt.
"""

from __future__ import annotations

import contextlib
import gc
import sys
import threading

import torch

from ..errors import SettingsError
from ..models import attention_modules
from .cache import tensor_parallel_size



def compile_options() -> dict[str, bool]:
    """Inductor options under which the compiled step rounds as the eager one does: to float16 wherever
    the eager ops do (by default Inductor may skip a round trip such as `lo.half().float()`), and float32
    divisions correctly rounded (Triton's `/` is approximate); either moves a quantization code across
    a rounding boundary now and then. The division switch is named by torch's version."""
    from torch._inductor import config

    options = {"emulate_precision_casts": True}
    if hasattr(config, "eager_numerics"):
        options["eager_numerics.division_rounding"] = True
    elif hasattr(config, "emulate_divison_rounding"):  # torch 2.10's spelling
        options["emulate_divison_rounding"] = True
    return options


COMPILE_MODES = ("regions", "step", "none")


def compile_mode(compile: bool | str) -> str:
    """One of `COMPILE_MODES` (True is "step", False "none"); anything else is refused in one line."""
    mode = "step" if compile is True else "none" if compile is False else compile
    if mode not in COMPILE_MODES:
        raise SettingsError(f"compile must be one of {', '.join(COMPILE_MODES)} (or True, False), got {compile!r}")
    return mode


_OPEN = threading.RLock()  # held while regions are switched in: one set at a time in the process
_DEPTH = [0]  # how deep the switched-in regions are entered: only the outermost switches and puts back


class _Regions:
    """The step's compiled regions, each run by its compiled code while the context is open (`with regions:`),
    eagerly otherwise (module docstring):
    - each decoder layer (`torch.compile` of its call, kept beside it and switched in:
      `nn.Module._compiled_call_impl`, whatever was there put back after) and the final norm. The layer's
      attention module runs eagerly inside it (its `forward` under `torch._dynamo.disable` while open), so a
      layer compiles as two graphs, before and after its attention: the input norm; the residual add, the
      post-attention norm, the MLP and the last residual add;
    - inside the eager attention, the norms it applies to its heads (`_attention_norms`: Qwen3's and Gemma 3's
      `q_norm`, `k_norm`, switched in as the layers are), the rotary application (its module's
      `apply_rotary_pos_emb`, where it defines one), the cache's append (`slots.write_token`) and a kept sliding
      layer's ring write and attention (`slots.write_ring`, `slots.ring_attention`), each swapped for its
      compiled form.
    - on a GPU, in every compile mode (`compiled=False`: this alone): `nn.Linear.forward`, switched to
      `gemv_kernel`'s, whose kernel computes a one-row step's weight products (most of a B = 1 step's time)
      faster than cuBLAS; torch.compile traces it where it traces a layer.
    Regional compilation: the layers share their code, so one compiled graph per kind serves them all
    (tests/test_static_cache_gpu.py counts them). The attention module stays out because its code reads its
    layer's index (`past_key_values.update(..., self.layer_idx)`): compiled, every layer would be a graph.
    The rotary, append and `nn.Linear` swaps are module-wide, so one set of regions is open at a time in the
    process (a lock); entered again while open, nothing more is switched, and the outermost exit puts
    everything back, also where switching in failed half-way."""

    def __init__(self, model, compiled: bool = True):
        """`compiled`: the regions above; without, only the weight products are switched (`gemv_kernel`)."""
        from . import gemv_kernel, slots

        options = dict(dynamic=False, options=compile_options())
        self.modules, self.attention, self.compiled, self.swaps = [], [], [], []
        if compiled:
            layers, self.attention = _decoder_layers(model)
            self.modules = list(layers)
            norm = getattr(getattr(model, "model", model), "norm", None)
            if isinstance(norm, torch.nn.Module):
                self.modules.append(norm)
            self.modules += _attention_norms(self.attention)
            self.compiled = [torch.compile(m._call_impl, **options) for m in self.modules]
            home = sys.modules.get(type(self.attention[0]).__module__) if self.attention else None
            swaps = [(home, "apply_rotary_pos_emb"), (slots, "write_token"), (slots, "write_ring"),
                     (slots, "ring_attention")]
            eager = [(where, name, _eager(getattr(where, name, None))) for where, name in swaps]
            self.swaps = [(where, name, fn, torch.compile(fn, **options)) for where, name, fn in eager if callable(fn)]
        if _linears_for_the_kernel(model):
            self.swaps.append((torch.nn.Linear, "forward", gemv_kernel.EAGER_FORWARD, gemv_kernel.FAST_FORWARD))
        self._saved: list = []

    def __enter__(self):
        _OPEN.acquire()
        _DEPTH[0] += 1
        if _DEPTH[0] > 1:
            return
        try:
            for m, fast in zip(self.modules, self.compiled):
                self._saved.append((m, "_compiled_call_impl", m.__dict__.get("_compiled_call_impl")))
                m._compiled_call_impl = fast
            for a in self.attention:  # an instance's own forward (accelerate's hooks set one) is kept and put back
                self._saved.append((a, "forward", a.__dict__.get("forward")))
                a.forward = torch._dynamo.disable(a.forward)
            for where, name, eager, fast in self.swaps:  # put back what is there now, unless it is a switched form
                now = getattr(where, name)
                self._saved.append((where, name, eager if now is fast or _eager(now) is not now else now))
                setattr(where, name, fast)
        except BaseException:
            self.__exit__()
            raise

    def __exit__(self, *exc):
        try:
            if _DEPTH[0] == 1:
                while self._saved:
                    owner, name, old = self._saved.pop()
                    if old is None and name == "forward":
                        owner.__dict__.pop("forward", None)
                    else:
                        setattr(owner, name, old)
        finally:
            _DEPTH[0] -= 1
            _OPEN.release()


def _eager(fn):
    """A function as it was before torch.compile wrapped it (a compiled form left in place is never taken for
    the eager one)."""
    return getattr(fn, "_torchdynamo_orig_callable", fn)


def _linears_for_the_kernel(model) -> bool:
    """Whether the step may switch `nn.Linear.forward` to the weight products' kernel: the model lies on a GPU
    and every `nn.Linear`'s weight is a plain tensor. A tensor subclass (a DTensor under tensor parallelism, a
    quantized weight that reports float16) holds no dense rows the kernel could read, and the check is made
    here, once, rather than in the switched forward, which torch.compile traces."""
    first = next(model.parameters(), None)
    if first is None or not first.is_cuda:
        return False
    plain = (torch.Tensor, torch.nn.Parameter)
    return all(type(m.weight) in plain for m in model.modules() if isinstance(m, torch.nn.Linear))


def _attention_norms(attention: list[torch.nn.Module]) -> list[torch.nn.Module]:
    """The norms an attention module applies to its heads (Qwen3's and Gemma 3's `q_norm` and `k_norm`): its
    children named for a norm that hold no module of their own. Run eagerly inside the attention they would launch
    each of their float32 casts, reductions and products as a kernel of its own, twice a layer."""
    return [child for a in attention for name, child in a.named_children()
            if "norm" in name.lower() and not any(True for _ in child.children())]


def _decoder_layers(model) -> tuple[list[torch.nn.Module], list[torch.nn.Module]]:
    """The model's decoder layers and their attention modules: of the modules that name their layer and hold
    weights (`models.attention_modules`), those holding no other such module (in Gemma 3 and Llama 4 the decoder
    layer names its layer too), and the modules whose children they are."""
    named = attention_modules(model)
    ids = {id(a) for a in named}
    attention = [a for a in named if not any(id(m) in ids for m in a.modules() if m is not a)]
    inner = {id(a) for a in attention}
    layers = [m for m in model.modules() if any(id(c) in inner for c in m.children())]
    return layers, attention


class Decoder:
    """One decode step over a `StaticKvcalibCache`, run eagerly, with its regions compiled or the whole
    step compiled (`compile`: module docstring); `CapturedDecoder` replays it from a graph."""

    def __init__(self, model, cache: StaticKvcalibCache, compile: bool | str | None = None):
        self.model, self.cache = model, cache
        self.mode = compile_mode(cache.compile if compile is None else compile)
        device = cache.device
        self.ids = torch.zeros(cache.max_batch, 1, dtype=torch.long, device=device)
        self.positions = torch.zeros(cache.max_batch, 1, dtype=torch.long, device=device)
        self._run = (torch.compile(self._forward, fullgraph=True, dynamic=False, options=compile_options())
                     if self.mode == "step" else self._forward)  # compiled for each kind of step (`_kinds`)
        regions = _Regions(model, compiled=self.mode == "regions")  # nothing to switch: no lock to take
        self._regions = regions if regions.modules or regions.swaps else contextlib.nullcontext()
        cache.read_counts()

    def _forward(self) -> torch.Tensor:
        self.positions.copy_(self.cache.positions())
        out = self.model(self.ids, position_ids=self.positions, cache_position=self.positions[0],
                         past_key_values=self.cache, use_cache=True)
        return out.logits[:, -1]

    def _call(self) -> torch.Tensor:
        """The step (compiled or not) as the model's own forward, not routed to the cache (`route_forward`)."""
        with torch.no_grad(), self._regions:
            return self.cache.run_direct(self._run)

    def _take(self, tokens: torch.Tensor) -> None:
        self.cache.advance()
        self.ids.copy_(tokens.view(-1, 1))

    def close(self) -> None:
        """Release what the step holds beyond the cache (`CapturedDecoder`: its graphs); an eager step holds nothing."""

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        """Append `tokens` (B,) at every slot and return the next-token logits (B, vocab)."""
        self._take(tokens)
        return self._call()


@contextlib.contextmanager
def _no_collection():
    """Dead reference cycles (an earlier decoder and its graphs, a model and its routed forward) collected
    first, and no collection inside: a graph freed while another is being captured can break that capture."""
    gc.collect()
    collecting = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if collecting:
            gc.enable()


class CapturedDecoder(Decoder):
    """`Decoder`'s step captured in CUDA graphs (its regions or the whole step compiled first, `compile`: the
    warm-up runs compile them), one for each kind of step (`_kinds`), and replayed at every step."""

    def __init__(self, model, cache: StaticKvcalibCache, warmup: int = 2, compile: bool | str | None = None):
        super().__init__(model, cache, compile)
        device = self.ids.device
        saved = [[t.clone() for t in layer.mutable()] for layer in cache.layers]  # counts, KVLinC's state
        # Under tensor parallelism the step holds NCCL collectives, whose communicator threads may call CUDA while
        # this thread captures: only this thread's calls are refused then (as transformers captures its own).
        mode = "thread_local" if tensor_parallel_size(model) > 1 else "global"
        self.graphs: dict[tuple[bool, bool], torch.cuda.CUDAGraph] = {}  # by (flush, one): `_kinds`
        self.outputs: dict[tuple[bool, bool], torch.Tensor] = {}
        try:
            for kind in self._kinds():  # each in its own memory pool: they replay in any order
                self._set_flush(*kind)
                side = torch.cuda.Stream(device)
                side.wait_stream(torch.cuda.current_stream(device))
                with torch.cuda.stream(side):
                    for _ in range(warmup):
                        self._call()
                        self._restore(saved)
                torch.cuda.current_stream(device).wait_stream(side)
                self.graphs[kind] = torch.cuda.CUDAGraph()
                with _no_collection(), torch.cuda.graph(self.graphs[kind], capture_error_mode=mode):
                    self.outputs[kind] = self._call()
                self._restore(saved)  # capture records, it does not run: nothing moved, this is only a guard
        except BaseException:
            self.close()  # a graph already captured goes now: no one holds this decoder to close it later
            raise
        self._set_flush(True, False)

    def _kinds(self) -> list[tuple[bool, bool]]:
        """The steps captured, (flush, one) as `StaticKvcalibCache.advance` sets them: the masked flush of every
        slot, of one slot (where there are several), and the append alone."""
        return [(True, False)] + [(True, True)] * (self.cache.max_batch > 1) + [(False, False)]

    def _set_flush(self, flush: bool, one: bool) -> None:
        for layer in self.cache.layers:
            layer.flush, layer.one = flush, one

    def _restore(self, saved) -> None:
        for layer, tensors in zip(self.cache.layers, saved):
            for t, old in zip(layer.mutable(), tensors):
                t.copy_(old)

    def step(self, tokens: torch.Tensor, captured: bool = True) -> torch.Tensor:
        """As `Decoder.step`, replayed from the graph: the logits are the graph's output buffer
        (overwritten by the next step: clone to keep them). `captured=False` runs the step eagerly."""
        if not captured:
            return super().step(tokens)
        if not self.graphs:
            raise SettingsError("this captured step was closed: capture a new one (CapturedDecoder(model, cache))")
        self._take(tokens)
        kind = (self.cache.layers[0].flush, self.cache.layers[0].one)
        self.graphs[kind].replay()
        return self.outputs[kind]

    def close(self) -> None:
        """Free the captured graphs (and their memory pools' hold on the outputs); a later `step` refuses.
        Under tensor parallelism a live graph holding NCCL collectives keeps `destroy_process_group` from
        destroying the communicator (it waits forever), so a rank must close its graphs first."""
        for graph in self.graphs.values():
            graph.reset()
        self.graphs.clear()
        self.outputs.clear()


def generate(model, cache: StaticKvcalibCache, prompts: list[torch.Tensor], max_new_tokens: int,
             captured: bool = True, compile: bool | str | None = None) -> list[list[int]]:
    """Greedy continuations of `prompts` ((T,) token ids each), `max_new_tokens` each, served through
    the cache's slots: a finished sequence leaves its slot and the next prompt is prefilled into it.
    `captured`, `compile`: the decode step replayed from a CUDA graph, compiled (`Decoder`; the cache's own
    `compile` unless given), the step `model.generate` replays."""
    if max_new_tokens < 1:
        raise SettingsError(f"max_new_tokens must be positive, got {max_new_tokens}")
    device = cache.device
    decoder = CapturedDecoder(model, cache, compile=compile) if captured else Decoder(model, cache, compile)
    queue = list(enumerate(prompts))
    out: list[list[int]] = [[] for _ in prompts]
    live: dict[int, int] = {}  # slot -> prompt index
    nxt = torch.zeros(cache.max_batch, dtype=torch.long, device=device)

    def fill(slot: int) -> None:
        """The next prompts into `slot` until one needs decode steps (or none is left)."""
        while queue:
            i, prompt = queue.pop(0)
            first = int(cache.prefill(model, slot, prompt.view(1, -1).to(device)).argmax())
            nxt[slot] = first
            out[i].append(first)
            if max_new_tokens > 1:
                live[slot] = i
                return
            cache.release(slot)

    try:
        for slot in range(cache.max_batch):
            fill(slot)
        while live:
            nxt = decoder.step(nxt).argmax(-1)
            tokens = nxt.tolist()  # one transfer a step, not one a slot
            for slot, i in list(live.items()):
                out[i].append(tokens[slot])
                if len(out[i]) == max_new_tokens:
                    del live[slot]
                    cache.release(slot)
                    fill(slot)
    finally:
        decoder.close()  # its graphs go now, not at some later garbage collection (`CapturedDecoder.close`)
    return out
