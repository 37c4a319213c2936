"""``treespec demo``: the demo target + shipped draft on held-out HumanEval and MT-bench prompts, every
policy side by side with plain decoding and two transformers peers, measured in the same run.

Defaults: bs 1, the engine's dtype ``auto`` (bf16 on AMX / AVX512-BF16 CPUs; plain decoding
and the peers in the same dtype), and each policy's budget chosen for *this* machine from its
measured cost curve and the draft's acceptance table (:mod:`treespec_sglang.engine.cost`).
"""

from __future__ import annotations

import argparse
import os

from ..engine.runs import (draft_dir_of, failed_requests, format_table, label, parse_policies, pick_budgets,
                           plan_vs_measured, run_policy, verdict)
from ..verify.sampling import is_greedy
from .runs import PACK, add_dtype, int_at_least, set_threads

__all__ = ["add_parser"]


def add_parser(sub) -> None:
    p = sub.add_parser("demo", help="run the demo target with every policy vs plain decoding and print a table")
    p.add_argument("--target", default="smollm2-135m", help="HF Llama-family directory or 'smollm2-135m'")
    p.add_argument("--draft", default="demo-eagle3",
                   help="draft directory (EAGLE or EAGLE-3), 'demo-eagle3' (the shipped EAGLE-3 head), 'demo' (the "
                        "shipped EAGLE head) or 'random'")
    p.add_argument("--policies", default="eagle2,talon,salf,c2t,chain", help="comma-separated presets")
    p.add_argument("--policy-json", default=None, help="extra policy dict(s) as JSON")
    p.add_argument("--budget", type=int, default=None,
                   help="one budget for every preset (default: per policy, from this machine's cost curve)")
    p.add_argument("--humaneval", type=int_at_least(0), default=2, help="number of held-out HumanEval prompts")
    p.add_argument("--mtbench", type=int_at_least(0), default=2, help="number of held-out MT-bench prompts")
    p.add_argument("--max-new-tokens", type=int_at_least(1), default=64)
    p.add_argument("--batch-size", type=int_at_least(1), default=1)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int_at_least(0), default=0)
    p.add_argument("--threads", type=int_at_least(1), default=None)
    p.add_argument("--no-peers", action="store_true", help="skip the transformers greedy / prompt-lookup rows")
    p.add_argument("--lookup", type=int_at_least(1), default=10,
                   help="prompt_lookup_num_tokens of the transformers peer")
    add_dtype(p)
    p.set_defaults(fn=run)


def run(a: argparse.Namespace) -> int:
    from tqdm import tqdm

    from ..data import humaneval, mtbench
    from ..engine import SpecEngine
    from ..engine.loading import demo_draft_dir, resolve_target

    set_threads(a.threads)
    specs = parse_policies(a.policies, a.policy_json, a.budget)
    prompts = humaneval().every(10).take(a.humaneval).prompts + mtbench().every(10).take(a.mtbench).prompts
    print(f"loading {a.target} + draft {a.draft} ...", flush=True)
    engine = SpecEngine.from_pretrained(a.target, draft=None if a.draft == "random" else a.draft, seed=a.seed,
                                        dtype=a.dtype, pack=PACK[a.pack])
    # stdout: an error after it stays one line
    print(f"dtype {engine.dtype_note}; linears {engine.pack_note}", flush=True)
    engine.generate(prompts[:1], max_new_tokens=2)  # warm-up (allocator, threads)
    plans = {}
    specs, notes = pick_budgets(engine, specs, draft_dir_of(a.draft), a.budget, bs=a.batch_size, plans=plans)
    print("\n".join(notes), flush=True)
    specs = [None] + specs
    ids = engine.encode(prompts)
    runs, peers = [], []
    total = (len(specs) + (0 if a.no_peers else 2)) * len(prompts) * a.max_new_tokens
    with tqdm(total=total, unit="tok", desc="demo", leave=False) as bar:
        for spec in specs:
            runs.append(run_policy(engine, ids, spec, max_new_tokens=a.max_new_tokens, batch_size=a.batch_size,
                                   temperature=a.temperature, seed=a.seed, bar=bar))
        if not a.no_peers and is_greedy(a.temperature):
            from .peers import HFPeer

            hf = HFPeer(resolve_target(a.target), engine.dtype, sorted(engine.eos))
            hf.generate(ids[0], 2)  # warm-up
            peers = [hf.run("hf-greedy", ids, a.max_new_tokens, bar=bar),
                     hf.run(f"hf-lookup k={a.lookup}", ids, a.max_new_tokens,
                            lookup=a.lookup, bar=bar)]
    verdicts = [verdict(engine, ids, runs[0], r, a.temperature) for r in runs]
    print(f"\n{len(prompts)} held-out prompts ({a.humaneval} HumanEval + {a.mtbench} MT-bench, every 10th), "
          f"batch {a.batch_size}, {a.max_new_tokens} new tokens, T={a.temperature}, dtype {engine.dtype}; "
          f"tau = tokens per verify round, delta = draft forwards per round, tree = mean nodes verified")
    print(format_table(runs, a.temperature, verdicts=verdicts, peers=peers))
    print("\n".join(plan_vs_measured(runs, plans)))
    best = max(runs[1:], key=lambda r: r.tokens_per_s, default=None)
    if best is not None and peers:
        print(f"best policy {label(best.spec)}: {best.tokens_per_s / runs[0].tokens_per_s:.2f}x our plain, "
              f"{best.tokens_per_s / peers[1].tokens_per_s:.2f}x transformers prompt lookup, "
              f"{best.tokens_per_s / peers[0].tokens_per_s:.2f}x transformers greedy")
    if a.draft == "demo" and not os.path.isfile(os.path.join(demo_draft_dir(), "model.safetensors")):
        print("note: no trained draft head is installed; a seeded random head was used, so tau ~ 1 here")
    return 1 if failed_requests(runs) else 0
