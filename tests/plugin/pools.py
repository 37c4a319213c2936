"""Shared by the pool's tests: SGLang-shaped draft pools over a seeded path draft, what a selection keeps,
a mixed batch of policy specs, each request's tree from the plain-Python oracles, and SGLang's verify chains
with a kept set (random sibling orders) beside the plain-loop unlink."""

import math
import random

import torch

from tests.helpers import PathDraft, plain_confidence, plain_entropy
from tests.policies import oracles
from treespec_sglang.policies.classifier import C2TClassifier, load_classifier


def pool(topk=4, steps=4, seed=0, roots=(3, 5, 7)):
    draft = PathDraft(30, seed=seed, sharpness=2.0)
    sl, tl, pl, paths = oracles.sglang_pool_lists(draft, list(roots), topk, steps)
    return draft, sl, tl, pl, paths


def reachable(nt, ns, b):
    seen, stack = [], [0]
    while stack:
        u = stack.pop()
        seen.append(u)
        kid = int(nt[b, u])
        while kid >= 0:
            stack.append(kid)
            kid = int(ns[b, kid])
    return sorted(seen)


def kept_paths(top_idx, keep, paths, roots, b):
    out = {(int(roots[b]),)}
    for i, f in enumerate(top_idx[b].tolist()):
        if keep[b, i + 1]:
            out.add(paths[b][f])
    return out


def _other_classifier():
    torch.manual_seed(7)
    return C2TClassifier(hidden=8).eval()


OTHER_CLF = _other_classifier()  # a second classifier, so a batch mixes two
MIXED_SPECS = [
    None, {"policy": "none"}, {"policy": "eagle2", "budget": 5}, {"policy": "eagle2", "budget": 9, "depth": 1},
    {"policy": "eagle2", "budget": 16, "depth": 2},
    {"policy": "talon", "budget": 9, "topk": 3, "mu": 0.05}, {"policy": "talon", "budget": 30, "topk": 10, "mu": 0.02},
    {"policy": "salf", "budget": 8, "batch": 2, "th": 0.3}, {"policy": "salf", "budget": 30, "batch": 4, "th": 0.6},
    {"policy": "salf", "budget": 7, "th": 0.0, "max_depth": 2}, {"policy": "salf", "budget": 12, "batch": 1, "th": 0.1},
    {"policy": "salf", "budget": 12, "batch": 3, "th": 0.2, "max_depth": 2},
    {"policy": "salf", "budget": 5, "batch": 3, "th": 0.05},  # G fills early: eps decides D
    {"policy": "salf", "budget": 9, "batch": 2, "th": 0.1, "max_depth": 1}, {"policy": "salf", "budget": 2, "th": 0.1},
    {"policy": "talon", "budget": 8, "topk": 3, "mu": 1.0},  # only each level's anchor passes its gate
    {"policy": "talon", "budget": 7, "topk": 2, "mu": 0.0},  # no gate: the budget alone
    {"policy": "c2t", "budget": 10, "topk": 3, "beta": 0.3}, {"policy": "c2t", "budget": 40, "topk": 12, "beta": 0.5,
                                                              "max_depth": 2},
    {"policy": "c2t", "budget": 9, "topk": 4, "beta": 0.45, "classifier": OTHER_CLF},
    {"policy": "c2t", "budget": 12, "topk": 4, "beta": 0.02, "max_depth": 1},
    {"policy": "chain", "length": 3}, {"policy": "chain", "length": 20}, {"policy": "chain", "length": 4, "beta": 0.4},
]


def chain_oracle(beam, root, length, beta, clf):
    """The top-1 chain of ``length`` tokens over the beam, stopping at a C2T score below ``beta``."""
    path, cum, out = (root,), 0.0, {(root,)}
    for d in range(1, length + 1):
        lp = beam.logprobs(path)
        if not torch.isfinite(lp).any():
            break
        w = int(lp.argmax())
        cum += float(lp[w])
        if beta is not None:
            if plain_confidence(clf, math.exp(cum), plain_entropy(lp), d) < beta:
                break
        path = path + (w,)
        out.add(path)
    return out


def expected_paths(p, beam, root, N, scores, flat_paths):
    """One request's policy tree over the beam, from the plain-Python oracles, its budget capped at N."""
    if p is None or p.__class__.__name__ in ("Eagle2Params", "NoneParams"):
        n = N if p is None else min(p.max_nodes, N)
        depth = getattr(p, "depth", None)  # EAGLE-2's: its best nodes no deeper (a path holds the root too)
        ranked = sorted((f for f in range(len(flat_paths)) if depth is None or len(flat_paths[f]) - 1 <= depth),
                        key=lambda f: (-float(scores[f]), f))
        return {(root,)} | {flat_paths[f] for f in ranked[:n - 1]}
    n = min(p.max_nodes, N)
    name = p.__class__.__name__
    if name == "TalonParams":
        t = oracles.talon(beam, root, n, p.topk, p.mu)
    elif name == "SalfParams":
        return oracles.salf(beam, root, n, p.batch, p.th, p.max_depth)
    elif name == "C2TParams":
        t = oracles.c2t(beam, root, n, p.topk, p.beta, p.max_depth, load_classifier(p.classifier))
    else:
        return chain_oracle(beam, root, min(p.length, N - 1), p.beta, load_classifier(p.classifier))
    return {t.path(i) for i in range(len(t.tok))}


def unlink_oracle(next_token, next_sibling, keep):
    """Plain loops: a kept node's first kept child / next kept sibling along the original chains, -1 for
    fillers and where no kept node follows."""
    nt, ns, kp = next_token.tolist(), next_sibling.tolist(), keep.tolist()
    out_t, out_s = [], []
    for b in range(len(kp)):
        def first_kept(x):
            while x >= 0 and not kp[b][x]:
                x = ns[b][x]
            return x if x >= 0 else -1
        out_t.append([first_kept(nt[b][u]) if kp[b][u] else -1 for u in range(len(kp[b]))])
        out_s.append([first_kept(ns[b][u]) if kp[b][u] else -1 for u in range(len(kp[b]))])
    return out_t, out_s


def random_chains(rng: random.Random, bs: int, N: int):
    """``(next_token, next_sibling, keep)``, each ``[bs, N]`` (int64, int64, bool): per row a random tree on N nodes
    (node 0 the root, every other node's parent a lower node), each node's children linked in a random order
    (not by index, so the first kept sibling can sit anywhere on a chain), and a kept set closed under ancestors
    that holds the root, drops about half the other nodes and keeps at least one node more where N > 2."""
    nt = torch.full((bs, N), -1, dtype=torch.long)
    ns = torch.full((bs, N), -1, dtype=torch.long)
    keep = torch.zeros(bs, N, dtype=torch.bool)
    for b in range(bs):
        parent = [-1] + [rng.randrange(i) for i in range(1, N)]
        kids = [[] for _ in range(N)]
        for i in range(1, N):
            kids[parent[i]].append(i)
        for u in range(N):
            rng.shuffle(kids[u])
            if kids[u]:
                nt[b, u] = kids[u][0]
            for a, c in zip(kids[u], kids[u][1:]):
                ns[b, a] = c
        keep[b, 0] = True
        for i in range(1, N):
            keep[b, i] = bool(keep[b, parent[i]]) and rng.random() < 0.5
        if N > 2 and not keep[b, 1:].any():
            keep[b, kids[0][-1]] = True  # a kept child at the end of the root's chain: the jump crosses fillers
    return nt, ns, keep
