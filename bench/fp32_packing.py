"""float32 oneDNN prepacking, side by side in one run: the same engine with plain ``nn.Linear`` and with
prepacked linears (``SpecEngine(pack=False / True)``), plain decoding and tree policies on held-out prompts.

Prints (and writes ``--out`` as JSON):

1. the target's linears at M = 1 / 8 / 16 rows, default vs prepacked (median us, 2 threads unless
   ``--threads``), and whether each packed row equals the row computed alone (batch invariance);
2. per engine and policy: tok/s, tau, the budget that engine's cost curve chose, speedup over its own plain
   decoding and over the *unpacked* plain decoding, and whether greedy outputs equal its own plain greedy
   (lossless) token for token.

Runs are interleaved (policy-major, unpacked then packed) so that drift on a shared machine hits both.

    python bench/fp32_packing.py --humaneval 8 --mtbench 8 --policies salf,talon,eagle2 \\
        --out bench/measured/cpu-epyc-avx2/fp32_packing.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def _median_us(fn, repeats=30):
    from treespec_sglang.engine.cost import _median_ms

    return 1e3 * _median_ms(fn, repeats)


@torch.inference_mode()
def linear_rows(target):
    """The target's distinct linear shapes at M = 1 / 8 / 16: default vs prepacked us, batch invariance."""
    from treespec_sglang.models.packing import PackedLinear

    shapes, rows = {}, []
    for m in target.modules():
        if isinstance(m, torch.nn.Linear):
            shapes.setdefault((m.in_features, m.out_features), m)
    for (i, o), lin in sorted(shapes.items()):
        p = PackedLinear(lin)
        for M in (1, 8, 16):
            x = torch.randn(M, i)
            alone = torch.cat([p(x[r:r + 1]) for r in range(M)])
            rows.append({"in": i, "out": o, "M": M, "default_us": _median_us(lambda: lin(x)),
                         "packed_us": _median_us(lambda: p(x)), "packed_batch_invariant": torch.equal(alone, p(x)),
                         "default_batch_invariant": torch.equal(torch.cat([lin(x[r:r + 1]) for r in range(M)]), lin(x))})
    return rows


def main() -> int:
    from treespec_sglang.engine.runs import draft_dir_of, label, parse_policies, pick_budgets, run_policy
    from treespec_sglang.data import humaneval, mtbench
    from treespec_sglang.engine import SpecEngine
    from treespec_sglang.engine.cost import _cpu_name

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--draft", default="demo-eagle3")
    ap.add_argument("--policies", default="salf,talon,eagle2")
    ap.add_argument("--humaneval", type=int, default=8)
    ap.add_argument("--mtbench", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--batch-size", type=int, default=1)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    prompts = humaneval().every(10).take(a.humaneval).prompts + mtbench().every(10).take(a.mtbench).prompts
    engines = {name: SpecEngine.from_pretrained("smollm2-135m", draft=a.draft, dtype="float32", pack=pack)
               for name, pack in (("unpacked", False), ("packed", True))}
    cpu = _cpu_name()
    print(f"{cpu}, {torch.get_num_threads()} threads, torch {torch.__version__}; packed: {engines['packed'].pack_note}")
    lin = linear_rows(engines["unpacked"].target)
    print("| in x out | M | default us | packed us | ratio | packed batch-invariant | default batch-invariant |")
    print("|---|---|---|---|---|---|---|")
    for r in lin:
        print(f"| {r['in']}x{r['out']} | {r['M']} | {r['default_us']:.0f} | {r['packed_us']:.0f} | "
              f"{r['default_us'] / r['packed_us']:.2f}x | {r['packed_batch_invariant']} | {r['default_batch_invariant']} |")
    ids = engines["unpacked"].encode(prompts)
    specs = {}
    for name, e in engines.items():
        e.generate(ids[:1], max_new_tokens=2)  # warm-up
        specs[name], notes = pick_budgets(e, parse_policies(a.policies), draft_dir_of(a.draft), None, bs=a.batch_size)
        print(f"{name}: " + "; ".join(notes))
    runs = {name: [] for name in engines}
    for k in range(len(specs["unpacked"]) + 1):
        for name, e in engines.items():
            spec = None if k == 0 else specs[name][k - 1]
            runs[name].append(run_policy(e, ids, spec, max_new_tokens=a.max_new_tokens, batch_size=a.batch_size))
            r = runs[name][-1]
            print(f"  {name:<8} {label(spec):<40} {r.tokens_per_s:6.1f} tok/s  tau {r.tau:.2f}", flush=True)
    base = runs["unpacked"][0].tokens_per_s
    rows = []
    print(f"\n{len(prompts)} held-out prompts, {a.max_new_tokens} new tokens, bs {a.batch_size}, float32, T=0")
    print("| linears | policy | tok/s | tau | vs own plain | vs unpacked plain | == own plain greedy | == other engine |")
    print("|---|---|---|---|---|---|---|---|")
    for k in range(len(runs["unpacked"])):
        for name in engines:
            r, own, other = runs[name][k], runs[name][0], runs["packed" if name == "unpacked" else "unpacked"][k]
            outs = [x.token_ids for x in r.results]
            row = {"linears": name, "policy": label(r.spec), "tok_s": r.tokens_per_s, "tau": r.tau,
                   "vs_own_plain": r.tokens_per_s / own.tokens_per_s, "vs_unpacked_plain": r.tokens_per_s / base,
                   "equal_own_plain": sum(o == p.token_ids for o, p in zip(outs, own.results)),
                   "equal_other_engine": sum(o == p.token_ids for o, p in zip(outs, other.results)), "n": len(outs)}
            rows.append(row)
            print(f"| {name} | {row['policy']} | {row['tok_s']:.1f} | {row['tau']:.2f} | {row['vs_own_plain']:.2f}x | "
                  f"{row['vs_unpacked_plain']:.2f}x | {row['equal_own_plain']}/{row['n']} | "
                  f"{row['equal_other_engine']}/{row['n']} |")
    if a.out:
        os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
        with open(a.out, "w") as f:
            json.dump({"cpu": cpu, "threads": torch.get_num_threads(), "torch": torch.__version__,
                       "args": vars(a), "linears": lin, "runs": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
