"""Is a greedy divergence a near-tie or a defect? The target's own logits at the diverging position.

Two greedy runs of the same prompt that part at one position are lossless only if the target's top two
tokens there are within float32 noise of each other: then a different kernel, batch shape or reduction
order may pick either. This tool runs the demo target (float32, transformers, CPU) greedily on one held-out
prompt and reports, at the given position, the top tokens, the logit margin between the two tokens the runs
chose, and the same position's logits computed a second way (one forward over the whole sequence instead of
step-by-step decoding with a KV cache): the difference between the two computations is a measured size of
float32 noise for this model and position, to compare with the margin.

Usage:
    python bench/near_tie.py --source mtbench --every 5 --index 15 --position 42 --pair 8746,253 \
        --new 64 --out bench/measured/cpu-zen4-avx512bf16/near_tie_prompt31.json

``--source`` / ``--every`` / ``--index`` name the prompt in the project's data module (the GPU benchmark's
prompt 31 is MT-bench, every 5th, the 16th taken); ``--position`` counts generated tokens from 0.
"""

from __future__ import annotations

import argparse
import json
import platform

import torch


def greedy_logits(model, ids, new):
    """Greedy decoding with a KV cache: ``([new] tokens, [new, vocab] float32 logits before each token)``."""
    out = model.generate(torch.tensor([ids]), max_new_tokens=new, do_sample=False, output_logits=True,
                         return_dict_in_generate=True, eos_token_id=None, pad_token_id=0)
    return out.sequences[0, len(ids):].tolist(), torch.cat(out.logits).float()


def full_forward_logits(model, ids, tokens, position):
    """The logits before token ``position`` from one forward over prompt + tokens[:position] (no cache)."""
    seq = torch.tensor([ids + tokens[:position]])
    return model(seq).logits[0, -1].float()


def report(logits, pair, k=5):
    top = torch.topk(logits, k)
    a, b = pair
    return {"top": [[int(t), float(v)] for v, t in zip(top.values, top.indices)],
            "pair_logits": [float(logits[a]), float(logits[b])], "pair_margin": float(logits[a] - logits[b]),
            "top2_margin": float(top.values[0] - top.values[1])}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--source", choices=("humaneval", "mtbench"), required=True)
    ap.add_argument("--every", type=int, required=True)
    ap.add_argument("--index", type=int, required=True)
    ap.add_argument("--position", type=int, required=True)
    ap.add_argument("--pair", required=True, help="the two tokens the runs chose, A,B")
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    from transformers import AutoModelForCausalLM

    from treespec_sglang.data import prompts as P
    from treespec_sglang.engine import SpecEngine
    from treespec_sglang.models.demo import demo_target

    pair = tuple(int(t) for t in args.pair.split(","))
    text = getattr(P, args.source)().every(args.every).take(args.index + 1).prompts[args.index]
    ids = SpecEngine.from_pretrained("smollm2-135m", draft="demo", dtype="float32").encode([text])[0]
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(demo_target(), dtype=torch.float32).eval()
    with torch.inference_mode():
        tokens, logits = greedy_logits(model, ids, args.new)
        full = full_forward_logits(model, ids, tokens, args.position)
    step = logits[args.position]
    margins = torch.topk(logits, 2).values
    margins = (margins[:, 0] - margins[:, 1]).tolist()
    res = {"prompt": {"source": args.source, "every": args.every, "index": args.index, "n_ids": len(ids)},
           "position": args.position, "pair": list(pair), "greedy_token": tokens[args.position],
           "decode_with_cache": report(step, pair), "one_forward": report(full, pair),
           "two_ways_max_abs_diff": float((step - full).abs().max()),
           "two_ways_pair_margin_diff": float((step[pair[0]] - step[pair[1]]) - (full[pair[0]] - full[pair[1]])),
           "smallest_top2_margins": sorted((m, i) for i, m in enumerate(margins))[:5],
           "machine": platform.processor() or platform.machine(), "torch": torch.__version__}
    print(json.dumps(res, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
