"""Padded vs ragged verify in real SGLang 0.5.23 on the CPU: time per verify round, tokens/s, verified tokens.

Two engines with the same server shape (EAGLE topk 8 / steps 4 / N 32 by default: requests may ask for
smaller trees), one with ``TREESPEC_RAGGED_VERIFY=0`` (every request verifies N tokens, filler unlinked),
one with ragged verify (each request verifies its own tree). Held-out HumanEval prompts, greedy, at
batch sizes 1 / 4 / 8, with C2T and SALF trees and a mix of small and large budgets.

    python bench/sglang_cpu_ragged.py --max-new-tokens 48 --out bench/results/sglang_cpu
"""

import argparse
import json
import os
import tempfile
import time

from treespec_sglang.data.prompts import humaneval
from treespec_sglang.engine import SpecEngine
from treespec_sglang.engine.loading import demo_draft_dir
from treespec_sglang.models.demo import demo_target
from treespec_sglang.plugin.cpu.host import EngineHost, cpu_engine_kwargs, eagle_kwargs


def workloads(topk, steps, n):
    return {
        "c2t": lambda i: {"policy": "c2t", "budget": n, "topk": topk, "beta": 0.5},
        "salf": lambda i: {"policy": "salf", "budget": n, "batch": topk, "th": 0.6},
        "mix 8/32": lambda i: ({"policy": "talon", "budget": 8, "topk": topk, "mu": 0.03} if i % 2 == 0
                               else {"policy": "eagle2", "budget": n, "topk": topk, "depth": steps}),
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--topk", type=int, default=8)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--num-draft-tokens", type=int, default=32)
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--batch-sizes", default="1,4,8")
    ap.add_argument("--out", default="bench/results/sglang_cpu")
    a = ap.parse_args()
    draft = demo_draft_dir()
    enc = SpecEngine.from_pretrained("smollm2-135m", draft="demo")
    prompts = enc.encode(humaneval().every(10).prompts)
    kw = cpu_engine_kwargs(demo_target(), **eagle_kwargs(draft, a.topk, a.steps, a.num_draft_tokens))
    rows = []
    for mode in ("padded", "ragged"):
        host = EngineHost(mode, kw, tempfile.mkdtemp(), env={"TREESPEC_RAGGED_VERIFY": "1" if mode == "ragged" else "0"})
        try:
            host.generate(input_ids=prompts[:1], sampling_params=[{"max_new_tokens": 4}])  # warm-up
            for bs in [int(x) for x in a.batch_sizes.split(",")]:
                for name, spec in workloads(a.topk, a.steps, a.num_draft_tokens).items():
                    ids = [prompts[i % len(prompts)] for i in range(bs)]
                    sp = [{"max_new_tokens": a.max_new_tokens, "temperature": 0.0, "ignore_eos": True,
                           "custom_params": {"treespec": spec(i)}} for i in range(bs)]
                    t = time.time()
                    outs = host.generate(input_ids=ids, sampling_params=sp)
                    dt = time.time() - t
                    rounds = max(o["meta_info"]["spec_verify_ct"] for o in outs)
                    verified = sum(sum(o["meta_info"]["treespec_verify_tokens"]) for o in outs)
                    sizes = sum(sum(o["meta_info"]["treespec_tree_sizes"]) for o in outs)
                    toks = sum(o["meta_info"]["completion_tokens"] for o in outs)
                    row = {"mode": mode, "bs": bs, "workload": name, "seconds": dt, "tok_s": toks / dt,
                           "rounds": rounds, "ms_per_round": 1000 * dt / rounds,
                           "verified_per_round": verified / rounds, "tree_nodes_per_round": sizes / rounds,
                           "output_ids": [o["output_ids"] for o in outs]}
                    rows.append(row)
                    print(json.dumps({k: v for k, v in row.items() if k != "output_ids"}), flush=True)
        finally:
            host.close()
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "ragged.json"), "w") as f:
        json.dump({"engine": kw, "rows": rows}, f)
    print("\n| bs | trees | padded ms/round | ragged ms/round | padded tok/s | ragged tok/s | verified tokens/round "
          "padded -> ragged | same output |\n|---|---|---|---|---|---|---|---|")
    for r in (x for x in rows if x["mode"] == "ragged"):
        p = next(x for x in rows if x["mode"] == "padded" and x["bs"] == r["bs"] and x["workload"] == r["workload"])
        print(f"| {r['bs']} | {r['workload']} | {p['ms_per_round']:.0f} | {r['ms_per_round']:.0f} | {p['tok_s']:.1f} | "
              f"{r['tok_s']:.1f} | {p['verified_per_round']:.1f} -> {r['verified_per_round']:.1f} | "
              f"{p['output_ids'] == r['output_ids']} |")


if __name__ == "__main__":
    main()
