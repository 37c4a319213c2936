"""The reference engine's token cap for one round (``T``, the tokens the batch verifies): which candidate
nodes each request verifies, and the ragged layout the verify forward then runs.

:func:`plan_round` turns the round's candidate trees (every request's own policy, grown to its tree size N) into
the verified trees: :func:`~treespec_sglang.policies.token_cap.allocate_batch` keeps the batch's best
nodes under ``T`` (a fixed int, or chosen by :func:`~treespec_sglang.policies.token_cap.best_total`
from a round-cost line, optionally scaled by a probe factor); requests that opted out keep their whole
tree; the kept trees are compacted to the largest one, and the kept nodes' flat rows make the verify
ragged (the target's linear layers run ``T`` tokens, not ``bs x width``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Tuple, Union

import torch

from ..policies.token_cap import allocate_batch, best_total
from ..policies.calibration import DepthCalibration
from ..tree import DraftTree, compact, kept_rows

__all__ = ["AutoTokenCap", "TokenCapPlan", "plan_round"]


@dataclass(frozen=True)
class AutoTokenCap:
    """``token_cap="auto"`` for one round: ``ms`` ``[T_max + 1]`` float32 round cost per verified
    tokens (:meth:`~treespec_sglang.engine.round_cost.RoundCost.costs`), the probe factor on the chosen T, and
    ``min_prob``: the draft-pruning threshold (a frontier node whose path probability is below it is not
    expanded: :func:`~treespec_sglang.policies.grow.grow_tree` ``min_logprob``); 0 = no pruning."""

    ms: torch.Tensor
    probe: float = 1.0
    min_prob: float = 0.0

    def __post_init__(self):
        if self.ms.dim() != 1 or self.ms.shape[0] < 2:
            raise ValueError(f"AutoTokenCap.ms must be [T_max + 1] with T_max >= 1, got {tuple(self.ms.shape)}")
        if not self.probe > 0:
            raise ValueError(f"AutoTokenCap.probe must be > 0, got {self.probe!r}")
        if not 0.0 <= self.min_prob <= 1.0:
            raise ValueError(f"AutoTokenCap.min_prob must be in [0, 1], got {self.min_prob!r}")


class TokenCapPlan:
    """The batch's token cap round by round, so the decode loop only asks and reports.

    ``token_cap`` None: every request verifies its whole tree; an int T: ``ceil(T * running / bs)`` as requests
    finish; ``"auto"`` (with ``cost``, a :class:`~treespec_sglang.engine.round_cost.RoundCost`): each round an
    :class:`AutoTokenCap` from the line fitted on the rounds so far (a probing round scales the chosen T, since the
    slope fit needs a spread of T; ``prune`` x the marginal value is the draft-pruning threshold), and
    :meth:`observe` feeds the fit each finished round.
    """

    def __init__(self, token_cap: Union[None, int, str], bs: int, max_nodes: int, cost=None, prune: float = 0.0):
        if token_cap == "auto" and cost is None:
            raise ValueError('token_cap="auto" needs a round-cost line (cost=)')
        self.token_cap, self.bs, self.max_nodes, self.cost, self.prune = token_cap, bs, max_nodes, cost, prune

    def cap(self, running: int) -> Union[None, int, AutoTokenCap]:
        """This round's token cap for ``running`` requests."""
        if self.token_cap == "auto":
            c = self.cost
            return AutoTokenCap(c.costs(running * self.max_nodes), c.probe(), min(self.prune * c.marginal_value(), 1.0))
        return None if self.token_cap is None else -(-self.token_cap * running // self.bs)

    def observe(self, verified: int, ms: float, running: int, committed: int, steps: int) -> None:
        """A finished round (its host read done, so its wall time is complete): ``verified`` tokens in ``ms``."""
        if self.cost is not None:
            self.cost.observe(verified, ms, running, committed=committed, steps=steps)


def plan_round(tree: DraftTree, token_cap: Union[int, AutoTokenCap], calibration: Optional[DepthCalibration] = None,
               shares: Optional[List[bool]] = None) -> Tuple[DraftTree, torch.Tensor]:
    """The verified trees and their ragged rows.

    Parameters
    ----------
    tree : DraftTree ``[bs, n_nodes]``, the candidates.
    token_cap : int (T for the batch, roots included) or :class:`AutoTokenCap`.
    calibration : weighs the path probabilities (per depth), optional.
    shares : per request, False = keeps its whole tree (its nodes still count against T).

    Returns
    -------
    (DraftTree ``[bs, width]`` with width = the largest kept tree, rows ``[T]`` int64: the kept nodes'
    rows in the flattened ``[bs * width]`` grid, request-major). One host read (width and T: the
    forward's shapes). Example: kept sizes [2, 1] -> width 2, rows [0, 1, 2].
    """
    bs, dev = tree.bs, tree.tokens.device
    weight = None if calibration is None else calibration.weight(tree)
    floor = None
    if shares is not None and not all(shares):
        own = torch.tensor([not x for x in shares], device=dev)
        floor = torch.where(own, tree.size, 1)  # [bs] opted out: the whole tree is forced
    if isinstance(token_cap, AutoTokenCap):  # the most expected tokens per ms (0-d tensor, no sync)
        ms = token_cap.ms.to(dev)
        need = bs * tree.n_nodes + 1
        if ms.shape[0] < need:  # extend flat past the line's end
            ms = torch.cat([ms, ms[-1:].expand(need - ms.shape[0])])
        total = best_total(tree, ms, floor=floor, weight=weight)
        if token_cap.probe != 1.0:
            total = (total.float() * token_cap.probe).round().long()
    else:
        total = token_cap
    keep = allocate_batch(tree, total, floor=floor, weight=weight)  # [bs, n_nodes]
    width, count = torch.stack([keep.sum(1).max(), keep.sum()]).tolist()  # the round's one extra read
    out = compact(tree, keep, width)
    rows = kept_rows(out.valid, count)  # kept nodes are a prefix of each compacted row
    return out, rows
