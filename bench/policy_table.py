"""A draft's acceptance table: tau, draft forwards and tree size per policy at each budget.

Each cell also keeps every prompt's own tau (``taus``): a batch runs until its slowest request is done, and a
plan for a batch prices that tail from their spread (:mod:`treespec_sglang.engine.batch_tail`).

Measured greedy on prompts the draft never trained on that are not the held-out test split (index % 10 == 0)
the benchmarks report (``--prompts-from``):

- ``validation`` (heads trained with ``treespec train draft``'s split, the EAGLE-3 head): HumanEval and MT-bench
  index % 10 == 5 (``treespec_sglang.training.data.split_roles``), alternating.
- ``unseen`` (heads trained before that split existed, the v2 EAGLE head: it trained on every HumanEval / MT-bench
  prompt outside the test split, validation included, and on the first 500 pycode and GSM8K prompts): pycode and
  GSM8K prompts past ``--seen``, evenly spaced, alternating code and math. pycode follows the running Python's
  standard library, so the table records the Python version.

The table records every prompt as ``set/index`` (``prompts``). Acceptance does not depend on the machine, so the
table ships beside the draft (``<draft>/policy_table.json``) and ``treespec demo`` combines it with the machine's
measured cost curve to pick each policy's budget (:func:`treespec_sglang.engine.cost.choose_budgets`).

Usage::

    python bench/policy_table.py --budgets 4,6,8,12,16,24 --prompts 16 --draft demo-eagle3 \
        --out treespec_sglang/assets/smollm2-135m-eagle3
    python bench/policy_table.py --budgets 4,6,8,12,16,24 --prompts 16 --draft demo --prompts-from unseen \
        --out treespec_sglang/assets/smollm2-135m-eagle
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time


def policy_at(name: str, budget: int) -> dict:
    from treespec_sglang.engine.runs import PRESETS

    d = dict(PRESETS[name])
    if name == "chain":
        d["length"] = budget - 1  # a chain of L drafted tokens verifies L + 1
    else:
        d["budget"] = budget
    return d


def table_prompts(source: str, n: int, seen: int = 500) -> tuple:
    """``(ids, prompts, about)``: ``n`` prompts as ``set/index`` ids, alternating between two prompt sets."""
    from treespec_sglang.data.prompts import PROMPT_SETS
    names = {"validation": ("humaneval", "mtbench"), "unseen": ("pycode", "gsm8k")}.get(source)
    if names is None:
        raise ValueError(f"--prompts-from must be 'validation' or 'unseen', got {source!r}")
    texts = {name: PROMPT_SETS[name]().prompts for name in names}  # each set loaded once (pycode walks the stdlib)
    if source == "validation":
        sets = [(name, list(range(5, len(texts[name]), 10))) for name in names]
        about = "validation prompts (HumanEval / MT-bench index % 10 == 5)"
    else:
        half = (n + 1) // 2
        sets = []
        for name in names:
            total = len(texts[name])
            if total - seen < half:
                raise ValueError(f"--seen {seen}: {name} has {total} prompts, fewer than {half} past it")
            step = (total - seen) // half
            sets.append((name, list(range(seen, seen + step * half, step))))
        about = (f"prompts the draft never saw (pycode / GSM8K index >= {seen}, evenly spaced; pycode from the "
                 f"Python {platform.python_version()} standard library)")
    picked = [(name, i) for pair in zip(*[[(name, i) for i in idx] for name, idx in sets]) for name, i in pair][:n]
    return [f"{name}/{i}" for name, i in picked], [texts[name][i] for name, i in picked], about


def width_of(spec: dict) -> int:
    return int(spec.get("topk", spec.get("batch", 1))) if spec["policy"] != "chain" else 1


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--policies", default="eagle2,talon,salf,c2t,chain")
    ap.add_argument("--budgets", default="4,6,8,12,16,24")
    ap.add_argument("--prompts", type=int, default=16, help="prompts (alternating two sets)")
    ap.add_argument("--prompts-from", default="validation", choices=("validation", "unseen"),
                    help="validation: HumanEval / MT-bench index %% 10 == 5; unseen: pycode / GSM8K past --seen")
    ap.add_argument("--seen", type=int, default=500, help="pycode / GSM8K prompts the draft trained on (unseen)")
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--draft", default="demo")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--out", required=True, help="directory to write policy_table.json into (the draft's)")
    a = ap.parse_args(argv)
    from treespec_sglang.engine import SpecEngine
    from treespec_sglang.engine.cost import POLICY_TABLE

    ids, prompts, about = table_prompts(a.prompts_from, a.prompts, a.seen)
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
                            f"{len(prompts)} {about}, {a.max_new_tokens} new tokens, dtype {engine.dtype}; "
                            "written by bench/policy_table.py",
                   "prompts": ids, "table": table}, f, indent=1)
    print(f"wrote {a.out}/{POLICY_TABLE} in {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
