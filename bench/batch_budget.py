"""Issue 13 (reference engine): one verify budget for the whole batch vs a fixed tree size per request.

Same engine, same prompts, same run: the held-out split (every 10th HumanEval / MT-bench prompt, a mix of
code and chat), greedy. For each per-request size N, the fixed rows give every request an EAGLE-2 tree of
N nodes; the batch rows let every request's policy grow a tree of up to ``--cap-factor`` x N nodes and
keep the best ``bs * N`` nodes of the whole batch (``verify_budget = bs * N``), so both verify at most the
same number of tokens per round. Reported: accepted draft tokens per verified token, tau, verified tokens
per round, tokens/s, and whether the outputs equal plain greedy. ``batch+calibrated`` weighs the path
probabilities by the per-depth correction learned online during each call (``calibrate=True``).

    python bench/batch_budget.py --bs 8 --sizes 4,8,16 --max-new-tokens 64
"""

import argparse
import json
import time


def run(engine, prompts, spec, bs, max_new, budget=None, calibrate=False):
    t0 = time.perf_counter()
    res = []
    for i in range(0, len(prompts), bs):
        res += engine.generate(prompts[i:i + bs], max_new_tokens=max_new, policy=spec, verify_budget=budget,
                               calibrate=calibrate)
    dt = time.perf_counter() - t0
    acc = sum(sum(r.stats.accepted) for r in res)
    verified = sum(sum(r.stats.tree_sizes) for r in res)
    rounds = sum(len(r.stats.accepted) for r in res)
    toks = sum(len(r.token_ids) for r in res)
    return dict(accepted_per_verified=acc / verified if verified else 0.0, tau=1 + acc / rounds if rounds else 1.0,
                verified_per_round=verified / rounds if rounds else 0.0, tok_s=toks / dt, seconds=dt,
                outputs=[r.token_ids for r in res])


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bs", type=int, default=8)
    ap.add_argument("--sizes", default="4,8,16")
    ap.add_argument("--cap-factor", type=int, default=2)
    ap.add_argument("--topk", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--prompts", type=int, default=8, help="per prompt set")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    import torch

    from treespec_sglang.data import humaneval, mtbench
    from treespec_sglang.engine import SpecEngine

    torch.set_num_threads(2)
    engine = SpecEngine.from_pretrained("smollm2-135m", draft="demo")
    he, mt = humaneval().every(10).take(a.prompts).prompts, mtbench().every(10).take(a.prompts).prompts
    prompts = [p for pair in zip(he, mt) for p in pair]  # code and chat in every batch
    engine.generate(prompts[:1], max_new_tokens=2)
    plain = run(engine, prompts, None, a.bs, a.max_new_tokens)
    rows = []
    print("| N per request | mode | accepted / verified | tau | verified / round | tok/s | same as plain |")
    print("|---|---|---|---|---|---|---|")
    for n in [int(x) for x in a.sizes.split(",")]:
        depth = max(2, min(8, n // 2))
        fixed = {"policy": "eagle2", "budget": n, "topk": a.topk, "depth": depth}
        capped = {"policy": "eagle2", "budget": a.cap_factor * n, "topk": a.topk, "depth": depth + 2}
        for mode, spec, budget, cal in (("fixed", fixed, None, False), ("batch", capped, a.bs * n, False),
                                        ("batch+calibrated", capped, a.bs * n, True)):
            r = run(engine, prompts, spec, a.bs, a.max_new_tokens, budget, cal)
            if cal:
                r["depth_ratios"] = [round(x, 3) for x in engine.calibration.ratios().tolist()[:8]]
            r.update(n=n, mode=mode, same=r.pop("outputs") == plain["outputs"])
            rows.append(r)
            print(f"| {n} | {mode} | {r['accepted_per_verified']:.3f} | {r['tau']:.2f} | "
                  f"{r['verified_per_round']:.1f} | {r['tok_s']:.1f} | {'yes' if r['same'] else 'NO'} |", flush=True)
    print(f"plain: {plain['tok_s']:.1f} tok/s")
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"plain_tok_s": plain["tok_s"], "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
