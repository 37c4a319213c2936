"""Online calibration of the draft's path probability as an acceptance estimate.

The draft's path probability ``P(v)`` is a biased estimate of the probability that the target accepts
node ``v`` (a briefly trained draft is over-confident deep in the tree). :class:`DepthCalibration` learns
one multiplicative correction per depth from the verify outcomes it is shown: ``ratio_d = (accepted_d +
prior) / (predicted_d + prior)``, where ``predicted_d`` sums ``P(v)`` over verified nodes at depth d and
``accepted_d`` counts those of them on the accepted path. The ratios are the ``weight`` that
:func:`~treespec_sglang.policies.token_cap.allocate_batch` multiplies the path probabilities by.
Updates are tensor ops on the tree's device (no host sync). :meth:`curve` gives the calibration curve
(mean predicted vs empirical acceptance per probability bin), before and after the correction.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..tree import DraftTree

__all__ = ["DepthCalibration", "accepted_nodes"]


def accepted_nodes(tree: DraftTree, path: torch.Tensor) -> torch.Tensor:
    """``[bs, n_nodes]`` bool: nodes on the accepted path (root included); ``path`` ``[bs, depth + 1]``, -1 padded.

    Example: path [[0, 2, -1]] in a 4-node tree -> [[True, False, True, False]].
    """
    bs, n = tree.tokens.shape
    hit = torch.zeros(bs, n + 1, dtype=torch.bool, device=path.device)
    hit.scatter_(1, torch.where(path >= 0, path, n), True)  # -1 goes to the spare column n
    return hit[:, :n]


@dataclass
class DepthCalibration:
    """Per-depth acceptance correction, learned online. ``max_depth`` bounds the table (deeper shares it).

    >>> cal = DepthCalibration(max_depth=8)
    >>> w = cal.weight(tree)              # [bs, n_nodes] multipliers, 1 before any update  # doctest: +SKIP
    >>> cal.update(tree, result.path)     # after each verify                              # doctest: +SKIP
    """

    max_depth: int = 16
    prior: float = 2.0  # pseudo-counts pulling every ratio towards 1 until data arrives
    bins: int = 10
    predicted: torch.Tensor = field(default=None)  # [max_depth + 1] float64
    accepted: torch.Tensor = field(default=None)  # [max_depth + 1] float64
    curve_pred: torch.Tensor = field(default=None)  # [bins] sum of P(v) per probability bin
    curve_corr: torch.Tensor = field(default=None)  # [bins] sum of weight * P(v)
    curve_hit: torch.Tensor = field(default=None)  # [bins] accepted count
    curve_n: torch.Tensor = field(default=None)  # [bins] node count

    def __post_init__(self):
        if not isinstance(self.max_depth, int) or self.max_depth < 1:
            raise ValueError(f"max_depth must be an integer >= 1, got {self.max_depth!r}")
        if not self.prior > 0:
            raise ValueError(f"prior must be > 0, got {self.prior!r}")
        z = lambda k: torch.zeros(k, dtype=torch.float64)  # noqa: E731
        self.predicted, self.accepted = z(self.max_depth + 1), z(self.max_depth + 1)
        self.curve_pred, self.curve_corr, self.curve_hit, self.curve_n = (z(self.bins) for _ in range(4))

    def _to(self, device) -> None:
        for name in ("predicted", "accepted", "curve_pred", "curve_corr", "curve_hit", "curve_n"):
            setattr(self, name, getattr(self, name).to(device))

    def ratios(self) -> torch.Tensor:
        """``[max_depth + 1]`` float32 correction per depth (depth 0, the root, is 1)."""
        r = (self.accepted + self.prior) / (self.predicted + self.prior)
        r[0] = 1.0
        return r.float()

    def weight(self, tree: DraftTree) -> torch.Tensor:
        """``[bs, n_nodes]`` float32 multipliers for the tree's path probabilities."""
        self._to(tree.tokens.device)
        d = tree.depth.clamp(0, self.max_depth)
        return self.ratios()[d]

    def update(self, tree: DraftTree, path: torch.Tensor) -> None:
        """Learn from one verify: ``tree`` as verified, ``path`` its accepted node indices."""
        dev = tree.tokens.device
        self._to(dev)
        verified = tree.valid & (tree.parents >= 0)  # non-root nodes that were verified
        p = torch.where(verified, torch.exp(tree.logprob.double()), 0.0)
        p = torch.where(torch.isfinite(p), p, 0.0)
        hit = (accepted_nodes(tree, path) & verified).double()
        d = tree.depth.clamp(0, self.max_depth).reshape(-1)
        w = self.weight(tree).double()  # the correction in force for this verify (curve "after")
        self.predicted.scatter_add_(0, d, p.reshape(-1))
        self.accepted.scatter_add_(0, d, hit.reshape(-1))
        b = (p * self.bins).long().clamp(0, self.bins - 1).reshape(-1)
        m = verified.reshape(-1).double()
        self.curve_pred.scatter_add_(0, b, p.reshape(-1))
        self.curve_corr.scatter_add_(0, b, (w * p).reshape(-1))
        self.curve_hit.scatter_add_(0, b, hit.reshape(-1))
        self.curve_n.scatter_add_(0, b, m)

    def curve(self) -> dict:
        """Per probability bin (by the raw path probability): nodes, mean raw prediction, mean corrected
        prediction and empirical acceptance rate (lists, host side: for reports, not hot paths)."""
        n = self.curve_n.clamp(min=1)
        return {"bin_lo": [i / self.bins for i in range(self.bins)], "nodes": self.curve_n.tolist(),
                "predicted": (self.curve_pred / n).tolist(), "corrected": (self.curve_corr / n).tolist(),
                "accepted": (self.curve_hit / n).tolist()}
