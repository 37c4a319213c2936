"""Chain drafting: a single top-1 path of ``length`` tokens, optionally with C2T early stop.

With ``beta`` set, each new chain token is scored by the C2T classifier (features as in
C2T §4.1) and the chain stops, per request, at the first token scoring below ``beta``
(C2T §5.4 / App. I chain mode; the paper uses beta = 0.85 there).
"""

from __future__ import annotations

import torch

from ..tree import DraftTree, TreeBuffer
from .base import TreePolicy, register_policy, row_param, sanitize_logprobs
from .registry import PoolRule
from .c2t import classifier_scores, group_classifiers
from .classifier import c2t_features, entropy_topm
from .params import ChainParams

__all__ = ["ChainPolicy"]


@register_policy
class ChainPolicy(TreePolicy):
    name = "chain"
    Params = ChainParams
    # the C2T early stop, when beta is set, scores with the row's classifier
    pool_rule = PoolRule(row=lambda p: {} if p.beta is None else {"beta": p.beta, "clf": p.classifier}, stage="chain")
    needs_tree = False

    def __init__(self, params, device):
        super().__init__(params, device)
        self.L = max(p.length for p in self.params)
        self.length = row_param(self.params, "length", self.device)
        self.early = any(p.beta is not None for p in self.params)
        betas = [p.beta if p.beta is not None else 0.0 for p in self.params]
        self.beta = torch.tensor(betas, dtype=torch.float32, device=self.device)  # 0 = never stops
        specs = [p.classifier for p in self.params]
        self.classifiers = group_classifiers(specs, self.device) if self.early else []

    @property
    def max_steps(self) -> int:
        return max(self.L - 1, 0)

    @property
    def depth_bound(self) -> int:
        return self.L

    def start(self, root_tokens, root_logprobs):
        self.buf = TreeBuffer(root_tokens, self.L + 1)
        self.d = 0
        self.alive = self.length > 0  # [bs]
        fr = torch.zeros(self.bs, 1, dtype=torch.int64, device=self.device)
        return self._extend(fr, root_logprobs[:, None, :])

    def step(self, child_logprobs):
        return self._extend(self.frontier, child_logprobs)

    def _extend(self, frontier: torch.Tensor, child_logprobs: torch.Tensor) -> torch.Tensor:
        # frontier [bs, 1], child_logprobs [bs, 1, vocab]
        self.d += 1
        lp_all = sanitize_logprobs(child_logprobs[:, 0])  # [bs, vocab]
        lp, tok = lp_all.max(dim=-1, keepdim=True)  # [bs, 1]
        cum = self.buf.gather_logprob(frontier) + lp
        ok = (frontier >= 0) & torch.isfinite(cum) & self.alive[:, None]
        if self.early:
            feats = c2t_features(cum, entropy_topm(lp_all)[:, None], torch.full_like(tok, self.d))
            ok = ok & (classifier_scores(feats, self.classifiers) >= self.beta[:, None])
        idx = self.buf.append(tok, frontier, cum, ok)
        self.alive = self.alive & (idx[:, 0] >= 0) & (self.length > self.d)
        self.frontier = torch.where(self.alive[:, None], idx, -1)
        return self.frontier

    def finish(self) -> DraftTree:
        return self.tree
