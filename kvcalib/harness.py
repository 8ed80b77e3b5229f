"""lm-evaluation-harness with a kvcalib cache (`kvcalib lm-eval`): any lm-eval task, the model's KV cache
replaced by a kvcalib method, artifact or plan.

    kvcalib lm-eval --method kivi --tasks niah_single_1,ruler_vt --max-lengths 4096 --limit 25
    kvcalib lm-eval --model DIR --method plan --artifacts runs/plan --tasks gsm8k --output-path runs/gsm8k.json

How each kind of request meets the cache:
- generation (`generate_until`: RULER, GSM8K, LongBench): `model.generate` with the cache a decoder holds
  (`kvcalib.generate.runtime_cache`: `StaticKvcalibCache` on a GPU where it holds the method, else
  `KvcalibCache`): the prompt attends in float16 and is compressed, then every generated token attends
  over the compressed cache. A static cache is kept for the later batches it can hold (`reused_cache`: its
  captured step too); a dynamic one is made per batch;
- loglikelihood (multiple choice, perplexity tasks): one forward per batch, each position attending over
  the cache a decoder holds there, as `kvcalib eval` scores (`kvcalib.evaluate.decode_exact`);
- `--method fp16`: lm-eval's own Hugging Face path, unchanged.

Offline (no model hub), the tasks lm-eval generates itself run (`OFFLINE_RULER`): RULER's
`niah_single_1` (a needle in a haystack of one repeated sentence), `niah_multikey_2` and
`niah_multikey_3` (haystacks of other needles), `ruler_vt` (variable tracking), `ruler_cwe` and
`ruler_fwe` (common and frequent words, from `wonderwords`' lists). They size their prompts with the
model's tokenizer, which is saved for them to a temporary directory. RULER's other tasks read Paul
Graham's essays, SQuAD or HotpotQA from the hub.
"""

from __future__ import annotations

import functools
import json
import tempfile
from pathlib import Path

from .atomic import atomic_path, ensure_writable_file
from .attention import intercept
from .errors import SettingsError
from .evaluate import decode_exact, settings_of
from .generate import runtime_cache
from .methods import Method, MethodSettings, build_method
from .models import DEFAULT_MODEL, LoadedModel, attention_shape, load_model, max_context

OFFLINE_RULER = ("niah_single_1", "niah_multikey_2", "niah_multikey_3", "ruler_vt", "ruler_cwe", "ruler_fwe")


@functools.cache
def _lm_class():
    """`KvcalibLM`, lm-eval's Hugging Face model with the cache replaced (made on first use: lm-eval is an extra)."""
    try:
        from lm_eval.models.huggingface import HFLM
    except ImportError as err:
        raise SettingsError("kvcalib lm-eval needs lm-evaluation-harness: pip install 'kvcalib[lm-eval]'") from err

    class KvcalibLM(HFLM):
        """lm-eval's `HFLM` over a loaded model, its KV cache replaced by `method` (module docstring)."""

        def __init__(self, lm: LoadedModel, method: Method, batch_size: int = 1, max_length: int | None = None):
            super().__init__(pretrained=lm.model, tokenizer=lm.tokenizer, batch_size=batch_size, max_length=max_length)
            self.loaded, self.method = lm, method
            self.static = None  # the last static cache, kept for the batches it can hold (`reused_cache`)

        def _model_generate(self, context, max_length: int, stop: list[str], **generation_kwargs):
            cache = reused_cache(self, context.shape[0], max_length)
            if cache is not None:
                generation_kwargs["past_key_values"] = cache
            return super()._model_generate(context, max_length, stop, **generation_kwargs)

        def _model_call(self, inps, attn_mask=None, labels=None):
            if self.method.name == "fp16":
                return super()._model_call(inps, attn_mask, labels)
            with intercept(self.model, decode_exact(self.method)):
                return super()._model_call(inps, attn_mask, labels)

    return KvcalibLM


def reused_cache(owner, batch: int, length: int):
    """The cache for one batch of generation requests: `owner.static`, a static cache made for an earlier
    batch, where it holds `batch` rows of `length` tokens (a new `generate` call empties its slots, and its
    captured step is kept: no capture per batch); else a new runtime cache, a static one sized for the next
    power of two of `length` (up to the model's context) and kept in `owner.static`."""
    held = owner.static
    if held is not None and held.max_batch >= batch and held.max_length >= length:
        return held
    room = max(length, min(1 << (length - 1).bit_length(), max_context(owner.loaded.config) or length))
    if held is not None:  # outgrown: its captured step's memory goes before the next one is captured
        held.close()
        owner.static = None
    cache = runtime_cache(owner.loaded, owner.method, max_batch=batch, max_length=room)
    if hasattr(cache, "max_batch"):  # StaticKvcalibCache; a KvcalibCache holds one batch's tokens only
        owner.static = cache
    return cache


def kvcalib_lm(lm: LoadedModel, method: Method, batch_size: int = 1, max_length: int | None = None):
    """An lm-eval model (`lm_eval.api.model.LM`) that decodes and scores through `method`'s cache."""
    return _lm_class()(lm, method, batch_size, max_length)


def run_tasks(tasks: list[str], model: str | LoadedModel = DEFAULT_MODEL, method: str = "fp16",
              settings: MethodSettings = MethodSettings(), artifacts: str | None = None, batch_size: int = 1,
              limit: float | None = None, max_lengths: list[int] | None = None, output_path: str | None = None,
              seed: int = 0, device: str | None = None, trust_remote_code: bool = False, dtype: str | None = None) -> dict:
    """lm-eval's `simple_evaluate` of `tasks` with the cache of `method`; its results dict, with a `kvcalib`
    entry naming the model, method and settings, written to `output_path` where given. `max_lengths`:
    the prompt lengths RULER's tasks generate (its `max_seq_lengths`, default 4096)."""
    if not tasks:
        raise SettingsError("--tasks names no task: give e.g. --tasks niah_single_1,ruler_vt")
    if batch_size < 1:
        raise SettingsError(f"--batch-size must be positive, got {batch_size}")
    if limit is not None and limit <= 0:
        raise SettingsError(f"--limit must be positive, got {limit}")
    if output_path is not None:
        ensure_writable_file(output_path, "--output-path")
    _lm_class()  # lm-eval installed: refused before the model loads
    from lm_eval.tasks import TaskManager
    from lm_eval.utils import handle_non_serializable

    known = set(TaskManager().all_tasks)
    unknown = [t for t in tasks if t not in known]
    if unknown:
        raise SettingsError(f"lm-eval has no task {', '.join(unknown)} (offline, RULER's generated tasks run: "
                            f"{', '.join(OFFLINE_RULER)})")
    lm = load_model(model, device, dtype, trust_remote_code=trust_remote_code)
    if lm.tokenizer is None:
        raise SettingsError(f"{lm.spec} has no tokenizer: lm-eval tasks are text")
    limit_tokens = max_context(lm.config)
    lengths = max_lengths or [4096]
    if limit_tokens is not None and max(lengths) > limit_tokens:
        raise SettingsError(f"--max-lengths {max(lengths)} passes the model's context of {limit_tokens} tokens")
    compressed = build_method(method, attention_shape(lm.config), settings, artifacts, lm)
    results = evaluate_tasks(kvcalib_lm(lm, compressed, batch_size), lm.tokenizer, list(tasks), limit, lengths, seed)
    results["kvcalib"] = {"model": lm.spec, "method": compressed.name, "settings": settings_of(compressed),
                          "artifacts": artifacts, "max_lengths": lengths, "limit": limit, "batch_size": batch_size}
    if output_path is not None:
        Path(output_path).parent.mkdir(parents=True, exist_ok=True)  # checked writable before any work
        with atomic_path(output_path) as tmp:
            tmp.write_text(json.dumps(results, indent=2, default=handle_non_serializable) + "\n")
    return results


def evaluate_tasks(model, tokenizer, tasks: list[str], limit: float | None, lengths: list[int], seed: int) -> dict:
    """lm-eval's `simple_evaluate` of `tasks` over `model` (an lm-eval `LM`), as `kvcalib lm-eval` runs it: RULER's
    prompts sized with `tokenizer`, saved for them to a temporary directory (they take it by path), at `lengths`,
    and one seed for every generator."""
    from lm_eval import simple_evaluate

    with tempfile.TemporaryDirectory(prefix="kvcalib-tokenizer-") as tokenizer_dir:
        tokenizer.save_pretrained(tokenizer_dir)
        return simple_evaluate(model=model, tasks=tasks, limit=limit,
                               metadata={"tokenizer": tokenizer_dir, "max_seq_lengths": lengths},
                               random_seed=seed, numpy_random_seed=seed, torch_random_seed=seed,
                               fewshot_random_seed=seed)


def score_table(results: dict) -> str:
    """A markdown table of every task's metrics (lm-eval's own layout)."""
    from lm_eval.utils import make_table

    return make_table(results)
