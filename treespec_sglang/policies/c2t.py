"""C2T classifier-pruned tree (C2T §4.2, App. A Alg. 1).

Layer by layer: the candidates are the top-K children (by joint probability) of the current
layer (second pruning, stage 1); each gets C_i = F(P_i, H_i, d_i) (Eq. 8); nodes with
C_i < beta are removed (first pruning); the survivors, at most top-K by confidence (stage 2)
and at most the remaining budget, form the next layer. Stop at ``max_depth`` or when no node
passes.
"""

from __future__ import annotations

import torch

from ..tree import DraftTree, TreeBuffer, pack_left
from .base import TreePolicy, rank_desc, register_policy, row_param, sanitize_logprobs
from .registry import PoolRule
from .classifier import c2t_features, entropy_topm, load_classifier
from .params import C2TParams

__all__ = ["C2TPolicy"]

NEG_INF = float("-inf")


def classifier_scores(features: torch.Tensor, classifiers) -> torch.Tensor:
    """Score ``[bs, m, 3]`` features with each row's classifier -> ``[bs, m]``.

    Rows sharing a classifier are scored together (one forward per distinct classifier).
    """
    with torch.no_grad():
        if len(classifiers) == 1:
            return classifiers[0][1](features)
        out = torch.empty(features.shape[:2], device=features.device)
        for rows, clf in classifiers:
            out[rows] = clf(features[rows])
        return out


def group_classifiers(specs, device):
    """[(rows [g] int64, module)] grouping the rows by classifier spec (None / path / module), host-side."""
    groups = {}
    for i, spec in enumerate(specs):
        key = spec if isinstance(spec, (str, type(None))) else id(spec)
        groups.setdefault(key, (spec, []))[1].append(i)
    return [(torch.tensor(rows, device=device), load_classifier(spec).to(device))
            for spec, rows in groups.values()]


@register_policy
class C2TPolicy(TreePolicy):
    name = "c2t"
    Params = C2TParams
    pool_rule = PoolRule(row=lambda p: {"topk": p.topk, "beta": p.beta, "max_depth": p.max_depth, "clf": p.classifier},
                         stage="c2t")

    def __init__(self, params, device):
        super().__init__(params, device)
        self.K = max(p.topk for p in self.params)
        self.Dmax = max(p.max_depth for p in self.params)
        self.k = row_param(self.params, "topk", self.device)
        self.budget = row_param(self.params, "budget", self.device)
        self.beta = row_param(self.params, "beta", self.device, torch.float32)
        self.max_depth = row_param(self.params, "max_depth", self.device)
        self.classifiers = group_classifiers([p.classifier for p in self.params], self.device)

    @property
    def max_steps(self) -> int:
        return min(self.Dmax, max(self.max_nodes - 1, 0)) - 1 if self.max_nodes > 1 else 0

    @property
    def depth_bound(self) -> int:
        return max(min(self.Dmax, self.max_nodes - 1), 0)

    def start(self, root_tokens, root_logprobs):
        self.buf = TreeBuffer(root_tokens, self.max_nodes)
        self.layer = 1
        fr = torch.zeros(self.bs, 1, dtype=torch.int64, device=self.device)
        return self._layer(fr, root_logprobs[:, None, :])

    def step(self, child_logprobs):
        self.layer += 1
        return self._layer(self.frontier, child_logprobs)

    def _layer(self, frontier: torch.Tensor, child_logprobs: torch.Tensor) -> torch.Tensor:
        # frontier [bs, width] (layer d-1), child_logprobs [bs, width, vocab] -> layer d frontier
        bs, W, V = child_logprobs.shape
        K = min(self.K, V)
        lp_all = sanitize_logprobs(child_logprobs)
        H = entropy_topm(lp_all)  # [bs, width] entropy of each parent's distribution
        lp, tok = lp_all.topk(K, dim=-1)  # [bs, width, K]
        cum = (self.buf.gather_logprob(frontier)[:, :, None] + lp).reshape(bs, -1)
        ok = (frontier >= 0)[:, :, None].expand(bs, W, K).reshape(bs, -1) & torch.isfinite(cum)
        cum = torch.where(ok, cum, NEG_INF)
        # stage 1: the layer's top-K candidates by joint probability
        order = torch.sort(cum, dim=-1, descending=True, stable=True).indices[:, :self.K]  # [bs, K]
        c_lp = torch.gather(cum, 1, order)
        # sorted position j < k_row <=> rank < k_row
        top = torch.arange(order.shape[1], device=self.device)[None, :] < self.k[:, None]
        c_ok = torch.gather(ok, 1, order) & top
        c_tok = torch.gather(tok.reshape(bs, -1), 1, order)
        c_par = torch.gather(frontier[:, :, None].expand(bs, W, K).reshape(bs, -1), 1, order)
        c_H = torch.gather(H[:, :, None].expand(bs, W, K).reshape(bs, -1), 1, order)
        depth = torch.full_like(c_tok, self.layer)
        conf = classifier_scores(c2t_features(c_lp, c_H, depth), self.classifiers)  # [bs, K]
        # first pruning: C_i >= beta; stage 2: top-K by confidence within the remaining budget
        passed = c_ok & (conf >= self.beta[:, None]) & (self.layer <= self.max_depth)[:, None]
        remaining = (self.budget - self.buf.size)[:, None]
        keep = passed & (rank_desc(torch.where(passed, conf, NEG_INF)) < torch.minimum(remaining, self.k[:, None]))
        idx = self.buf.append(c_tok, c_par, c_lp, keep)
        more = (self.layer < self.max_depth) & (self.buf.size < self.budget)
        self.frontier = torch.where(more[:, None], pack_left(idx >= 0, idx, self.K, -1), -1)
        return self.frontier

    def finish(self) -> DraftTree:
        return self.tree
