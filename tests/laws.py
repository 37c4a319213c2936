"""Exact laws and the distance bound the sampling tests share.

The empirical law of n draws over K outcomes is within the total-variation bound of
Bretagnolle-Huber-Carol with probability 1 - delta:
P(||p_hat - p||_1 >= eps) <= 2^K exp(-n eps^2 / 2), i.e. TV <= sqrt(2 (K ln 2 + ln(1/delta)) / n) / 2.
"""

import math
from collections import Counter

import torch

from treespec_sglang.tree import DraftTree

N_DRAWS = 200_000
DELTA = 1e-6


def tv_bound(k: int, n: int = N_DRAWS) -> float:
    return 0.5 * math.sqrt(2 * (k * math.log(2) + math.log(1 / DELTA)) / n)


def exact_law(tree: DraftTree, probs: torch.Tensor) -> dict:
    tok, par, size = tree.tokens[0].tolist(), tree.parents[0].tolist(), int(tree.size[0])
    V = probs.shape[-1]
    law = Counter()

    def rec(u, prefix, mass):
        kids = {}
        for j in range(1, size):
            if par[j] == u and tok[j] not in kids:
                kids[tok[j]] = j
        for t in range(V):
            m = mass * float(probs[u, t])
            if m <= 0:
                continue
            if t in kids:
                rec(kids[t], prefix + (t,), m)
            else:
                law[prefix + (t,)] += m

    rec(0, (), 1.0)
    return law


def tv(p: dict, q: dict) -> float:
    return 0.5 * sum(abs(p.get(k, 0.0) - q.get(k, 0.0)) for k in set(p) | set(q))
