"""A draft's acceptance table: tau, draft forwards and tree size per policy at each budget.

Each cell also keeps every prompt's own tau (``taus``): a batch runs until its slowest request is done, and a
plan for a batch prices that tail from their spread (:mod:`treespec_sglang.engine.batch_tail`).

Measured on the *validation* prompts (index % 10 == 5 of HumanEval and MT-bench,
``treespec_sglang.training.data.split_roles``): neither the held-out every-10th test split the benchmarks
report nor data a head trained with ``treespec train draft`` has seen (heads trained before that split existed,
the v2 EAGLE head included, did train on them: their tables overestimate), greedy. Acceptance does not depend on the
machine, so the table ships beside the draft (``<draft>/policy_table.json``) and ``treespec demo``
combines it with the machine's measured cost curve to pick each policy's budget
(:func:`treespec_sglang.engine.cost.choose_budgets`).

Usage::

    python bench/policy_table.py --budgets 4,6,8,12,16,24 --prompts 16 --draft demo-eagle3 \
        --out treespec_sglang/assets/smollm2-135m-eagle3
"""

from __future__ import annotations

import argparse
import json
import os
import time


def policy_at(name: str, budget: int) -> dict:
    from treespec_sglang.engine.runs import PRESETS

    d = dict(PRESETS[name])
    if name == "chain":
        d["length"] = budget - 1  # a chain of L drafted tokens verifies L + 1
    else:
        d["budget"] = budget
    return d


def width_of(spec: dict) -> int:
    return int(spec.get("topk", spec.get("batch", 1))) if spec["policy"] != "chain" else 1


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--policies", default="eagle2,talon,salf,c2t,chain")
    ap.add_argument("--budgets", default="4,6,8,12,16,24")
    ap.add_argument("--prompts", type=int, default=16, help="validation prompts (alternating sets)")
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--draft", default="demo")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--out", required=True, help="directory to write policy_table.json into (the draft's)")
    a = ap.parse_args(argv)
    from treespec_sglang.data import humaneval, mtbench
    from treespec_sglang.engine import SpecEngine
    from treespec_sglang.engine.cost import POLICY_TABLE

    he, mt = humaneval().every(10, offset=5), mtbench().every(10, offset=5)
    prompts = [x for pair in zip(he.prompts, mt.prompts) for x in pair][:a.prompts]
    engine = SpecEngine.from_pretrained("smollm2-135m", draft=a.draft, dtype=a.dtype)
    table, t0 = {}, time.time()
    for name in a.policies.split(","):
        table[name] = {}
        for n in [int(x) for x in a.budgets.split(",")]:
            spec = policy_at(name, n)
            res = engine.generate(prompts, max_new_tokens=a.max_new_tokens, policy=spec)
            acc = [x for r in res for x in r.stats.accepted]
            sizes = [x for r in res for x in r.stats.tree_sizes]
            fwd = sum(r.stats.draft_forwards for r in res)
            taus = [1 + sum(r.stats.accepted) / len(r.stats.accepted) for r in res if r.stats.accepted]
            table[name][str(n)] = dict(tau=1 + sum(acc) / len(acc), delta=fwd / len(acc), tree=sum(sizes) / len(sizes),
                                       width=width_of(spec), taus=[round(t, 4) for t in taus], spec=spec)
            r = table[name][str(n)]
            print(f"{name:>7} N={n:<3} tau {r['tau']:.2f} delta {r['delta']:.2f} tree {r['tree']:.1f}", flush=True)
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, POLICY_TABLE), "w") as f:
        json.dump({"about": "tau / draft forwards (delta) / verified tokens (tree) per round and each prompt's own tau "
                            "(taus: what a batch plan prices its tail from), greedy, on "
                            f"{len(prompts)} validation prompts (HumanEval / MT-bench index % 10 == 5), "
                            f"{a.max_new_tokens} new tokens, dtype {engine.dtype}; written by bench/policy_table.py",
                   "table": table}, f, indent=1)
    print(f"wrote {a.out}/{POLICY_TABLE} in {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
