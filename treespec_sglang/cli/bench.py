"""``treespec bench``: policies over whole prompt sets; JSONL results, a tau-vs-delta plot per policy
(TALON Fig. 6) and an acceptance-by-position heatmap (TALON Fig. 3)."""

from __future__ import annotations

import argparse
import json
import os
import sys

from ..engine.runs import (draft_dir_of, failed_requests, format_table, label, parse_policies, pick_budgets,
                           run_policy, verdict)
from .runs import PACK, add_dtype, int_at_least, set_threads

__all__ = ["add_parser", "write_outputs"]


def add_parser(sub) -> None:
    p = sub.add_parser("bench", help="run policies over HumanEval / MT-bench, write JSONL and plots")
    p.add_argument("--target", default="smollm2-135m")
    p.add_argument("--draft", default="demo")
    p.add_argument("--prompts", default="humaneval,mtbench", help="comma-separated prompt sets")
    p.add_argument("--limit", type=int_at_least(1), default=None, help="first N prompts of each set")
    p.add_argument("--every", type=int_at_least(1), default=1,
                   help="only prompts whose index %% N == 0 (e.g. 10: the split `train draft` holds out)")
    p.add_argument("--policies", default="eagle2,talon,salf,c2t,chain")
    p.add_argument("--policy-json", default=None)
    p.add_argument("--budget", type=int, default=None)
    p.add_argument("--auto-budgets", action="store_true",
                   help="per policy, the budget this machine's cost curve favours at --batch-size (as `demo` does)")
    p.add_argument("--max-new-tokens", type=int_at_least(1), default=64)
    p.add_argument("--batch-size", type=int_at_least(1), default=8)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int_at_least(0), default=0)
    p.add_argument("--threads", type=int_at_least(1), default=None)
    add_dtype(p)
    p.add_argument("--out", default="bench/results/engine", help="output directory")
    p.set_defaults(fn=run)


def run(a: argparse.Namespace) -> int:
    from tqdm import tqdm

    from ..data import load_prompt_set
    from ..engine import SpecEngine

    set_threads(a.threads)
    specs = [None] + parse_policies(a.policies, a.policy_json, a.budget)
    sets = [load_prompt_set(n.strip()).every(a.every).take(a.limit) for n in a.prompts.split(",") if n.strip()]
    engine = SpecEngine.from_pretrained(a.target, draft=None if a.draft == "random" else a.draft, seed=a.seed,
                                        dtype=a.dtype, pack=PACK[a.pack])
    # stdout: an error after it stays one line
    print(f"dtype {engine.dtype_note}; linears {engine.pack_note}", flush=True)
    if a.auto_budgets:
        picked, notes = pick_budgets(engine, specs[1:], draft_dir_of(a.draft), a.budget, bs=a.batch_size)
        specs = [None] + picked
        print("\n".join(notes), flush=True)
    os.makedirs(a.out, exist_ok=True)
    all_runs = {}
    for ps in sets:
        runs = []
        with tqdm(total=len(specs) * len(ps.prompts) * a.max_new_tokens, unit="tok", desc=ps.name) as bar:
            for spec in specs:
                runs.append(run_policy(engine, ps.prompts, spec, max_new_tokens=a.max_new_tokens,
                                       batch_size=a.batch_size, temperature=a.temperature, seed=a.seed, bar=bar))
        print(f"\n{ps.name}: {len(ps.prompts)} prompts, batch {a.batch_size}, dtype {engine.dtype}")
        try:  # what generate() ran on: the verdict re-checks bf16 divergences on them
            ids = engine.encode(ps.prompts)
        except ValueError:  # a prompt generate() refused: its requests failed, and the verdict says so first
            ids = None
        print(format_table(runs, a.temperature, verdicts=[verdict(engine, ids, runs[0], r, a.temperature) for r in runs]))
        all_runs[ps.name] = (ps, runs)
    write_outputs(all_runs, a.out, vars(a))
    print(f"\nwrote {a.out}/results.jsonl, tau_delta.png, acceptance_heatmap.png")
    failed = sum(failed_requests(runs) for _, runs in all_runs.values())
    if failed:
        print(f"treespec bench: {failed} request(s) failed (see the table and results.jsonl)", file=sys.stderr)
    return 1 if failed else 0


def write_outputs(all_runs: dict, out: str, args: dict) -> None:
    with open(os.path.join(out, "results.jsonl"), "w") as f:
        for set_name, (ps, runs) in all_runs.items():
            for r in runs:
                for pid, res in zip(ps.ids, r.results):
                    f.write(json.dumps(dict(prompt_set=set_name, prompt_id=pid, policy=label(r.spec), spec=r.spec,
                                            new_tokens=len(res.token_ids), accepted=res.stats.accepted,
                                            tree_sizes=res.stats.tree_sizes, draft_forwards=res.stats.draft_forwards,
                                            rounds=res.stats.rounds, error=res.error)) + "\n")
                f.write(json.dumps(dict(prompt_set=set_name, policy=label(r.spec), summary=True, seconds=r.seconds,
                                        tokens_per_s=r.tokens_per_s, tau=r.tau, delta=r.delta, mean_tree=r.mean_tree,
                                        args={k: v for k, v in args.items() if k != "fn"})) + "\n")
    plot(all_runs, out)


def plot(all_runs: dict, out: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, ax = plt.subplots(figsize=(6, 4.5))
    for set_name, (_, runs) in all_runs.items():
        for r in runs:
            if r.spec is None:
                continue
            ax.scatter(r.delta, r.tau, label=f"{set_name}: {label(r.spec)}")
    ax.set_xlabel("delta = draft forwards per verify round")
    ax.set_ylabel("tau = tokens per verify round")
    ax.set_title("tau vs delta per policy (TALON Fig. 6)")
    ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(os.path.join(out, "tau_delta.png"), dpi=120)
    plt.close(fig)

    rows, names = [], []
    for set_name, (_, runs) in all_runs.items():
        for r in runs:
            if r.spec is None:
                continue
            acc = np.array([a for res in r.results for a in res.stats.accepted] or [0])
            depth = max(8, int(acc.max()) + 1)
            rows.append([(acc >= d).mean() for d in range(1, depth + 1)])
            names.append(f"{set_name}: {label(r.spec)}")
    if rows:
        width = max(len(x) for x in rows)
        mat = np.array([x + [0.0] * (width - len(x)) for x in rows])
        fig, ax = plt.subplots(figsize=(1 + 0.5 * width, 1 + 0.35 * len(rows)))
        im = ax.imshow(mat, vmin=0, vmax=1, cmap="viridis", aspect="auto")
        ax.set_xticks(range(width), [str(d) for d in range(1, width + 1)])
        ax.set_yticks(range(len(names)), names, fontsize=6)
        ax.set_xlabel("draft position d (P[accepted length >= d])")
        ax.set_title("acceptance by position (TALON Fig. 3)")
        fig.colorbar(im)
        fig.tight_layout()
        fig.savefig(os.path.join(out, "acceptance_heatmap.png"), dpi=120)
        plt.close(fig)
