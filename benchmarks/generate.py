"""End-to-end greedy decoding on the GPU: a random-initialised Llama-3.1-8B-shaped model (built from a
config, fp16) with a long prompt, fp16 DynamicCache (SDPA) against each compressed KvcalibCache.

    python benchmarks/generate.py [--context 32768] [--new-tokens 64] [--results FILE]

Tokens/s counts the decode steps only (prefill excluded, timed separately); peak memory is
torch.cuda.max_memory_allocated, over the prefill and over the decode steps separately.
"""

from __future__ import annotations

import argparse
import gc
import sys
import time

import torch
from transformers import AutoModelForCausalLM, DynamicCache, LlamaConfig

from kvcalib.methods import MethodSettings
from kvcalib.models import LoadedModel
from kvcalib.runtime.cache import KvcalibCache
from results import RESULTS, record


def llama8b_config(context: int) -> LlamaConfig:
    return LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                       num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                       max_position_embeddings=max(131072, context + 1024), rope_theta=500000.0)


def run(model, make_cache, prompt: torch.Tensor, new_tokens: int) -> tuple[float, float, float, float, list[int]]:
    gc.collect()  # the previous run's cache must not count in this one's peak
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    cache = make_cache()
    with torch.no_grad():
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        logits = model(prompt, past_key_values=cache, use_cache=True, logits_to_keep=1).logits[:, -1]
        torch.cuda.synchronize()
        prefill = time.perf_counter() - t0
        tokens = [int(logits.argmax())]
        prefill_peak = torch.cuda.max_memory_allocated() / 2**30
        torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        for _ in range(new_tokens - 1):
            nxt = torch.tensor([[tokens[-1]]], device="cuda")
            tokens.append(int(model(nxt, past_key_values=cache, use_cache=True).logits[:, -1].argmax()))
        torch.cuda.synchronize()
        decode = time.perf_counter() - t0
    decode_peak = torch.cuda.max_memory_allocated() / 2**30
    if isinstance(cache, KvcalibCache):
        cache_gib = cache.stored_bits() / 8 / 2**30
    else:
        cache_gib = sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers) / 2**30
    return prefill, (new_tokens - 1) / decode, prefill_peak, decode_peak, cache_gib, tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--context", type=int, default=32768)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--results", default=str(RESULTS))
    args = parser.parse_args()
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(llama8b_config(args.context), dtype=torch.float16).eval()
    lm = LoadedModel(model=model, tokenizer=None, spec="llama-3.1-8b-shaped (random)")
    weights = torch.cuda.memory_allocated() / 2**30
    prompt = torch.randint(0, 128256, (1, args.context), device="cuda")
    rows = []
    for label, method, settings in [("KIVI-2 G=128 (fused)", "kivi", MethodSettings(2, 128, 128)),
                                    ("KIVI-2 G=32 (fused)", "kivi", MethodSettings(2, 32, 128)),
                                    ("CK+HV-2 G=128, KVLinC layout (fused)", "kvlinc", MethodSettings(2, 128, 128)),
                                    ("OScaR-2 G=32 (fused)", "oscar", MethodSettings(2, 32, 128))]:
        rows.append((label, *run(model, lambda: KvcalibCache(lm, method, settings), prompt, args.new_tokens)))
    # fp16 runs last: something in transformers keeps a DynamicCache alive after its run (seen here:
    # 4 GiB more in every later peak), which would inflate the compressed caches' figures.
    model.set_attn_implementation("sdpa")
    rows.insert(0, ("fp16 DynamicCache (SDPA)", *run(model, lambda: DynamicCache(config=model.config), prompt, args.new_tokens)))
    base_tokens = rows[0][-1]
    lines = [f"weights: {weights:.1f} GiB; prompt {args.context} tokens, {args.new_tokens} greedy tokens "
             "(random weights: near-uniform logits, so a 2-bit cache changes greedy tokens freely)", "",
             "| cache | prefill s | decode tokens/s | cache GiB | peak GiB, prefill | peak GiB, decode | tokens equal to fp16 |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for label, prefill, tps, prefill_peak, decode_peak, cache_gib, tokens in rows:
        same = sum(a == b for a, b in zip(tokens, base_tokens))
        lines.append(f"| {label} | {prefill:.2f} | {tps:.1f} | {cache_gib:.2f} | {prefill_peak:.1f} | {decode_peak:.1f} | "
                     f"{same}/{len(tokens)} |")
    title = f"End-to-end greedy decode, {torch.cuda.get_device_name()}, Llama-3.1-8B shape (random init)"
    table = "\n".join(lines)
    print(f"\n{title}\n\n{table}")
    record(title, table, sys.argv, args.results)


if __name__ == "__main__":
    main()
