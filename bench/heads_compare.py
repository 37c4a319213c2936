"""Draft heads side by side on the held-out test split: alpha per draft position and tau per policy at
equal tree size N (EAGLE vs EAGLE-3, or one head's loss variants).

alpha: over the test sequences of a ``treespec train states`` directory (index % 10 == 0 of each prompt
set; its ``[final | captured layers]`` rows serve both kinds of head: an EAGLE head reads the final-norm
columns, an EAGLE-3 head the captured ones), against the full target vocabulary. tau: 1 + accepted drafts
per verify round, greedy, on the held-out HumanEval and MT-bench prompts (every 10th), each policy's preset
at budget N (chain: N - 1 drafted tokens), through the reference engine. A policy may carry overrides of its
preset, ``name:key=value:...`` (``eagle2:depth=8``, ``talon:topk=2``), to compare tree shapes at the same N.

    python bench/heads_compare.py --data data/distill-eagle3 --drafts demo,demo-eagle3 --budgets 8,16 \\
        --out bench/measured/cpu-zen5/heads_compare.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def variant_at(name: str, budget: int) -> dict:
    """``"eagle2:depth=8"`` at budget 16 -> the eagle2 preset at budget 16 with depth 8 (values int or float)."""
    from policy_table import policy_at

    base, *over = name.split(":")
    spec = policy_at(base, budget)
    for kv in over:
        k, v = kv.split("=", 1)
        spec[k] = float(v) if "." in v else int(v)
    return spec


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--data", required=True, help="a `treespec train states` directory")
    ap.add_argument("--drafts", default="demo,demo-eagle3", help="comma-separated draft directories / names")
    ap.add_argument("--policies", default="eagle2,talon,salf,c2t,chain")
    ap.add_argument("--budgets", default="8,16")
    ap.add_argument("--positions", type=int, default=4)
    ap.add_argument("--prompts", type=int, default=None, help="first N held-out prompts of each set (default all)")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--skip-alpha", action="store_true")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    import torch

    from treespec_sglang.data import humaneval, mtbench
    from treespec_sglang.engine import SpecEngine
    from treespec_sglang.engine.cost import _cpu_name
    from treespec_sglang.training.data import iter_sequences, load_shards, split_roles
    from treespec_sglang.training.trainer import TrainConfig, evaluate_alpha

    held = []
    if not a.skip_alpha:
        roles = split_roles(a.data, 10)
        held = [s for s, r in zip(iter_sequences(load_shards(a.data)), roles) if r == "test"]
    texts = humaneval().every(10).take(a.prompts).prompts + mtbench().every(10).take(a.prompts).prompts
    out = {"cpu": _cpu_name(), "threads": torch.get_num_threads(), "dtype": a.dtype, "max_new_tokens": a.max_new_tokens,
           "prompts": len(texts), "heldout_sequences": len(held), "heads": {}}
    for d in a.drafts.split(","):
        t0 = time.time()
        e = SpecEngine.from_pretrained("smollm2-135m", draft=d, dtype=a.dtype)
        row = {"kind": type(e.draft).__name__}
        if held:
            with torch.inference_mode():
                row["alpha"] = evaluate_alpha(e.draft, e.target.lm_head, held,
                                              TrainConfig(ttt_steps=a.positions, batch_size=8), e.token_map)
        ids = e.encode(texts)
        row["tau"] = {}
        for name in a.policies.split(","):
            for n in [int(x) for x in a.budgets.split(",")]:
                spec = variant_at(name, n)
                acc = []
                for i in range(0, len(ids), a.batch_size):
                    res = e.generate(ids[i:i + a.batch_size], max_new_tokens=a.max_new_tokens, policy=spec)
                    acc += [x for r in res for x in r.stats.accepted]
                row["tau"].setdefault(name, {})[str(n)] = 1 + sum(acc) / len(acc)
        out["heads"][d] = row
        print(f"{d} ({row['kind']}, {time.time() - t0:.0f} s): alpha {[round(x, 3) for x in row.get('alpha', [])]}, "
              f"tau {json.dumps({k: {n: round(v, 2) for n, v in t.items()} for k, t in row['tau'].items()})}",
              flush=True)
    names = list(out["heads"])
    print(f"\n{len(held)} held-out sequences (alpha), {len(texts)} held-out prompts (tau), {a.dtype}, {out['cpu']}")
    print("| head | " + " | ".join(f"alpha {k}" for k in range(a.positions)) + " |")
    print("|---|" + "---|" * a.positions)
    for d in names:
        print(f"| {d} | " + " | ".join(f"{x:.3f}" for x in out["heads"][d].get("alpha", [])) + " |")
    print("\n| policy | N | " + " | ".join(names) + (" | change |" if len(names) == 2 else " |"))
    print("|---|---|" + "---|" * (len(names) + (len(names) == 2)))
    for name in a.policies.split(","):
        for n in a.budgets.split(","):
            taus = [out["heads"][d]["tau"][name][n] for d in names]
            extra = f" | {taus[1] / taus[0] - 1:+.1%}" if len(taus) == 2 else ""
            print(f"| {name} | {n} | " + " | ".join(f"{t:.2f}" for t in taus) + extra + " |")
    if a.out:
        os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
        with open(a.out, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
