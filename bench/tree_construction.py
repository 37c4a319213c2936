"""Micro-benchmark: one tree-construction step per policy vs. EAGLE-2's dual top-k (TALON App. E.6).

Draft next-token distributions are Zipf, P(r) ~ 1 / r^alpha (alpha 0.7 creative, 1.35 natural
language, 5.0 code), with the ranks scattered over the vocabulary by a per-row rotation. Each
policy is started from the root (untimed), then its first expansion step (10 frontier nodes;
chain: 1) is timed from the same snapshot: ``warmup`` untimed runs, then the mean of ``reps``.
All policies are timed side by side in one run; the ratio column is vs. ``eagle2``.

Usage::

    python bench/tree_construction.py --quick          # vocab 32K, bs 1/16, alpha 1.35
    python bench/tree_construction.py                   # the full grid (slow on 2 CPU cores)
    python bench/tree_construction.py --json out.jsonl  # also write one JSON line per cell
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time

import torch

from treespec_sglang.policies import POLICIES, parse_spec
from treespec_sglang.utils import count_host_syncs

POLICY_SPECS = {
    "eagle2": {"policy": "eagle2", "budget": 60, "topk": 10, "depth": 6},
    "talon": {"policy": "talon", "budget": 60, "topk": 10, "mu": 0.03},
    "salf": {"policy": "salf", "budget": 60, "batch": 10, "th": 0.6},
    "c2t": {"policy": "c2t", "budget": 60, "topk": 10, "beta": 0.5},
    "chain": {"policy": "chain", "length": 6},
}


def zipf_logprobs(shape, vocab: int, alpha: float, gen: torch.Generator) -> torch.Tensor:
    """``shape + (vocab,)`` log-probs: Zipf(alpha) over ranks, rotated by a random offset per row."""
    ranks = torch.arange(1, vocab + 1, dtype=torch.float64)
    lp = (-alpha * ranks.log())
    lp = (lp - torch.logsumexp(lp, 0)).float()  # [vocab]
    rows = int(torch.tensor(shape).prod())
    off = torch.randint(0, vocab, (rows, 1), generator=gen)
    idx = (torch.arange(vocab)[None, :] - off) % vocab  # token j gets rank (j - off) mod vocab
    return lp[idx].view(*shape, vocab)


def time_step(name: str, bs: int, vocab: int, alpha: float, warmup: int, reps: int, gen):
    params = [parse_spec(POLICY_SPECS[name])] * bs
    pol = POLICIES[name](params, "cpu")
    root = zipf_logprobs((bs,), vocab, alpha, gen)
    frontier = pol.start(torch.arange(bs), root)
    child = zipf_logprobs((bs, frontier.shape[1]), vocab, alpha, gen)
    snap = copy.deepcopy(pol)
    times = []
    for i in range(warmup + reps):
        p = copy.deepcopy(snap)
        t0 = time.perf_counter()
        p.step(child)
        t1 = time.perf_counter()
        if i >= warmup:
            times.append(t1 - t0)
    p = copy.deepcopy(snap)
    with count_host_syncs() as c:
        p.step(child)
    return sum(times) / len(times), c.count, frontier.shape[1]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="vocab 32K, bs 1/16, alpha 1.35, few reps")
    ap.add_argument("--vocab", type=int, nargs="*", default=None)
    ap.add_argument("--bs", type=int, nargs="*", default=None)
    ap.add_argument("--alpha", type=float, nargs="*", default=None)
    ap.add_argument("--warmup", type=int, default=None)
    ap.add_argument("--reps", type=int, default=None)
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    ap.add_argument("--json", default=None, help="append one JSON line per cell to this file")
    a = ap.parse_args(argv)
    vocabs = a.vocab or ([32000] if a.quick else [32000, 128000, 152000])
    bss = a.bs or ([1, 16] if a.quick else [1, 16, 64])
    alphas = a.alpha or ([1.35] if a.quick else [0.7, 1.35, 5.0])
    warmup = a.warmup if a.warmup is not None else (2 if a.quick else 3)
    reps = a.reps if a.reps is not None else (5 if a.quick else 10)
    if a.threads:
        torch.set_num_threads(a.threads)
    gen = torch.Generator().manual_seed(0)
    print(f"# one tree-construction step (first expansion), torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads, mean of {reps} after {warmup} warm-up")
    head = f"{'vocab':>7} {'bs':>3} {'alpha':>5} | " + " | ".join(f"{n:>16}" for n in POLICY_SPECS)
    print(head)
    print("-" * len(head))
    out = open(a.json, "a") if a.json else None
    for vocab in vocabs:
        for bs in bss:
            for alpha in alphas:
                cells, base = [], None
                for name in POLICY_SPECS:
                    sec, syncs, width = time_step(name, bs, vocab, alpha, warmup, reps, gen)
                    base = sec if name == "eagle2" else base
                    cells.append((name, sec, syncs, width))
                    if out:
                        out.write(json.dumps(dict(policy=name, vocab=vocab, bs=bs, alpha=alpha, ms=sec * 1e3,
                                                  vs_eagle2=sec / base, host_syncs=syncs, width=width)) + "\n")
                row = " | ".join(f"{s * 1e3:8.2f}ms x{s / base:4.2f}" for _, s, _, _ in cells)
                print(f"{vocab:>7} {bs:>3} {alpha:>5} | {row}", flush=True)
                bad = [n for n, _, syncs, _ in cells if syncs]
                if bad:
                    print(f"  host syncs inside a step: {bad}", file=sys.stderr)
    if out:
        out.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
