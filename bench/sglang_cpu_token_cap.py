"""Inside real SGLang 0.5.23 on the CPU: ``--treespec-token-cap`` vs fixed per-request tree sizes.

One EAGLE server shape (topk 4 / steps 4 / N 16, the shipped draft + token map, ragged verify on). The fixed
rows give every request an EAGLE-2 tree of n nodes (``custom_params["treespec"]``); the batch rows run an
engine started with ``TREESPEC_TOKEN_CAP=n`` where every request proposes its EAGLE-2 tree of N nodes and
the round keeps the batch's ``bs * n`` best nodes: equal verified tokens per round. Held-out prompts (every
10th of HumanEval, MT-bench, GSM8K and the stdlib stubs, interleaved), greedy, 48 new tokens, at batch
sizes 8 and 32 (bs 1 has nothing to share). Reported: accepted draft tokens per verified token, tau, tok/s
of the whole call (median of ``--repeats`` interleaved runs), and whether the outputs equal the fixed-N
rows' (all must equal plain greedy).

    python bench/sglang_cpu_token_cap.py --sizes 2,4 --fixed-sizes 2,4,8 --out bench/results/token_cap
    python bench/sglang_cpu_token_cap.py --continuous 8 ...   # 32 requests, 8 running, refilled
"""

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

from treespec_sglang.engine import SpecEngine
from treespec_sglang.engine.loading import demo_draft_dir
from treespec_sglang.models.demo import demo_target
from treespec_sglang.plugin.cpu.host import EngineHost, cpu_engine_kwargs, eagle_kwargs

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from token_cap import heldout_prompts  # noqa: E402


def measure(host, prompts, bs, spec, max_new):
    toks = acc = verified = rounds = 0
    outs_all, t0 = [], time.time()
    for i in range(0, len(prompts), bs):
        ids = prompts[i:i + bs]
        sp = [{"max_new_tokens": max_new, "temperature": 0.0, "custom_params": {"treespec": spec}} for _ in ids]
        outs = host.generate(input_ids=ids, sampling_params=sp)
        for o in outs:
            m = o["meta_info"]
            toks += m["completion_tokens"]
            acc += sum(m["treespec_accept_lengths"])
            verified += sum(m["treespec_verify_tokens"])
            rounds += len(m["treespec_accept_lengths"])
            outs_all.append(o["output_ids"])
    dt = time.time() - t0
    return {"tok_s": toks / dt, "accepted_per_verified": acc / max(verified, 1), "tau": 1 + acc / max(rounds, 1),
            "verified_per_round": verified / max(rounds, 1), "seconds": dt, "outputs": outs_all}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--topk", type=int, default=4)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--num-draft-tokens", type=int, default=16)
    ap.add_argument("--sizes", default="2,4")
    ap.add_argument("--batch-sizes", default="8,32")
    ap.add_argument("--per-set", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--fixed-sizes", default="2,4,8", help="the fixed-N sweep")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--continuous", type=int, default=None, metavar="R",
                    help="serve with max_running_requests=R and submit every prompt at once: SGLang refills the "
                         "batch as requests finish (a server's steady state) instead of static batches of bs")
    ap.add_argument("--out", default="bench/results/token_cap")
    a = ap.parse_args()
    enc = SpecEngine.from_pretrained("smollm2-135m", draft="demo", dtype="float32")
    prompts = enc.encode(heldout_prompts(a.per_set))
    kw = cpu_engine_kwargs(demo_target(), **eagle_kwargs(demo_draft_dir(), a.topk, a.steps, a.num_draft_tokens))
    batch_sizes = [int(x) for x in a.batch_sizes.split(",")]
    if a.continuous:
        kw["max_running_requests"] = a.continuous
        batch_sizes = [len(prompts)]  # one call: the scheduler keeps `continuous` requests running
    full = {"policy": "eagle2", "budget": a.num_draft_tokens, "topk": a.topk, "depth": a.steps}
    sizes = [int(x) for x in a.sizes.split(",")]
    fixed_sizes = [int(x) for x in a.fixed_sizes.split(",")]
    # one engine per TREESPEC_TOKEN_CAP value, one at a time (an idle SGLang scheduler polls and would
    # slow the others down); each configuration runs --repeats times and reports the median
    runs = {}
    for env in [None] + sizes:
        host = EngineHost(f"token-cap-{env}", kw, tempfile.mkdtemp(), env={"TREESPEC_TOKEN_CAP": str(env)} if env else {})
        try:
            host.generate(input_ids=prompts[:1], sampling_params=[{"max_new_tokens": 4}])  # warm-up
            for rep in range(a.repeats):
                for bs in batch_sizes:
                    for n in (fixed_sizes if env is None else [env]):
                        mode = "fixed" if env is None else "batch"
                        spec = dict(full, budget=n, depth=max(1, min(a.steps, n - 1))) if env is None else full
                        r = measure(host, prompts, bs, spec, a.max_new_tokens)
                        r.update(mode=mode, n=n, bs=bs, rep=rep)
                        runs.setdefault((mode, n, bs), []).append(r)
                        print(json.dumps({k: v for k, v in r.items() if k != "outputs"}), flush=True)
        finally:
            host.close()
    rows = []
    for (mode, n, bs), rs in runs.items():
        r = dict(rs[0])
        r["tok_s_runs"] = [x["tok_s"] for x in rs]
        r["tok_s"] = statistics.median(r["tok_s_runs"])
        rows.append(r)
    os.makedirs(a.out, exist_ok=True)
    name = f"sglang_cpu_continuous{a.continuous}.json" if a.continuous else "sglang_cpu.json"
    with open(os.path.join(a.out, name), "w") as f:
        json.dump({"engine": kw, "rows": [{k: v for k, v in r.items() if k != "outputs"} for r in rows]}, f, indent=2)
    print("\n| bs | n (tokens / request / round) | mode | accepted / verified | tau | verified / round | tok/s | "
          "same output as fixed |\n|---|---|---|---|---|---|---|---|")
    ref = next(x for x in rows if x["mode"] == "fixed")
    for r in sorted(rows, key=lambda x: (x["bs"], x["n"], x["mode"])):
        print(f"| {r['bs']} | {r['n']} | {r['mode']} | {r['accepted_per_verified']:.3f} | {r['tau']:.2f} | "
              f"{r['verified_per_round']:.2f} | {r['tok_s']:.1f} | {r['outputs'] == ref['outputs']} |")
    for bs in sorted({r["bs"] for r in rows}):
        f = max((r for r in rows if r["bs"] == bs and r["mode"] == "fixed"), key=lambda r: r["tok_s"])
        b = max((r for r in rows if r["bs"] == bs and r["mode"] == "batch"), key=lambda r: r["tok_s"])
        print(f"bs {bs}: best fixed n={f['n']} {f['tok_s']:.1f} tok/s, best batch n={b['n']} {b['tok_s']:.1f} tok/s: "
              f"{b['tok_s'] / f['tok_s'] - 1:+.1%}")


if __name__ == "__main__":
    main()
