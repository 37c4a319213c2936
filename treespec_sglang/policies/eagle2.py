"""EAGLE-2 dynamic draft tree (EAGLE-2 §4.1 expansion, §4.2 reranking), as SGLang 0.5.23 runs it.

Step 0 takes the root's top-k children. Each later step expands the k frontier nodes, adds all
k*k children (path value V = product of confidences) to the candidate pool and keeps the top-k
of those k*k as the next frontier (``spec_utils.select_top_k_tokens``). After ``depth`` steps
the pool (k + (depth-1)k^2 nodes) is reranked to the global top ``budget - 1`` by value, ties
toward the earlier (shallower) pool entry, and kept in pool order
(``organize_draft_results``: topk, then sort of the flat indices).
"""

from __future__ import annotations

import torch

from ..tree import DraftTree, TreeBuffer
from .base import TreePolicy, keep_top_budget, register_policy, row_param, sanitize_logprobs
from .registry import PoolRule
from .params import Eagle2Params

__all__ = ["Eagle2Policy"]


@register_policy
class Eagle2Policy(TreePolicy):
    name = "eagle2"
    Params = Eagle2Params
    # in SGLang's pool: the top budget - 1 nodes of SGLang's own ranking (what organize_draft_results keeps) no
    # deeper than the request's depth: SGLang's beam at the server's topk is EAGLE-2's at that topk step by step,
    # so its first `depth` levels are this request's pool exactly (a topk below the server's is refused there)
    pool_rule = PoolRule(row=lambda p: {"top": p.max_nodes - 1, "rank_depth": p.depth}, stage="rank")

    def __init__(self, params, device):
        super().__init__(params, device)
        self.K = max(p.topk for p in self.params)
        self.S = max(p.depth for p in self.params)
        self.k = row_param(self.params, "topk", self.device)  # [bs]
        self.depth = row_param(self.params, "depth", self.device)  # [bs]
        self.budget = row_param(self.params, "budget", self.device)  # [bs]
        self.steps_done = 0

    @property
    def max_steps(self) -> int:
        return self.S - 1

    @property
    def depth_bound(self) -> int:
        return self.S

    def _capacity(self) -> int:
        return 1 + self.K + (self.S - 1) * self.K ** 2

    def start(self, root_tokens, root_logprobs):
        # root_tokens [bs], root_logprobs [bs, vocab]
        self.buf = TreeBuffer(root_tokens, self._capacity())
        K = min(self.K, root_logprobs.shape[-1])
        lp, tok = sanitize_logprobs(root_logprobs).topk(K, dim=-1)  # [bs, width]
        rank = torch.arange(K, device=self.device)
        valid = (rank[None, :] < self.k[:, None]) & torch.isfinite(lp)
        idx = self.buf.append(tok, torch.zeros_like(tok), lp, valid)  # [bs, width]
        self.steps_done = 1
        return self._remember(self._frontier(idx))

    def _frontier(self, idx: torch.Tensor) -> torch.Tensor:
        # rows that reached their own depth stop expanding
        alive = (self.depth > self.steps_done)[:, None]
        return torch.where(alive, idx, -1)

    def step(self, child_logprobs):
        # child_logprobs [bs, width, vocab] for the current frontier (width = K)
        frontier = self._last_frontier
        bs, W, V = child_logprobs.shape
        K = min(self.K, V)
        parent_lp = self.buf.gather_logprob(frontier)  # [bs, width]
        lp, tok = sanitize_logprobs(child_logprobs).topk(K, dim=-1)  # [bs, width, K]
        cum = parent_lp[:, :, None] + lp  # path value, log space
        rank = torch.arange(K, device=self.device)
        valid = (frontier >= 0)[:, :, None] & (rank[None, None, :] < self.k[:, None, None]) & torch.isfinite(cum)
        cum = torch.where(valid, cum, float("-inf"))
        # flat order (frontier j, child c) = SGLang's expand_scores.flatten(1)
        par = frontier[:, :, None].expand(bs, W, K)
        idx = self.buf.append(tok.reshape(bs, -1), par.reshape(bs, -1), cum.reshape(bs, -1), valid.reshape(bs, -1))
        # next frontier: top-k of the k*k candidates by path value
        flat = cum.reshape(bs, -1)
        order = torch.sort(flat, dim=-1, descending=True, stable=True).indices[:, :self.K]  # [bs, <= K]
        # sorted position j < k_row <=> rank < k_row (W * min(K, V) candidates: fewer than K in a tiny vocabulary)
        sel = (torch.arange(order.shape[1], device=self.device)[None, :] < self.k[:, None]) \
            & torch.gather(valid.reshape(bs, -1), 1, order)
        nxt = torch.where(sel, torch.gather(idx, 1, order), -1)
        self.steps_done += 1
        return self._remember(self._frontier(nxt))

    def _remember(self, frontier):
        self._last_frontier = frontier
        return frontier

    def finish(self) -> DraftTree:
        pool = self.buf.view(self.depth_bound)
        return keep_top_budget(pool, self.budget, self.max_nodes)
