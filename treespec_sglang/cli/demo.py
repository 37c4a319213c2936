"""``treespec demo``: the demo target + shipped draft on a few HumanEval and MT-bench prompts,
policies side by side with plain decoding, measured in the same run."""

from __future__ import annotations

import argparse
import os

from .runs import add_dtype, failed_requests, format_table, parse_policies, run_policy, set_threads

__all__ = ["add_parser"]


def add_parser(sub) -> None:
    p = sub.add_parser("demo", help="run the demo target with two policies vs plain decoding and print a table")
    p.add_argument("--target", default="smollm2-135m", help="HF Llama-family directory or 'smollm2-135m'")
    p.add_argument("--draft", default="demo", help="EAGLE draft directory, 'demo' (shipped) or 'random'")
    p.add_argument("--policies", default="eagle2,talon", help="comma-separated presets")
    p.add_argument("--policy-json", default=None, help="extra policy dict(s) as JSON")
    p.add_argument("--budget", type=int, default=None, help="override the presets' budget")
    p.add_argument("--humaneval", type=int, default=2, help="number of HumanEval prompts")
    p.add_argument("--mtbench", type=int, default=2, help="number of MT-bench prompts")
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None)
    add_dtype(p)
    p.set_defaults(fn=run)


def run(a: argparse.Namespace) -> int:
    from tqdm import tqdm

    from ..data import humaneval, mtbench
    from ..engine import SpecEngine

    set_threads(a.threads)
    specs = [None] + parse_policies(a.policies, a.policy_json, a.budget)
    prompts = humaneval().take(a.humaneval).prompts + mtbench().take(a.mtbench).prompts
    print(f"loading {a.target} + draft {a.draft} ...", flush=True)
    engine = SpecEngine.from_pretrained(a.target, draft=None if a.draft == "random" else a.draft, seed=a.seed,
                                        dtype=a.dtype)
    engine.generate(prompts[:1], max_new_tokens=2)  # warm-up (allocator, threads)
    runs = []
    total = len(specs) * len(prompts) * a.max_new_tokens
    with tqdm(total=total, unit="tok", desc="demo", leave=False) as bar:
        for spec in specs:
            runs.append(run_policy(engine, prompts, spec, max_new_tokens=a.max_new_tokens, batch_size=a.batch_size,
                                   temperature=a.temperature, seed=a.seed, bar=bar))
    print(f"\n{len(prompts)} prompts ({a.humaneval} HumanEval + {a.mtbench} MT-bench), batch {a.batch_size}, "
          f"{a.max_new_tokens} new tokens, T={a.temperature}; tau = tokens per verify round, "
          f"delta = draft forwards per round, tree = mean nodes verified")
    print(format_table(runs, a.temperature))
    if a.draft == "demo":
        from ..engine.loading import demo_draft_dir

        if not os.path.isfile(os.path.join(demo_draft_dir(), "model.safetensors")):
            print("note: no trained draft head is installed; a seeded random head was used, so tau ~ 1 here")
    return 1 if failed_requests(runs) else 0
