"""Shared test helpers: a deterministic path-keyed draft model and tree builders."""

from __future__ import annotations

import hashlib
import random

import torch

from treespec_sglang.tree import DraftTree


class PathDraft:
    """A fake draft whose next-token log-probs depend only on the token path (root included).

    ``logprobs(path)`` is deterministic, continuous (no ties) and sharpened by ``sharpness``.
    ``expand(tree, frontier)`` implements grow_tree's callback by reading paths out of ``tree``.
    """

    def __init__(self, vocab: int, seed: int = 0, sharpness: float = 2.0, dtype=torch.float32):
        self.vocab, self.seed, self.sharpness = vocab, seed, sharpness
        self.calls = 0
        self.widths = []

    def logprobs(self, path) -> torch.Tensor:
        h = hashlib.sha256(repr((self.seed, tuple(path))).encode()).digest()
        g = torch.Generator().manual_seed(int.from_bytes(h[:8], "little"))
        return torch.log_softmax(torch.randn(self.vocab, generator=g, dtype=torch.float64) * self.sharpness, -1).float()

    def root(self, root_tokens):
        return torch.stack([self.logprobs((int(t),)) for t in root_tokens])

    def expand(self, tree: DraftTree, frontier: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        self.widths.append(frontier.shape[1])
        bs, w = frontier.shape
        out = torch.full((bs, w, self.vocab), float("nan"))  # junk for -1 entries: must be ignored
        tok, par = tree.tokens.tolist(), tree.parents.tolist()
        for b in range(bs):
            for j, node in enumerate(frontier[b].tolist()):
                if node < 0:
                    continue
                path, i = [], node
                while i >= 0:
                    path.append(tok[b][i])
                    i = par[b][i]
                out[b, j] = self.logprobs(tuple(reversed(path)))
        return out


def random_tree_lists(rng: random.Random, n: int, vocab: int, max_children: int = 3):
    """Random tree (tokens, parents) with n nodes; siblings get distinct tokens."""
    tokens, parents, used = [rng.randrange(vocab)], [-1], {0: set()}
    for i in range(1, n):
        cands = [p for p in range(i) if len(used[p]) < min(max_children, vocab)]
        p = rng.choice(cands)
        t = rng.choice([v for v in range(vocab) if v not in used[p]])
        used[p].add(t)
        used[i] = set()
        tokens.append(t)
        parents.append(p)
    return tokens, parents


def random_batch(rng: random.Random, sizes, vocab: int = 20, max_children: int = 3) -> DraftTree:
    lists = [random_tree_lists(rng, n, vocab, max_children) for n in sizes]
    return DraftTree.from_lists([t for t, _ in lists], [p for _, p in lists])
