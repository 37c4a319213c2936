"""C2T early stop for chain drafting (topk = 1) at large batch (C2T §5.4, App. I; no sglang import).

SGLang's chain draft loop runs S steps for every row. For rows whose policy is
``{"policy": "chain", "beta": ...}`` we capture the draft distribution of each step, score the
chain token it produced with the C2T classifier (joint probability so far, entropy of the
distribution over its top-1000, depth) and cut the row's chain at the first token scoring below
beta. The cut is a *mask-only* change (the tail is unlinked from the verify traversal), so every
TP rank runs the same kernels and collectives; the per-row lengths are broadcast from rank 0
(:mod:`.ranks`, as SGLang's ``spec_tp_sync`` does) so all ranks verify the same chains even if their draft
logits differ in the last bit.

The depth-1 token comes from the draft-extend step whose distribution the loop does not see,
so it is always kept; depths 2..S are scored.
"""

from __future__ import annotations

from typing import List

import torch

from ..policies.c2t import classifier_scores, group_classifiers
from ..policies.classifier import c2t_features, entropy_topm
from ..policies.params import ChainParams, NoneParams
from .ranks import agree

__all__ = ["ChainStopper"]


class ChainStopper:
    """Per-row chain lengths from the draft's step-by-step distributions.

    Parameters
    ----------
    params : one policy per row (rows that are not ``chain`` with ``beta`` never stop early)
    num_steps : S, the captured chain length
    """

    def __init__(self, params: List, num_steps: int, device):
        stops = [isinstance(p, ChainParams) and p.beta is not None for p in params]
        bs = len(params)
        self.device = torch.device(device)
        beta = [p.beta if isinstance(p, ChainParams) and p.beta is not None else 0.0 for p in params]
        self.beta = torch.tensor(beta, dtype=torch.float32, device=self.device)  # 0 = never stops
        # a chain's own length, 0 for speculation off ({"policy": "none"}), else the captured S
        length = [min(p.length, num_steps) if isinstance(p, ChainParams) else 0 if isinstance(p, NoneParams)
                  else num_steps for p in params]
        self.active = any(stops) or any(n < num_steps for n in length)
        self.max_len = torch.tensor(length, dtype=torch.int64, device=self.device)
        # rows without an early stop are scored by the default classifier against beta 0: never stop
        self.classifiers = group_classifiers([p.classifier if s else None for p, s in zip(params, stops)],
                                             self.device) if self.active else []
        self.logp = torch.zeros(bs, device=self.device)  # running joint log-prob of the chain
        self.alive = torch.ones(bs, dtype=torch.bool, device=self.device)
        self.length = torch.ones(bs, dtype=torch.int64, device=self.device)  # depth 1 is always kept
        self.depth = 1

    def observe(self, logits: torch.Tensor) -> None:
        """Draft logits ``[bs, vocab]`` of one loop step: they produce the chain token at depth+1."""
        self.depth += 1
        lp = torch.log_softmax(logits.float(), dim=-1)
        top = lp.max(dim=-1).values
        self.logp = self.logp + top
        feats = c2t_features(self.logp, entropy_topm(lp), torch.full_like(self.length, self.depth))  # [bs, 3]
        score = classifier_scores(feats[:, None], self.classifiers)[:, 0]
        self.alive = self.alive & (score >= self.beta) & (self.depth <= self.max_len)
        self.length = self.length + self.alive.long()

    def keep_mask(self, n_nodes: int, group=None) -> torch.Tensor:
        """``[bs, n_nodes]`` bool: chain node i (0 = root) is kept iff i <= length (rank 0's lengths on every
        rank of ``group``, a ``GroupCoordinator``: :func:`~treespec_sglang.plugin.ranks.agree`)."""
        (length,) = agree([torch.minimum(self.length, self.max_len)], group)
        return torch.arange(n_nodes, device=length.device)[None, :] <= length[:, None]

