"""One token cap for the whole batch: choose which candidate nodes every request verifies.

Each request's own policy proposes a candidate tree (its shaping: TALON's gate, C2T's classifier, ...),
grown to its tree size N. This module then spends the batch's *token cap* ``T`` (verified tokens per
round, roots included) where the expected accepted tokens are highest. A node's value is its path
probability under the draft, optionally times a per-request (or per-node) calibration weight: the expected number of accepted tokens
of a verified tree is the sum of its nodes' acceptance probabilities (each node is accepted iff its whole
path is), so the objective is

    maximise  sum_b sum_{v in S_b} w_b(v) * P_b(v)    over S_b ancestor-closed, root in S_b,
              floor_b <= |S_b| <= cap_b,  sum_b |S_b| <= T.

With values made monotone along every path (``v``'s value is capped by its parent's), each request's best
``k`` nodes are ancestor-closed, and taking the globally best values (ties: shallower first) is optimal:
an exchange argument (unit weights, a partition constraint per request) — and the brute-force oracle in
``tests/policies/test_token_cap.py`` checks it on small cases.

Everything is vectorised over the batch with no host sync (``T`` may be a tensor). :func:`best_total`
picks ``T`` from a measured verify-cost curve to maximise expected tokens per second.
"""

from __future__ import annotations

from typing import Optional, Union

import torch

from ..tree import DraftTree
from .params import shown

__all__ = ["node_values", "allocate_batch", "best_total", "select_best", "split_batch_option", "CAP_KEY"]

# a request's policy dict may carry {"token_cap": false}: it keeps its own whole tree (its nodes count
# against the token cap but are never trimmed); true / absent: it shares the token cap
CAP_KEY = "token_cap"

Num = Union[int, torch.Tensor]


def split_batch_option(spec):
    """``(policy spec without the cap key, whether the request shares the batch's token cap)``.

    >>> split_batch_option({"policy": "talon", "budget": 8, "token_cap": False})
    ({'policy': 'talon', 'budget': 8}, False)
    """
    if not isinstance(spec, dict) or CAP_KEY not in spec:
        return spec, True
    share = spec[CAP_KEY]
    if not isinstance(share, bool):
        raise ValueError(f"{CAP_KEY} must be true (share the batch's token cap) or false (keep the "
                         f"policy's whole tree), got {shown(share)}")
    return {k: v for k, v in spec.items() if k != CAP_KEY}, share


def node_values(tree: DraftTree, weight: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Path probabilities (times ``weight``), made monotone along every path; root +inf, padding -inf.

    Parameters
    ----------
    tree : DraftTree ``[bs, n_nodes]`` (parents precede children).
    weight : ``[bs]`` or ``[bs, n_nodes]`` float calibration multipliers, optional.

    Returns
    -------
    ``[bs, n_nodes]`` float32. Example: path probs [root, .6, .3, .5 (child of 2)] -> [inf, .6, .3, .3].
    """
    p = torch.exp(tree.logprob.float())
    p = torch.where(torch.isfinite(p), p, 0.0)  # a NaN / inf draft value is worth nothing
    if weight is not None:
        p = p * (weight[:, None] if weight.dim() == 1 else weight)
    root = tree.parents < 0
    valid = tree.depth >= 0
    v = torch.where(valid & ~root, p, torch.where(root & valid, float("inf"), float("-inf")))
    # cap every node by its parent's value, one tree level at a time (depth_bound iterations, no sync)
    levels = tree.depth_bound if tree.depth_bound is not None else tree.n_nodes
    par = tree.parents.clamp(min=0)
    for _ in range(levels):
        v = torch.where(valid & ~root, torch.minimum(v, torch.gather(v, 1, par)), v)
    return v


def _rank_desc(values: torch.Tensor, depth: torch.Tensor) -> torch.Tensor:
    """Rank of each entry along the last dim by value descending, ties by depth ascending, then index.

    Example: values [5, 7, 7], depth [0, 2, 1] -> order [2, 1, 0] (7 at depth 1, 7 at depth 2, 5),
    so ranks [2, 1, 0].
    """
    by_depth = torch.sort(depth, dim=-1, stable=True).indices  # [.., n] shallow first
    v_sorted = torch.gather(values, -1, by_depth)
    order = torch.gather(by_depth, -1, torch.sort(-v_sorted, dim=-1, stable=True).indices)
    rank = torch.empty_like(order)
    rank.scatter_(-1, order, torch.arange(order.shape[-1], device=order.device).expand_as(order))
    return rank


def _split(tree: DraftTree, cap, floor, weight):
    """(values ``[bs, n]``, roots, ranking depth, forced nodes, optional nodes) of one batch.

    A candidate with local rank r (1-based: the root ranks 0) is allowed while r < cap (tree size r + 1
    <= cap) and forced while r < floor."""
    bs, n = tree.tokens.shape
    dev = tree.tokens.device
    cap = torch.full((bs,), n, device=dev) if cap is None else cap.to(dev)
    floor = torch.ones(bs, dtype=torch.int64, device=dev) if floor is None else floor.to(dev)
    v = node_values(tree, weight)  # [bs, n]
    root = (tree.parents < 0) & (tree.depth >= 0)
    cand = torch.isfinite(v) & ~root  # non-root valid nodes with a value
    depth = torch.where(tree.depth >= 0, tree.depth, n + 1)
    local = _rank_desc(v, depth)  # [bs, n] the root ranks 0 (inf), then the candidates, padding last
    allowed = cand & (local < cap[:, None])
    forced = allowed & (local < floor[:, None])
    return v, root, depth, forced, allowed & ~forced


def allocate_batch(tree: DraftTree, total: Num, cap: Optional[torch.Tensor] = None,
                   floor: Optional[torch.Tensor] = None, weight: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The nodes every request verifies under the batch's token cap.

    Parameters
    ----------
    tree : DraftTree ``[bs, n_nodes]``: each request's candidates (its policy's tree at its cap).
    total : int or 0-d int64 tensor: verified tokens for the whole batch, roots included (T).
    cap, floor : ``[bs]`` int64, per-request max / min tree size (roots included); defaults N / 1.
    weight : ``[bs]`` or ``[bs, n_nodes]`` calibration multipliers of the path probabilities.

    Returns
    -------
    keep : ``[bs, n_nodes]`` bool, ancestor-closed, roots always kept (even when T < bs).

    Example: two requests with path probs [.9, .8] and [.5, .1] under T = 4 (2 roots + 2):
    keep .9 and .8 of request 0, nothing of request 1 beyond its root.
    """
    v, root, depth, forced, optional = _split(tree, cap, floor, weight)
    left = torch.as_tensor(total, device=v.device) - root.sum() - forced.sum()  # tokens for optional nodes
    return root | forced | select_best(v, depth, optional, left)


def select_best(values: torch.Tensor, depth: torch.Tensor, optional: torch.Tensor, count: Num) -> torch.Tensor:
    """The ``count`` best ``optional`` entries of the whole batch (ties: shallower first, then index).

    Parameters
    ----------
    values : ``[bs, n_nodes]`` float, monotone along every path (a child never above its parent).
    depth : ``[bs, n_nodes]`` int64 tie-break; optional : ``[bs, n_nodes]`` bool candidates.
    count : int or 0-d tensor (<= 0 selects nothing).

    Returns
    -------
    ``[bs, n_nodes]`` bool. With monotone values and parents shallower than children, the selection
    plus the parents it needs is ancestor-closed. Example: values [[.9, .2], [.5, .4]], count 2 ->
    [[T, F], [T, F]].
    """
    bs, n = values.shape
    flat_v = torch.where(optional, values, float("-inf")).reshape(1, -1)
    grank = _rank_desc(flat_v, depth.reshape(1, -1)).reshape(bs, n)  # global rank among all nodes
    return optional & (grank < count)


def best_total(tree: DraftTree, cost_ms: torch.Tensor, cap: Optional[torch.Tensor] = None,
               floor: Optional[torch.Tensor] = None, weight: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The token cap T maximising expected tokens per second, from a verify-cost curve.

    Parameters
    ----------
    cost_ms : ``[T_max + 1]`` float: measured (interpolated) time of a round verifying T tokens, ``cost_ms[T]``.

    Returns
    -------
    0-d int64 tensor T in [bs + forced, bs + forced + optional] (no host sync). Expected tokens of a round
    with token cap T = bs (one bonus / root token each) + sum of the T - bs best node values.
    """
    bs, n = tree.tokens.shape
    dev = tree.tokens.device
    v, root, _, forced, optional = _split(tree, cap, floor, weight)
    base_tokens = root.sum() + forced.sum()  # T can't go below this
    base_value = bs + torch.where(forced, v, 0.0).sum()
    opt = torch.sort(torch.where(optional, v, 0.0).reshape(-1), descending=True).values  # [bs * n]
    gain = torch.cat([torch.zeros(1, device=dev), torch.cumsum(opt, 0)])  # gain[j] = best j optional nodes
    j = torch.arange(gain.shape[0], device=dev)
    t = (base_tokens + j).clamp(max=cost_ms.shape[0] - 1)
    valid = (j <= optional.sum()) & (base_tokens + j <= cost_ms.shape[0] - 1)
    rate = torch.where(valid, (base_value + gain) / cost_ms.to(dev)[t], float("-inf"))
    return base_tokens + torch.argmax(rate)
