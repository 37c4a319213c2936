"""TALON budget-driven adaptive tree (TALON App. A, Alg. 2).

Layer 0 (Robust Init, lines 13-15): the root's top-K children. Every later layer (Confidence
Gating, lines 17-19): among all children of the previous layer, keep u with
p(u) >= mu * m_d where m_d is the layer's best path probability; Budget Check (lines 22-24):
truncate to the remaining budget N - |T| by path probability. Stop when |T| = N or a layer
is empty.

Only a node's top-(N-1) children can survive the budget truncation, so each frontier row takes
its top-(N-1) children first (exact, and what keeps the step O(width * N) after the top-k).
"""

from __future__ import annotations

import math

import torch

from ..tree import DraftTree, TreeBuffer, pack_left
from .base import TreePolicy, rank_desc, register_policy, row_param, sanitize_logprobs
from .registry import PoolRule
from .params import TalonParams

__all__ = ["TalonPolicy"]


@register_policy
class TalonPolicy(TreePolicy):
    name = "talon"
    Params = TalonParams
    pool_rule = PoolRule(row=lambda p: {"topk": p.topk, "log_mu": float("-inf") if p.mu <= 0 else math.log(p.mu)},
                         stage="talon")

    def __init__(self, params, device):
        super().__init__(params, device)
        self.K = max(p.topk for p in self.params)
        self.k = row_param(self.params, "topk", self.device)
        self.budget = row_param(self.params, "budget", self.device)
        self.log_mu = torch.log(row_param(self.params, "mu", self.device, torch.float32))  # -inf when mu = 0
        self.W = max(self.max_nodes - 1, 1)  # frontier width bound after layer 0

    @property
    def max_steps(self) -> int:
        # every non-empty layer adds >= 1 node (the anchor m_d passes its own gate)
        return max(self.max_nodes - 2, 0)

    @property
    def depth_bound(self) -> int:
        return max(self.max_nodes - 1, 0)

    def start(self, root_tokens, root_logprobs):
        # root_tokens [bs], root_logprobs [bs, vocab]
        self.buf = TreeBuffer(root_tokens, self.max_nodes)
        K = min(self.K, root_logprobs.shape[-1])
        lp, tok = sanitize_logprobs(root_logprobs).topk(K, dim=-1)  # [bs, width]
        rank = torch.arange(K, device=self.device)
        remaining = self.budget - 1
        valid = (rank[None, :] < torch.minimum(self.k, remaining)[:, None]) & torch.isfinite(lp)
        idx = self.buf.append(tok, torch.zeros_like(tok), lp, valid)
        return self._set_frontier(idx, width=K)  # layer 1 holds at most K nodes

    def _set_frontier(self, idx: torch.Tensor, width: int) -> torch.Tensor:
        full = (self.buf.size >= self.budget)[:, None]
        fr = pack_left(idx >= 0, idx, width, -1)
        self.frontier = torch.where(full, -1, fr)  # [bs, width]
        return self.frontier

    def step(self, child_logprobs):
        # child_logprobs [bs, width, vocab]
        frontier = self.frontier
        bs, W, V = child_logprobs.shape
        R = min(self.W, V)
        parent_lp = self.buf.gather_logprob(frontier)  # [bs, width]
        lp, tok = sanitize_logprobs(child_logprobs).topk(R, dim=-1)  # [bs, width, R]
        cum = (parent_lp[:, :, None] + lp).reshape(bs, -1)  # p(u) = p(v) * P(w | v), log space
        ok = (frontier >= 0)[:, :, None].expand(bs, W, R).reshape(bs, -1) & torch.isfinite(cum)
        cum = torch.where(ok, cum, float("-inf"))
        m = cum.max(dim=-1, keepdim=True).values  # anchor confidence m_d, [bs, 1]
        gate = ok & (cum >= m + self.log_mu[:, None])
        remaining = (self.budget - self.buf.size)[:, None]
        keep = gate & (rank_desc(torch.where(gate, cum, float("-inf"))) < remaining)
        par = frontier[:, :, None].expand(bs, W, R).reshape(bs, -1)
        idx = self.buf.append(tok.reshape(bs, -1), par, cum, keep)
        return self._set_frontier(idx, width=self.W)

    def finish(self) -> DraftTree:
        return self.tree  # TALON never builds nodes it does not keep
