"""The `kvcalib` command. Each command parses its options and calls the library function of the
same name; errors a user can cause come out as one line on stderr and exit code 2."""

from __future__ import annotations

import logging
import signal
import sys

import click

from .errors import KvcalibError
from .defaults import (DEFAULTS, DTYPE_CHOICES, KMEANS, KVLINC_KEYS, PLAN_ANCHOR, PLAN_CANDIDATES, PLAN_ITEM, PLAN_ITEMS,
                       PLAN_SINK_TOKENS, RESIDUAL_MODES, SLIDING_LAYERS)

DEFAULT_MODEL = "smollm2-135m"
DEFAULT_DATASET = "pydoc"

# What each command's GPU memory grows with: the option an out-of-memory error tells the user to lower.
_MEMORY_OPTIONS = {
    "collect": "--seq-len (one sample runs at a time)",
    "eval": "--seq-len (one window runs at a time)",
    "plan": "--seq-len or --windows",
    "train-adapters": "--tokens or --rank",
    "fit-codebook": "--max-points-per-centroid",
    "fit-turboquant": "the collection's size (--num-samples or --max-tokens when collecting)",
    "diagnose": "--max-samples",
    "run": "the recipe's seq_len or num_samples",
    "generate": "--max-new-tokens or the prompt's length",
}


def _device(fn):
    """--device: where a command computes."""
    return click.option("--device", default="auto", show_default=True,
                        help="auto (CUDA where torch sees a GPU, else the CPU), cpu, cuda or cuda:N.")(fn)


def _trust_remote_code(fn):
    """The options of a command that loads a model: --trust-remote-code, --device and --dtype."""
    fn = _device(fn)
    fn = click.option("--dtype", type=click.Choice(DTYPE_CHOICES), default="auto", show_default=True,
                      help="The model's dtype: auto takes the checkpoint's own on a GPU (its config's torch_dtype, a "
                           "GGUF's float type; bfloat16 for a quantized Gemma GGUF, float16 for other quantized ones) "
                           "and float32 on the CPU.")(fn)
    return click.option("--trust-remote-code", is_flag=True,
                        help="Let transformers run the model's own Python code, if its config asks for it "
                             "(off: such a model is refused).")(fn)


def _spread(fn):
    """--device-map and --max-memory: a model larger than one GPU spread over the GPUs of the machine."""
    fn = click.option("--max-memory", default=None,
                      help="With --device-map auto: memory each device may take, e.g. 0=70GiB,1=70GiB,cpu=100GiB.")(fn)
    return click.option("--device-map", type=click.Choice(["none", "auto"]), default="none", show_default=True,
                        help="auto: spread the model's layers over every GPU (accelerate), for a model larger than "
                             "one GPU; instead of --device.")(fn)


def _common(fn):
    fn = _spread(fn)
    fn = _trust_remote_code(fn)
    fn = click.option("--seq-len", type=int, default=None, help="Tokens per window.")(fn)
    fn = click.option("--num-samples", type=int, default=None, help="Number of windows.")(fn)
    fn = click.option("--text-field", default="text", show_default=True, help="Field holding the text (json/parquet/hub).")(fn)
    fn = click.option("--dataset", default=DEFAULT_DATASET, show_default=True,
                      help="pydoc (embedded), a .txt/.jsonl/.json/.parquet file, or name[:config] on the hub.")(fn)
    fn = click.option("--model", default=DEFAULT_MODEL, show_default=True,
                      help="smollm2-135m (embedded), a local directory or .gguf file, or a hub id.")(fn)
    return fn


def _method_options(fn):
    """The options that settle a cache method: its settings, or the artifact that fixes them (eval, generate)."""
    options = [
        click.option("--bits", type=int, default=None,
                     help=f"kivi, kvlinc, oscar [default: {DEFAULTS['bits']}, or the artifact's]."),
        click.option("--group-size", type=int, default=None,
                     help=f"kivi, kvlinc, oscar [default: {DEFAULTS['group_size']}, or the artifact's]."),
        click.option("--residual", type=int, default=None,
                     help=f"Flush block R, every method but fp16 [default: {DEFAULTS['residual']}, or the artifact's]."),
        click.option("--scaling", default=None,
                     help=f"oscar: key coefficient l2|rsqrt|max|mean-abs|none [default: {DEFAULTS['scaling']}, or the "
                          "artifact's]."),
        click.option("--rotation/--no-rotation", default=None,
                     help="oscar: Hadamard rotation of K and V [default: on, or the artifact's]."),
        click.option("--sink-tokens", type=int, default=None,
                     help="Every method but fp16: keep the first N tokens of a sequence in float16 beside their codes, "
                          "counted at 16 bits [default: 0, or the artifact's]."),
        click.option("--residual-mode", type=click.Choice(RESIDUAL_MODES), default=None,
                     help="Every method but fp16: flush R tokens at once when R wait (blockwise), or keep the newest R "
                          "always float16 (sliding) [default: blockwise, or the plan's]."),
        click.option("--sliding-layers", type=click.Choice(SLIDING_LAYERS), default=None,
                     help="Every method but fp16: a model's layers that slide over a window (Gemma 2 and 3) keep their "
                          "window as the model computes it (float16), or are compressed too (compress) [default: "
                          "float16, or the plan's]."),
        click.option("--keys", type=click.Choice(KVLINC_KEYS), default=None,
                     help="kvlinc: key coding under the correction, channel-wise (kivi) or OScaR's [default: kivi, or "
                          "the artifact's]."),
        click.option("--artifacts", type=click.Path(), default=None,
                     help="Calibrated artifact directory (kvlinc, oscar, vecinfer, plan); it fixes the options it was "
                          "made with."),
    ]
    for option in reversed(options):
        fn = option(fn)
    return fn


def _names(text: str | None) -> list[str] | None:
    """A comma-separated option's names (None where the option was not given)."""
    return None if text is None else [c.strip() for c in text.split(",") if c.strip()]


def _number_list(text: str, option: str, kind: type = int) -> list:
    """Comma-separated numbers of `kind` (int, or float where the option says so)."""
    try:
        return [kind(part) for part in text.split(",") if part.strip()]
    except ValueError:
        noun = "integers" if kind is int else "numbers"
        raise click.BadParameter(f"expected comma-separated {noun}, got {text!r}", param_hint=option) from None


def _given(**kwargs) -> dict:
    return {k: v for k, v in kwargs.items() if v is not None}


@click.group()
@click.version_option(package_name="kvcalib")
@click.option("-v", "--verbose", is_flag=True, help="Log progress details.")
def cli(verbose: bool) -> None:
    """Calibrate, store and evaluate low-bit KV-cache compression for Hugging Face causal LMs."""
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING, format="%(name)s: %(message)s")


@cli.command("collect")
@_common
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of the token sub-sampling.")
@click.option("--max-tokens", type=int, default=None, help="Cap on stored tokens per layer (seeded sub-sampling).")
@click.option("--out", required=True, type=click.Path(), help="Output directory (resumes if it holds a partial run).")
def collect_cmd(model, dataset, text_field, num_samples, seq_len, trust_remote_code, dtype, device, device_map,
                max_memory, seed, max_tokens, out) -> None:
    """Record post-RoPE Q/K/V activations per layer as safetensors shards."""
    from .collect import collect
    from .devices import parse_max_memory

    path = collect(out, model=model, dataset=dataset, text_field=text_field, seed=seed, max_tokens=max_tokens,
                   trust_remote_code=trust_remote_code, device=device, device_map=device_map, dtype=dtype,
                   max_memory=parse_max_memory(max_memory),
                   **_given(num_samples=num_samples, seq_len=seq_len))
    click.echo(f"activations written to {path}")


@cli.command("eval")
@_common
@click.option("--method", required=True, help="Cache method: fp16, kivi, oscar, kvlinc, vecinfer, turboquant, plan (docs/methods.md).")
@_method_options
@click.option("--json", "json_path", type=click.Path(), default=None, help="Also write the result as JSON.")
def eval_cmd(model, dataset, text_field, num_samples, seq_len, trust_remote_code, dtype, device, device_map, max_memory,
             method, bits, group_size, residual, scaling, rotation, sink_tokens, residual_mode, sliding_layers, keys,
             artifacts, json_path) -> None:
    """Perplexity, effective bits and per-layer attention error of a compressed cache."""
    from .evaluate import evaluate
    from .devices import parse_max_memory
    from .report import result_table

    result = evaluate(model=model, dataset=dataset, text_field=text_field, method=method, bits=bits,
                      group_size=group_size, residual=residual, scaling=scaling, rotation=rotation,
                      sink_tokens=sink_tokens, residual_mode=residual_mode, sliding_layers=sliding_layers, keys=keys,
                      artifacts=artifacts, json_path=json_path, trust_remote_code=trust_remote_code, device=device,
                      device_map=device_map, max_memory=parse_max_memory(max_memory), dtype=dtype,
                      **_given(num_samples=num_samples, seq_len=seq_len))
    click.echo(result_table([result]))


@cli.command("generate")
@click.option("--model", default=DEFAULT_MODEL, show_default=True,
              help="smollm2-135m (embedded), a local directory or .gguf file, or a hub id.")
@click.option("--method", default="kivi", show_default=True,
              help="Cache method: fp16, kivi, oscar, kvlinc, vecinfer, turboquant, plan (docs/methods.md).")
@_method_options
@click.option("--prompt", default=None, help="The prompt (a user turn where the model has a chat template).")
@click.option("--prompt-file", type=click.File("r"), default=None, help="Read the prompt from a file (- for stdin).")
@click.option("--max-new-tokens", type=int, default=128, show_default=True)
@click.option("--do-sample/--greedy", default=False, show_default=True, help="Sample, or take the likeliest token.")
@click.option("--temperature", type=float, default=1.0, show_default=True)
@click.option("--top-p", type=float, default=1.0, show_default=True)
@click.option("--top-k", type=int, default=50, show_default=True)
@click.option("--repetition-penalty", type=float, default=1.0, show_default=True)
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of the sampling.")
@_trust_remote_code
def generate_cmd(model, method, bits, group_size, residual, scaling, rotation, sink_tokens, residual_mode, sliding_layers,
                 keys, artifacts, prompt, prompt_file, max_new_tokens, do_sample, temperature, top_p, top_k,
                 repetition_penalty, seed, trust_remote_code, dtype, device) -> None:
    """Continue a prompt through a compressed cache, streaming the tokens to stdout. Under torchrun
    (--nproc-per-node N) the model is split over the GPUs by tensor parallelism and rank 0 streams."""
    from .generate import generate
    from .methods import MethodSettings

    if (prompt is None) == (prompt_file is None):
        raise click.UsageError("give one of --prompt TEXT and --prompt-file FILE")
    settings = MethodSettings(bits=bits, group_size=group_size, residual=residual, scaling=scaling, rotation=rotation,
                              sink_tokens=sink_tokens, residual_mode=residual_mode, sliding_layers=sliding_layers,
                              keys=keys)
    generate(prompt if prompt is not None else prompt_file.read(), model=model, method=method, settings=settings,
             artifacts=artifacts, max_new_tokens=max_new_tokens, do_sample=do_sample, temperature=temperature,
             top_p=top_p, top_k=top_k, repetition_penalty=repetition_penalty, seed=seed, device=device,
             trust_remote_code=trust_remote_code, stream=sys.stdout, dtype=dtype)


@cli.command("lm-eval")
@click.option("--tasks", required=True,
              help="Comma-separated lm-eval tasks; offline, RULER's generated ones: niah_single_1, niah_multikey_2, "
                   "niah_multikey_3, ruler_vt, ruler_cwe, ruler_fwe.")
@click.option("--model", default=DEFAULT_MODEL, show_default=True,
              help="smollm2-135m (embedded), a local directory or .gguf file, or a hub id.")
@click.option("--method", default="fp16", show_default=True,
              help="Cache method: fp16, kivi, oscar, kvlinc, vecinfer, turboquant, plan (docs/methods.md).")
@_method_options
@click.option("--max-lengths", default="4096", show_default=True,
              help="RULER: the prompt lengths its tasks generate, comma-separated (e.g. 4096,8192).")
@click.option("--batch-size", type=int, default=1, show_default=True)
@click.option("--limit", type=float, default=None,
              help="Samples per task (a fraction below 1: that share of each task) [default: all].")
@click.option("--output-path", type=click.Path(), default=None, help="Write lm-eval's results, as JSON, here.")
@click.option("--seed", type=int, default=0, show_default=True, help="lm-eval's seeds (sampling, few-shot order).")
@_trust_remote_code
def lm_eval_cmd(tasks, model, method, bits, group_size, residual, scaling, rotation, sink_tokens, residual_mode,
                sliding_layers, keys, artifacts, max_lengths, batch_size, limit, output_path, seed, trust_remote_code,
                dtype, device) -> None:
    """lm-evaluation-harness tasks with the KV cache replaced by a kvcalib method (generation through the cache a
    decoder holds, loglikelihoods as `eval` scores them)."""
    from .harness import run_tasks, score_table
    from .methods import MethodSettings

    settings = MethodSettings(bits=bits, group_size=group_size, residual=residual, scaling=scaling, rotation=rotation,
                              sink_tokens=sink_tokens, residual_mode=residual_mode, sliding_layers=sliding_layers,
                              keys=keys)
    results = run_tasks(_names(tasks), model=model, method=method,
                        settings=settings, artifacts=artifacts, batch_size=batch_size,
                        limit=None if limit is None else (int(limit) if limit >= 1 else limit),
                        max_lengths=_number_list(max_lengths, "--max-lengths"), output_path=output_path, seed=seed,
                        device=device, trust_remote_code=trust_remote_code, dtype=dtype)
    click.echo(score_table(results))


@cli.command("train-adapters")
@click.option("--activations", required=True, type=click.Path(), help="A finished `kvcalib collect` directory.")
@click.option("--rank", type=int, default=256, show_default=True, help="Feature dimension D of φ (two softmaxes of D/2).")
@click.option("--steps", type=int, default=60, show_default=True, help="Adam steps per layer.")
@click.option("--lr", type=float, default=1e-2, show_default=True)
@click.option("--bits", type=int, default=DEFAULTS["bits"], show_default=True)
@click.option("--group-size", type=int, default=DEFAULTS["group_size"], show_default=True)
@click.option("--residual", type=int, default=DEFAULTS["residual"], show_default=True)
@click.option("--tokens", type=int, default=128, show_default=True, help="Query positions per step.")
@click.option("--layers", default="all", show_default=True,
              help="all (but a model's sliding layers, which the caches keep uncompressed by default: "
                   "--sliding-layers), or layers such as 0-9 or 0,4,7-9.")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--gate/--no-gate", default=True, show_default=True,
              help="Correct only the query heads whose held-out attention output error the adapters lower "
                   "(a layer with none left gets no adapters).")
@click.option("--keys", type=click.Choice(KVLINC_KEYS), default=DEFAULTS["keys"], show_default=True,
              help="Key coding the correction is trained on top of: channel-wise (kivi, the paper's) or OScaR's "
                   "(rotated, per-token norm).")
@click.option("--out", required=True, type=click.Path(), help="Artifact directory to write.")
@_device
def train_adapters_cmd(activations, rank, steps, lr, bits, group_size, residual, tokens, layers, seed, gate, keys,
                       out, device) -> None:
    """Train KVLinC's linear-correction adapters on collected activations."""
    from .methods.kvlinc_fit import train_adapters

    path = train_adapters(activations, out, rank=rank, steps=steps, lr=lr, bits=bits, group_size=group_size,
                          residual=residual, tokens=tokens, layers=layers, seed=seed, gate=gate, keys=keys,
                          device=device)
    click.echo(f"adapters written to {path}")


@cli.command("diagnose")
@click.option("--activations", required=True, type=click.Path(), help="A finished `kvcalib collect` directory.")
@click.option("--bits", default="2,3,4", show_default=True, help="Comma-separated bit widths.")
@click.option("--group-size", type=int, default=DEFAULTS["group_size"], show_default=True)
@click.option("--max-samples", type=int, default=None, help="Use only the first N samples of the collection.")
@click.option("--plot-layers", default=None, help="Comma-separated layers to plot (default: first, most imbalanced, last).")
@click.option("--out", required=True, type=click.Path(), help="Output directory (report.json, report.md, PNGs).")
@click.option("--sliding-layers", type=click.Choice(SLIDING_LAYERS), default=DEFAULTS["sliding_layers"],
              show_default=True,
              help="A model's layers that slide over a window: measured, but kept uncompressed and so in no summary "
                   "figure (float16), or counted as any layer (compress).")
@_device
def diagnose_cmd(activations, bits, group_size, max_samples, plot_layers, out, sliding_layers, device) -> None:
    """Token Norm Imbalance of collected Q/K/V and its cost to low-bit quantization."""
    from .diagnose import diagnose

    path = diagnose(activations, out, bits=_number_list(bits, "--bits"), group_size=group_size, max_samples=max_samples,
                    plot_layers=None if plot_layers is None else _number_list(plot_layers, "--plot-layers"),
                    device=device, sliding_layers=sliding_layers)
    click.echo(f"report written to {path}/report.md")


@cli.command("make-model")
@click.option("--shape", required=True, help="llama-3.1-8b, llama-3.1-70b, qwen3-8b, mistral-7b, phi-3-mini, gemma-2-9b, "
              "gemma-3-4b, gemma-3-27b, or a transformers config as a .json file.")
@click.option("--dtype", type=click.Choice(["bfloat16", "float16", "float32"]), default="bfloat16", show_default=True)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--tokenizer", default=None, type=click.Path(),
              help="A directory holding a saved tokenizer [default: the embedded model's].")
@click.option("--weights", type=click.Choice(["written", "generated"]), default="written", show_default=True,
              help="generated: no weights on disk; --model DIR draws the same ones onto its devices as it loads.")
@click.option("--device", default="cpu", show_default=True,
              help="Where written weights are drawn (cuda: seconds for a 70B model); the same bytes on any device.")
@click.option("--out", required=True, type=click.Path(), help="Model directory to write.")
def make_model_cmd(shape, dtype, seed, tokenizer, weights, device, out) -> None:
    """Write a random-initialised model of a real model's shape (benchmarks and tests, never accuracy)."""
    from .devices import resolve_device
    from .random_model import make_model

    made = make_model(shape, out, dtype, seed, tokenizer=tokenizer, weights=weights, device=resolve_device(device))
    click.echo(f"model written to {made}")


@cli.command("oscar-artifact")
@click.option("--model", default=DEFAULT_MODEL, show_default=True, help="The model the artifact is for.")
@click.option("--bits", type=int, default=DEFAULTS["bits"], show_default=True)
@click.option("--group-size", type=int, default=DEFAULTS["group_size"], show_default=True)
@click.option("--residual", type=int, default=DEFAULTS["residual"], show_default=True)
@click.option("--scaling", default=DEFAULTS["scaling"], show_default=True, help="Key coefficient l2|rsqrt|max|mean-abs|none.")
@click.option("--rotation/--no-rotation", default=DEFAULTS["rotation"], show_default=True)
@_trust_remote_code
@click.option("--out", required=True, type=click.Path(), help="Artifact directory to write.")
def oscar_artifact_cmd(model, bits, group_size, residual, scaling, rotation, trust_remote_code, dtype, device,
                       out) -> None:
    """Write the (training-free) OScaR artifact: settings, model fingerprint and rotation."""
    from .methods.oscar_fit import save_oscar_artifact

    path = save_oscar_artifact(out, model=model, bits=bits, group_size=group_size, residual=residual,
                               scaling=scaling, rotation=rotation, trust_remote_code=trust_remote_code, device=device,
                               dtype=dtype)
    click.echo(f"artifact written to {path}")


@cli.command("fit-codebook")
@click.option("--activations", required=True, type=click.Path(), help="Directory written by `kvcalib collect`.")
@click.option("--k-config", default="d4b8", show_default=True, help="Keys: dNbM = sub-vectors of N elements, 2^M centroids.")
@click.option("--v-config", default="d4b8", show_default=True, help="Values: dNbM.")
@click.option("--granularity", type=click.Choice(["layer", "head"]), default="layer", show_default=True,
              help="One codebook per layer, or per KV head.")
@click.option("--no-smooth", "smooth", is_flag=True, flag_value=False, default=True, help="Skip the key smoothing λ.")
@click.option("--no-hadamard", "hadamard", is_flag=True, flag_value=False, default=True, help="Skip the Hadamard rotation of keys.")
@click.option("--iters", type=int, default=30, show_default=True, help="k-means iterations.")
@click.option("--max-points-per-centroid", type=int, default=256, show_default=True,
              help="faiss samples at most this many training points per centroid.")
@click.option("--sink-tokens", type=int, default=0, show_default=True,
              help="The cache keeps the first N tokens of every sequence in float16.")
@click.option("--exclude-sinks", is_flag=True, help="Also leave those N positions out of λ and the k-means fit.")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--kmeans", type=click.Choice(KMEANS), default="auto", show_default=True,
              help="k-means library: faiss (its GPU build where installed), or kvcalib's own in torch on --device; "
                   "auto takes torch on CUDA where faiss has no GPU build, faiss otherwise.")
@click.option("--out", required=True, type=click.Path(), help="Artifact directory to write.")
@_device
def fit_codebook_cmd(activations, k_config, v_config, granularity, smooth, hadamard, iters, max_points_per_centroid,
                     sink_tokens, exclude_sinks, seed, kmeans, out, device) -> None:
    """Fit VecInfer's key smoothing and k-means codebooks (faiss, or torch on a GPU) from collected activations."""
    from .methods.vecinfer_fit import fit_codebook

    path = fit_codebook(activations, out, k_config=k_config, v_config=v_config, granularity=granularity, smooth=smooth,
                        hadamard=hadamard, iters=iters, seed=seed, max_points_per_centroid=max_points_per_centroid,
                        sink_tokens=sink_tokens, exclude_sinks=exclude_sinks, device=device, kmeans=kmeans)
    click.echo(f"artifact written to {path}")


@cli.command("fit-turboquant")
@click.option("--activations", required=True, type=click.Path(), help="Directory written by `kvcalib collect`.")
@click.option("--bits", type=int, default=DEFAULTS["bits"], show_default=True, help="Bits per rotated coordinate (1-4).")
@click.option("--granularity", type=click.Choice(["layer", "head"]), default="layer", show_default=True,
              help="One codebook per rotated coordinate of a layer, or of each KV head.")
@click.option("--iters", type=int, default=50, show_default=True, help="Lloyd iterations at most.")
@click.option("--out", required=True, type=click.Path(), help="Artifact directory to write.")
def fit_turboquant_cmd(activations, bits, granularity, iters, out) -> None:
    """Fit calibrated TurboQuant codebooks (per rotated coordinate, Lloyd) from collected activations."""
    from .methods.turboquant_fit import fit_turboquant

    path = fit_turboquant(activations, out, bits=bits, granularity=granularity, iters=iters)
    click.echo(f"artifact written to {path}")


@cli.command("plan")
@click.option("--activations", required=True, type=click.Path(), help="Directory written by `kvcalib collect`.")
@click.option("--budget", "budgets", required=True,
              help="Average bits per cached element, counted as `eval` counts them (codes, norms, codebooks); "
                   "several, comma-separated, share one measurement and write --out/budget-{b} each.")
@click.option("--model", default=DEFAULT_MODEL, show_default=True, help="The model the collection came from.")
@click.option("--candidates", default=",".join(PLAN_CANDIDATES), show_default=True,
              help="Schemes each layer's keys and values may take, comma-separated: turboquant-B (calibrated "
                   "per-coordinate codebooks, B in 1..4), turboquant-dDbB (TurboQuant's norms and rotation, a "
                   "k-means codebook of 2^B centroids of D coordinates; needs faiss), vecinfer-dDbB (VecInfer's λ, Hadamard "
                   "and codebooks; needs faiss), kivi-B-gG, oscar-B-gG.")
@click.option("--key-candidates", default=None,
              help="The schemes keys may take, comma-separated, each one of --candidates (default: its scalar ones, "
                   "or all where it has none: vector codebooks on keys miscopy retrieved tokens, benchmarks/RESULTS.md).")
@click.option("--value-candidates", default=None,
              help="The schemes values may take, comma-separated, each one of --candidates (default: all of them).")
@click.option("--items", type=click.Choice(PLAN_ITEMS), default=PLAN_ITEM, show_default=True,
              help="Choose a scheme for each layer's keys and values, or for each KV head's.")
@click.option("--anchor", default=PLAN_ANCHOR, show_default=True,
              help="The candidate whose KL divergence is measured per item; the others are scaled from it.")
@click.option("--windows", type=int, default=4, show_default=True,
              help="Held-out calibration windows for the sensitivities (after the collection's tokens).")
@click.option("--seq-len", type=int, default=512, show_default=True, help="Tokens per window.")
@click.option("--granularity", type=click.Choice(["layer", "head"]), default="layer", show_default=True,
              help="One codebook per rotated coordinate of a layer, or of each KV head.")
@click.option("--iters", type=int, default=50, show_default=True, help="Lloyd iterations at most.")
@click.option("--sink-tokens", type=int, default=PLAN_SINK_TOKENS, show_default=True,
              help="Keep the first N tokens of a sequence in float16 (counted in the budget; the plan keeps them).")
@click.option("--residual-mode", type=click.Choice(RESIDUAL_MODES), default="blockwise", show_default=True,
              help="The flush rule the sensitivities are measured under (see eval); the plan keeps it.")
@click.option("--sliding-layers", type=click.Choice(SLIDING_LAYERS), default=DEFAULTS["sliding_layers"],
              show_default=True,
              help="A model's layers that slide over a window (Gemma 2 and 3): kept as the model computes them, no "
                   "items (float16), or items as any layer (compress); the plan keeps it.")
@click.option("--kmeans", type=click.Choice(KMEANS), default="auto", show_default=True,
              help="k-means of the vector candidates (turboquant-dDbB, vecinfer-dDbB), as fit-codebook's: auto takes "
                   "faiss on the CPU, kvcalib's own in torch on the model's GPU where faiss has no GPU build.")
@_spread
@_trust_remote_code
@click.option("--out", required=True, type=click.Path(), help="Artifact directory to write.")
def plan_cmd(activations, budgets, model, candidates, key_candidates, value_candidates, items, anchor, windows, seq_len,
             granularity, iters, sink_tokens, residual_mode, sliding_layers, kmeans, trust_remote_code, dtype, device,
             device_map, max_memory, out) -> None:
    """Choose each layer's key and value scheme (TurboQuant, KIVI, OScaR) under an average bit budget."""
    from .methods.plan_fit import make_plan
    from .devices import parse_max_memory

    for path in make_plan(activations, _number_list(budgets, "--budget", float), out, model=model,
                          candidates=_names(candidates), key_candidates=_names(key_candidates),
                          value_candidates=_names(value_candidates), items=items, anchor=anchor,
                          windows=windows, seq_len=seq_len, granularity=granularity, iters=iters,
                          sink_tokens=sink_tokens, residual_mode=residual_mode, trust_remote_code=trust_remote_code,
                          device=device, device_map=device_map, max_memory=parse_max_memory(max_memory),
                          kmeans=kmeans, dtype=dtype, sliding_layers=sliding_layers):
        click.echo(f"plan written to {path}")


@cli.command("report")
@click.argument("results", nargs=-1, type=click.Path())
@click.option("--tasks", "task_results", multiple=True, type=click.Path(),
              help="A `kvcalib lm-eval --output-path` JSON, read beside the eval result of its method and settings "
                   "(repeat the option for several).")
@click.option("--out", required=True, type=click.Path(), help="Directory for report.md, pareto.png (and tasks.png).")
def report_cmd(results, task_results, out) -> None:
    """Tabulate several `kvcalib eval --json` results and draw their Pareto plot; task scores beside them."""
    from .pareto import write_report

    click.echo(f"report written to {write_report(list(results), out, list(task_results))}")


@cli.command("run")
@click.argument("recipe", type=click.Path())
@click.option("--model", default=None, help="Override the recipe's model.")
@_trust_remote_code
def run_cmd(recipe, model, trust_remote_code, dtype, device) -> None:
    """Run the steps of a recipe (a TOML pipeline under recipes/) in order."""
    from .evaluate import EvalResult
    from .recipes import run_recipe
    from .report import result_table

    done = run_recipe(recipe, model=model, trust_remote_code=trust_remote_code, device=device, dtype=dtype)
    evals = [(step.label, out) for step, out in done if isinstance(out, EvalResult)]
    if evals:
        click.echo(result_table([r for _, r in evals], [label for label, _ in evals]))


def _out_of_memory(args: list[str]) -> str:
    command = next((a for a in args if a in cli.commands), None)
    lower = _MEMORY_OPTIONS.get(command, "the model or data size")
    return f"out of GPU memory in {command or 'kvcalib'}; lower {lower}, or free the GPU of other processes"


DATA_PARALLEL = ("collect", "eval", "train-adapters", "fit-codebook", "diagnose")  # `kvcalib.parallel`
TENSOR_PARALLEL = ("generate",)  # the model split over the processes (`kvcalib.generate`)


def _refuse_unshared(args: list[str]) -> None:
    """Under torchrun, a command that does not share its work would run N times over one output: refused."""
    import os

    command = next((a for a in args if not a.startswith("-")), None)
    shared = DATA_PARALLEL + TENSOR_PARALLEL
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and command is not None and command not in shared:
        raise click.UsageError(f"{command} runs in one process; of the commands, only {', '.join(shared)} "
                               "share their work under torchrun: run it without torchrun")


def main(argv: list[str] | None = None) -> None:
    """Run the command line `argv` (the program's own arguments when None, as the `kvcalib` program)."""
    args = sys.argv[1:] if argv is None else argv
    try:
        _run(args)
    finally:
        if argv is None:
            # The work is done and its outputs complete: a Ctrl-C while the interpreter shuts down
            # (torch's teardown takes a while) ends the process at once instead of printing a traceback
            # from whichever exit handler it interrupts.
            signal.signal(signal.SIGINT, signal.SIG_DFL)


def _run(args: list[str]) -> None:
    try:
        _refuse_unshared(args)
        cli.main(args=args, prog_name="kvcalib", standalone_mode=False)
    except click.exceptions.Abort:
        click.echo("kvcalib: interrupted", err=True)
        sys.exit(130)
    except click.ClickException as err:
        click.echo(f"kvcalib: error: {err.format_message()}", err=True)
        sys.exit(2)
    except KvcalibError as err:
        click.echo(f"kvcalib: error: {err}", err=True)
        sys.exit(2)
    except Exception as err:
        torch = sys.modules.get("torch")  # loaded by any command that can run out of GPU memory
        if torch is None or not isinstance(err, torch.OutOfMemoryError):
            raise
        click.echo(f"kvcalib: error: {_out_of_memory(args)}", err=True)
        sys.exit(2)


if __name__ == "__main__":
    main()
