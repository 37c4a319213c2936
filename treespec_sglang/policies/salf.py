"""SALF: priority-queue tree search with stopping at low further gains (SALF&TALF paper, Alg. 2).

State per request: Q, a capacity-N queue of unexpanded nodes, and the popped nodes (the
working tree; the output G is their top-N). Each iteration (lines 4-20):

1. pop the B best nodes of Q into G (lines 5-9);
2. eps = min pr over G if |G| >= N else 0 (lines 10-11); D = popped nodes with pr > eps
   (line 12: nodes that cannot enter G are not expanded);
3. stop if sum_{D} pr < th (line 13; the red SALF block) or D is empty;
4. expand D's nodes above ``max_depth`` in one batched draft forward and push the children into Q,
   which keeps its N best (lines 14-20). A node at ``max_depth`` is in D (it enters G: its mass is
   a gain) but has no children: an iteration that pops only such nodes goes on with Q.

With th = 0 the result is exactly the global top-N nodes by path probability (Thm. 2-3), among
those no deeper than ``max_depth`` (App. B's depth-bounded optimal tree, Def. B.1).
Only a node's top-(N-1) children can ever be among the top N, so those are all we push
(App. C notes this does not change Q).
"""

from __future__ import annotations

import torch

from ..tree import DraftTree, TreeBuffer, pack_left
from .base import TreePolicy, keep_top_budget, register_policy, row_param, sanitize_logprobs
from .registry import PoolRule
from .params import SalfParams

__all__ = ["SalfPolicy"]

NEG_INF = float("-inf")


@register_policy
class SalfPolicy(TreePolicy):
    name = "salf"
    Params = SalfParams
    # th = 0 is the exact top-N (Thm. 2-3): SGLang's ranking, never below max_depth; th > 0 the best-first search
    # (its max_depth bounds the search; the ranking then only pads, unmasked whatever else the batch holds)
    pool_rule = PoolRule(row=lambda p: {"top": p.max_nodes - 1 if p.th <= 0 else 0, "th": p.th, "batch": p.batch,
                                        "max_depth": p.max_depth, "rank_depth": p.max_depth if p.th <= 0 else None},
                         stage="salf")

    def __init__(self, params, device):
        super().__init__(params, device)
        self.N = self.max_nodes
        self.B = max(p.batch for p in self.params)
        self.budget = row_param(self.params, "budget", self.device)
        self.b = row_param(self.params, "batch", self.device)
        self.th = row_param(self.params, "th", self.device, torch.float32)
        # no bound: a tree of `budget` nodes is at most budget - 1 deep
        md = [p.max_depth if p.max_depth is not None else max(p.max_nodes - 1, 1) for p in self.params]
        self.max_depth = torch.tensor(md, dtype=torch.int64, device=self.device)
        self.Dmax = max(md)
        # Every iteration that does not stop expands >= 1 node that enters G; bounded generously.
        self.iters = 2 * self.N + 2

    @property
    def max_steps(self) -> int:
        return self.iters

    @property
    def depth_bound(self) -> int:
        return min(self.Dmax, max(self.N - 1, 0))

    def start(self, root_tokens, root_logprobs):
        # The first iteration pops the root (pr = 1 >= th, |G| = 1) and expands it: its children
        # are root_logprobs. Queue entries: path logprob, token, parent (working-tree index), depth.
        bs = self.bs
        self.buf = TreeBuffer(root_tokens, 1 + self.iters * self.B)
        dev = self.device
        self.q_lp = torch.full((bs, self.N), NEG_INF, device=dev)
        self.q_tok = torch.full((bs, self.N), -1, dtype=torch.int64, device=dev)
        self.q_par = torch.full((bs, self.N), -1, dtype=torch.int64, device=dev)
        self.done = torch.zeros(bs, dtype=torch.bool, device=dev)
        root_ok = (self.max_depth >= 1) & (self.budget > 1)
        fr = torch.where(root_ok[:, None], torch.zeros(bs, 1, dtype=torch.int64, device=dev), -1)
        self._push(fr, root_logprobs[:, None, :])
        return self._pop()

    def _push(self, frontier: torch.Tensor, child_logprobs: torch.Tensor) -> None:
        # frontier [bs, width], child_logprobs [bs, width, vocab]: merge children into Q (keep N best)
        bs, W, V = child_logprobs.shape
        R = min(max(self.N - 1, 1), V)
        lp, tok = sanitize_logprobs(child_logprobs).topk(R, dim=-1)  # [bs, width, R]
        cum = self.buf.gather_logprob(frontier)[:, :, None] + lp
        ok = (frontier >= 0)[:, :, None] & torch.isfinite(cum)
        cand_lp = torch.cat([self.q_lp, torch.where(ok, cum, NEG_INF).reshape(bs, -1)], dim=1)
        cand_tok = torch.cat([self.q_tok, tok.reshape(bs, -1)], dim=1)
        cand_par = torch.cat([self.q_par, frontier[:, :, None].expand(bs, W, R).reshape(bs, -1)], dim=1)
        # stable: older queue entries win ties, then (frontier j, child rank) order
        order = torch.sort(cand_lp, dim=-1, descending=True, stable=True).indices[:, :self.N]
        q_lp = torch.gather(cand_lp, 1, order)
        cap_ok = torch.arange(self.N, device=self.device)[None, :] < self.budget[:, None]  # per-row capacity N
        self.q_lp = torch.where(cap_ok, q_lp, NEG_INF)
        self.q_tok = torch.gather(cand_tok, 1, order)
        self.q_par = torch.gather(cand_par, 1, order)

    def _pop(self) -> torch.Tensor:
        # Q is sorted best-first: the B best are its first columns.
        B = self.B
        col = torch.arange(B, device=self.device)
        pop = (col[None, :] < self.b[:, None]) & torch.isfinite(self.q_lp[:, :B]) & ~self.done[:, None]
        lp = self.q_lp[:, :B]
        idx = self.buf.append(self.q_tok[:, :B], self.q_par[:, :B], lp, pop)  # G.push (lines 7-8)
        # remove the popped entries from Q
        self.q_lp = torch.cat([torch.where(pop, NEG_INF, lp), self.q_lp[:, B:]], dim=1)
        self.q_lp, perm = torch.sort(self.q_lp, dim=-1, descending=True, stable=True)
        self.q_tok = torch.gather(self.q_tok, 1, perm)
        self.q_par = torch.gather(self.q_par, 1, perm)
        # eps = N-th best pr among popped nodes (G is their top N), 0 while |G| < N (lines 10-11)
        glp = self.buf.logprob[:, :self.buf.capacity]
        top = torch.sort(glp, dim=-1, descending=True).values[:, :self.N]
        kth = torch.gather(top, 1, (self.budget - 1).clamp(max=self.N - 1)[:, None])[:, 0]
        eps = torch.where(self.buf.size >= self.budget, kth, NEG_INF)
        D = (idx >= 0) & (lp > eps[:, None])  # line 12
        gain = torch.where(D, lp.exp(), 0.0).sum(-1)
        self.done = self.done | (gain < self.th) | ~D.any(-1)  # line 13 (and nothing entered G)
        expand = D & (self.buf.gather_depth(idx) < self.max_depth[:, None])  # max_depth's nodes have no children
        fr = pack_left(expand, idx, B, -1)
        self.frontier = torch.where(self.done[:, None], -1, fr)
        return self.frontier

    def waiting(self) -> torch.Tensor:
        # a row whose pop held only nodes at its depth bound entered them into G and goes on with Q
        return (~self.done).any()

    @property
    def tree(self) -> DraftTree:
        # popped-but-displaced nodes may sit deeper than the final tree's bound
        return self.buf.view(min(self.Dmax, self.iters + 1))

    def step(self, child_logprobs):
        # child_logprobs [bs, width, vocab] for the nodes in D
        self._push(self.frontier, child_logprobs)
        return self._pop()

    def finish(self) -> DraftTree:
        pool = self.buf.view(self.depth_bound)
        return keep_top_budget(pool, self.budget, self.N)
