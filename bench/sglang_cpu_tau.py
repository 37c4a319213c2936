"""tau of every policy inside real SGLang 0.5.23 on the CPU, next to native EAGLE, same engine, same prompts.

The held-out split (every 10th HumanEval / MT-bench prompt, as ``treespec bench --every 10``), greedy,
the demo target + shipped draft (token map), EAGLE topk 4 / steps 3 / N 8 by default. tau = 1 + accepted
drafts per verify round (SGLang's own counters for native requests, ``treespec_accept_lengths`` for ours).

    python bench/sglang_cpu_tau.py --max-new-tokens 64 --out bench/results/sglang_cpu
"""

import argparse
import json
import os
import tempfile
import time

from treespec_sglang.data.prompts import humaneval, mtbench
from treespec_sglang.engine import SpecEngine
from treespec_sglang.engine.loading import demo_draft_dir
from treespec_sglang.models.demo import demo_target
from treespec_sglang.plugin.cpu.host import EngineHost, cpu_engine_kwargs, eagle_kwargs


def policies(topk, steps, n):
    return {"native": None,
            "eagle2": {"policy": "eagle2", "budget": n, "topk": topk, "depth": steps},
            "talon": {"policy": "talon", "budget": n, "topk": topk, "mu": 0.03},
            "salf": {"policy": "salf", "budget": n, "batch": min(4, n), "th": 0.1},
            "c2t": {"policy": "c2t", "budget": n, "topk": topk, "beta": 0.5},
            "chain": {"policy": "chain", "length": steps}}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--topk", type=int, default=4)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--num-draft-tokens", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--every", type=int, default=10)
    ap.add_argument("--out", default="bench/results/sglang_cpu")
    a = ap.parse_args()
    draft = demo_draft_dir()
    enc = SpecEngine.from_pretrained("smollm2-135m", draft="demo")
    sets = {"humaneval": humaneval().every(a.every), "mtbench": mtbench().every(a.every)}
    ids = {k: enc.encode(v.prompts) for k, v in sets.items()}
    kw = cpu_engine_kwargs(demo_target(), **eagle_kwargs(draft, a.topk, a.steps, a.num_draft_tokens))
    host = EngineHost("tau", kw, tempfile.mkdtemp())
    rows = []
    try:
        for name, spec in policies(a.topk, a.steps, a.num_draft_tokens).items():
            for ds, prompt_ids in ids.items():
                sp = {"max_new_tokens": a.max_new_tokens, "temperature": 0.0}
                if spec:
                    sp["custom_params"] = {"treespec": spec}
                t = time.time()
                outs = host.generate(input_ids=prompt_ids, sampling_params=[sp] * len(prompt_ids))
                dt = time.time() - t
                acc = sum(o["meta_info"]["spec_num_correct_drafts"] for o in outs)
                rounds = sum(o["meta_info"]["spec_verify_ct"] for o in outs)
                toks = sum(o["meta_info"]["completion_tokens"] for o in outs)
                sizes = [s for o in outs for s in o["meta_info"].get("treespec_tree_sizes") or []]
                rows.append({"policy": name, "dataset": ds, "prompts": len(outs), "tau": 1 + acc / rounds,
                             "rounds": rounds, "tokens": toks, "seconds": dt,
                             "mean_tree_size": sum(sizes) / len(sizes) if sizes else a.num_draft_tokens})
                print(json.dumps(rows[-1]), flush=True)
    finally:
        host.close()
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "tau.json"), "w") as f:
        json.dump({"engine": kw, "start_seconds": host.start_seconds, "rows": rows}, f, indent=2)
    print("\n| policy | tau HumanEval | tau MT-bench | mean tree size | s (HE+MT) |\n|---|---|---|---|---|")
    for name in policies(a.topk, a.steps, a.num_draft_tokens):
        r = {x["dataset"]: x for x in rows if x["policy"] == name}
        print(f"| {name} | {r['humaneval']['tau']:.3f} | {r['mtbench']['tau']:.3f} | "
              f"{(r['humaneval']['mean_tree_size'] + r['mtbench']['mean_tree_size']) / 2:.1f} | "
              f"{r['humaneval']['seconds'] + r['mtbench']['seconds']:.0f} |")


if __name__ == "__main__":
    main()
