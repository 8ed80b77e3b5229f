"""A plan whose sensitivity also sees copying: does it keep RULER's needles where the default plan miscopies them?

The default plan's sensitivity sums the KL over every position of ordinary text; at 4k tokens on RULER's
niah_single_1 both plans at 2.25 bits find the needle but garble its digits (RESULTS.md, "Offline RULER at 4k and
8k ... 100 samples"). This builds `kvcalib plan` as the command does, with one change: each item's sensitivity
adds, at equal anchor mass times `--weight`, its sensitivity on retrieval prompts made from the calibration text
(never the evaluation text, never RULER's own template or haystack): a 7-digit code for a word hidden at a seeded
depth of held-out calibration text, asked for at the end and answered (teacher-forced), the KL and the attention
errors counted only where the model predicts the code's tokens (`measure_sensitivity`'s `positions`).

    python benchmarks/plan_needles.py --activations runs/pdef/acts --budget 2.25 --out runs/pneedle/plan \\
        [--prompts 8] [--prompt-len 2048] [--weight 1.0] [--device cuda]

`--reweight TEXT_PLAN PROMPTS_PLAN` measures nothing: it takes ordinary text's sensitivities from TEXT_PLAN (the
plan `kvcalib plan` made on the same collection with the same windows) and the prompts' from PROMPTS_PLAN (one this
script made, at its `--weight`, recorded in its manifest), and weighs them by `--weight` anew: a plan in the time
of its codebook fits.

The plan is an ordinary `plan` artifact: `kvcalib eval --method plan --artifacts ...` and `ruler_split.py` read it.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvcalib.atomic import write_json  # noqa: E402
from kvcalib.collect import Activations  # noqa: E402
from kvcalib.methods import plan_fit  # noqa: E402
from kvcalib.models import DEFAULT_MODEL  # noqa: E402

KEYS = ("harbor", "lantern", "meadow", "copper", "violet", "granite", "falcon", "orchard", "timber", "saffron")


def retrieval_prompts(lm, acts: Activations, prompts: int, length: int, skip_after: int, seed: int = 0):
    """(ids, positions): `prompts` x `length` token prompts of held-out calibration text with a code hidden in
    each, and the positions that predict the code's tokens in the answer."""
    # after the collection's tokens (plan's held-out windows) and the `skip_after` tokens of plan's own windows
    filler = plan_fit.heldout_windows(lm, acts, 1, skip_after + prompts * length)[0, skip_after:]
    gen = torch.Generator().manual_seed(seed)
    enc = lambda s: lm.tokenizer(s, add_special_tokens=False)["input_ids"]  # noqa: E731
    ids = torch.empty(prompts, length, dtype=torch.long)
    positions = torch.zeros(prompts, length, dtype=torch.bool)
    for p in range(prompts):
        key = KEYS[p % len(KEYS)]
        code = str(int(torch.randint(1_000_000, 10_000_000, (1,), generator=gen)))
        head = enc("Read the text below and remember the code it mentions.\n")
        hidden = enc(f" Remember this: the code for {key} is {code}. ")
        question = enc(f"\nQuestion: what is the code for {key}? Answer: the code for {key} is")
        answer = enc(f" {code}.")
        room = length - len(head) - len(hidden) - len(question) - len(answer)
        text = filler[p * length : p * length + room].tolist()
        depth = int(torch.randint(0, room + 1, (1,), generator=gen))
        seq = head + text[:depth] + hidden + text[depth:] + question + answer
        ids[p] = torch.tensor(seq)
        start = len(seq) - len(answer)  # the answer's first token; position t predicts token t + 1
        positions[p, start - 1 : start - 1 + len(enc(f" {code}"))] = True
    return ids, positions


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--activations", required=True)
    parser.add_argument("--budget", type=float, default=2.25)
    parser.add_argument("--out", required=True)
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=2048)
    parser.add_argument("--weight", type=float, default=1.0, help="the prompts' share against ordinary text's")
    parser.add_argument("--windows", type=int, default=4, help="plan --windows (ordinary text)")
    parser.add_argument("--seq-len", type=int, default=512, help="plan --seq-len (ordinary text)")
    parser.add_argument("--device", default=None)
    parser.add_argument("--key-candidates", default=None,
                        help="plan --key-candidates (the plans of 2026-11-28's RULER table: every candidate, "
                             "from kvcalib.defaults.PLAN_CANDIDATES, as keys could take then)")
    parser.add_argument("--reweight", nargs=2, metavar=("TEXT_PLAN", "PROMPTS_PLAN"), default=None)
    args = parser.parse_args()

    acts = Activations(args.activations)
    measure = plan_fit.measure_sensitivity

    def reweighted(lm, coders, windows, anchor):
        (text_extra, _), (both_extra, both_settings) = (_extra(p) for p in args.reweight)
        same = ("activations", "candidates", "anchor", "windows", "seq_len")
        if any(text_extra[k] != both_extra[k] for k in same) or text_extra["windows"] != args.windows:
            raise SystemExit(f"--reweight: the two plans differ in {same} or from --windows")
        text, both = (torch.tensor([e["sensitivity_per_kv_head"][p] for p in "kv"], dtype=torch.float64).transpose(0, 1)
                      for e in (text_extra, both_extra))
        weight0 = both_settings["weight"]
        print(f"reweighted: the prompts' share {weight0} -> {args.weight}")
        return text + (args.weight / weight0) * (both - text)

    def with_prompts(lm, coders, windows, anchor):
        text = measure(lm, coders, windows, anchor)
        ids, positions = retrieval_prompts(lm, acts, args.prompts, args.prompt_len, windows.numel())
        copy = measure(lm, coders, ids, anchor, positions=positions)
        a = list(coders).index(anchor)
        scale = float(text[..., a].sum() / copy[..., a].sum())  # equal anchor mass, times --weight
        print(f"retrieval prompts: {args.prompts} x {args.prompt_len}, {int(positions.sum())} counted positions; "
              f"anchor mass {float(text[..., a].sum()):.4g} (text) and {float(copy[..., a].sum()):.4g} (prompts)")
        return text + args.weight * scale * copy

    plan_fit.measure_sensitivity = reweighted if args.reweight else with_prompts
    t0 = time.perf_counter()
    keys = args.key_candidates.split(",") if args.key_candidates else None
    [path] = plan_fit.make_plan(args.activations, args.budget, args.out, model=args.model, windows=args.windows,
                                seq_len=args.seq_len, device=args.device, key_candidates=keys)
    manifest = json.loads((path / "manifest.json").read_text())  # what --reweight needs to read it back
    manifest["extra"]["retrieval_prompts"] = {"weight": args.weight, "prompts": args.prompts,
                                              "prompt_len": args.prompt_len, "reweighted_from": args.reweight}
    write_json(path / "manifest.json", manifest)
    print(f"plan -> {path} in {time.perf_counter() - t0:.1f} s")


def _extra(plan: str) -> tuple[dict, dict]:
    """A plan artifact's manifest extra, and the prompts' settings this script recorded there (weight 1.0 where
    none is: the plans it made before it recorded them)."""
    extra = json.loads((Path(plan) / "manifest.json").read_text())["extra"]
    return extra, extra.get("retrieval_prompts", {"weight": 1.0})


if __name__ == "__main__":
    main()
