"""Per-request tree policies inside SGLang's captured EAGLE draft shape (no sglang import).

SGLang's draft loop (topk k, steps S, N verify tokens) expands a fixed beam and leaves a pool of
k + (S-1)k^2 candidates with cumulative scores (``select_top_k_tokens``); ``organize_draft_results``
then keeps the N-1 best. Here each request's policy chooses its own subset of that pool instead:

* no policy (None): SGLang's own top N-1 (native behaviour);
* ``none``: the root alone (speculation off for the request: plain decoding);
* ``eagle2``: the top ``min(budget, N) - 1`` by score;
* ``talon`` / ``salf`` / ``c2t`` / ``chain``: the real policy run by :func:`grow_tree` over a
  *pool-restricted draft* whose vocabulary is a node's k child slots: a pool node's children
  are exactly the ones SGLang's beam computed (none for nodes the beam did not expand), with
  their true conditional draft probabilities. The policy thus sees what the captured draft
  computed; a policy that needs nodes the beam did not expand is limited to the beam.

The selection is padded back to exactly N-1 with SGLang's next-best nodes (the kernel needs N
per request) and :func:`unlink_filler` removes the padding from the verify traversal, so the
verified tree is exactly the policy's tree.
"""

from __future__ import annotations

from typing import List, Optional

import torch

from ..policies import grow_tree
from ..policies.batch_budget import select_best
from ..policies.params import Eagle2Params, NoneParams, PolicyParams

__all__ = ["PoolView", "select_from_pool", "share_batch_budget", "unlink_filler"]


class PoolView:
    """SGLang's draft pool for a batch (what ``select_top_k_tokens`` accumulated over S steps).

    Attributes
    ----------
    scores : ``[bs, P]`` cumulative path probabilities, P = k + (S-1)k^2, SGLang's flat order
    tokens : ``[bs, P]`` token ids
    parent_list : ``[bs, 1 + (S-1)k]`` SGLang's parent table (``parents_list[:-1]`` concatenated)
    child_base : ``[bs, P + 1]`` flat index of the first of a node's k children, -1 where the beam
        did not expand the node; column P is the root (its children are 0..k-1).

    Examples
    --------
    k = 2, S = 3: step 0 gives flat 0-1 (root's children); step 1 expands both, children at
    2-3 (of 0) and 4-5 (of 1); step 2 expands the 2 best of 2-5, say [5, 2], children at 6-7
    (of 5) and 8-9 (of 2). child_base = [2, 4, 8, -1, -1, 6, -1, ..., root: 0].
    """

    def __init__(self, score_list, token_list, parents_list, topk: int):
        k = topk
        self.k = k
        self.scores = torch.cat(score_list, dim=1).flatten(1).float()
        self.tokens = torch.cat(token_list, dim=1)
        bs, P = self.scores.shape
        dev = self.scores.device
        if len(parents_list) > 1:
            self.parent_list = torch.cat(parents_list[:-1], dim=1)
        else:
            self.parent_list = torch.empty(bs, 0, dtype=torch.long, device=dev)
        base = torch.full((bs, P + 1), -1, dtype=torch.long, device=dev)
        base[:, P] = 0
        for i in range(1, len(score_list)):  # step i expands the frontier chosen at step i - 1
            frontier = torch.arange(k, device=dev).expand(bs, k) if i == 1 else parents_list[i - 1].long()
            starts = k + (i - 1) * k * k + torch.arange(frontier.shape[1], device=dev) * k
            base.scatter_(1, frontier, starts.expand(bs, -1))
        self.child_base = base

    def rows(self, rows: torch.Tensor) -> "PoolView":
        sub = PoolView.__new__(PoolView)
        sub.k, sub.scores, sub.tokens = self.k, self.scores[rows], self.tokens[rows]
        sub.parent_list, sub.child_base = self.parent_list[rows], self.child_base[rows]
        return sub

    def child_logprobs(self, flat: torch.Tensor) -> torch.Tensor:
        """``[bs, w]`` flat indices (P = root, -1 = none) -> ``[bs, w, k]`` conditional log-probs
        of the node's k child slots (-inf where the beam did not expand the node)."""
        P = self.scores.shape[1]
        base = torch.where(flat >= 0, torch.gather(self.child_base, 1, flat.clamp(0, P)), -1)
        kids = base[:, :, None] + torch.arange(self.k, device=flat.device)  # [bs, w, k]
        kid_lp = torch.gather(self.scores, 1, kids.clamp(0, P - 1).flatten(1)).view(kids.shape).log()
        own = torch.where(flat == P, 0.0, torch.gather(self.scores, 1, flat.clamp(0, P - 1)).log())
        return torch.where(base[:, :, None] >= 0, kid_lp - own[:, :, None], float("-inf"))


def _policy_keep(pool: PoolView, specs: List[PolicyParams], N: int) -> torch.Tensor:
    """Run each row's policy over the pool-restricted draft -> ``[bs, P]`` bool keep mask.

    The working tree's "tokens" are child slots 0..k-1; node u's flat pool index is
    ``child_base[flat(parent(u))] + slot(u)``, resolved as nodes enter the frontier.
    """
    bs, P = pool.scores.shape
    dev = pool.scores.device
    state = {}

    def flat_of(tree, nodes):  # [bs, w] working-tree nodes -> [bs, w] flat pool indices
        pf = torch.gather(state["fid"], 1, torch.gather(tree.parents, 1, nodes.clamp(min=0)).clamp(min=0))
        base = torch.gather(pool.child_base, 1, pf.clamp(0, P))
        slot = torch.gather(tree.tokens, 1, nodes.clamp(min=0))
        return torch.where((nodes >= 0) & (base >= 0), base + slot, -1)

    def expand(tree, frontier):  # [bs, width] -> [bs, width, k]
        if "fid" not in state:
            state["fid"] = torch.full((bs, tree.n_nodes), -1, dtype=torch.long, device=dev)
            state["fid"][:, 0] = P  # the root
        f = flat_of(tree, frontier)
        cur = torch.gather(state["fid"], 1, frontier.clamp(min=0))
        state["fid"].scatter_(1, frontier.clamp(min=0), torch.where(frontier >= 0, f, cur))
        return pool.child_logprobs(f)

    root = torch.full((bs, 1), P, dtype=torch.long, device=dev)
    tree = grow_tree(specs, torch.zeros(bs, dtype=torch.long, device=dev), pool.child_logprobs(root)[:, 0], expand,
                     validate=False)  # the pool's rows are log-probs by construction; no sync per round
    fid = torch.full(tree.tokens.shape, -1, dtype=torch.long, device=dev)
    fid[:, 0] = P
    for d in range(1, tree.depth_bound + 1):  # parents precede children: resolve level by level
        base = torch.gather(pool.child_base, 1, torch.gather(fid, 1, tree.parents.clamp(min=0)).clamp(0, P))
        fid = torch.where(tree.depth == d, torch.where(base >= 0, base + tree.tokens.clamp(min=0), -1), fid)
    # at most N-1 drafted nodes; a prefix of the node order is still a tree
    ar = torch.arange(tree.n_nodes, device=dev)
    take = tree.valid & (ar[None, :] >= 1) & (ar[None, :] < N) & (fid >= 0) & (fid < P)
    keep = torch.zeros(bs, P + 1, dtype=torch.bool, device=dev)
    keep.scatter_(1, torch.where(take, fid, P), take)
    return keep[:, :P]


def _top_limit(p: Optional[PolicyParams], N: int) -> int:
    """How many of SGLang's top-ranked pool nodes a row keeps: N-1 native, ``min(budget, N) - 1``
    eagle2, 0 for ``none``; -1 for the policies run over the pool (:func:`_policy_keep`)."""
    if p is None:
        return N - 1
    if isinstance(p, Eagle2Params):
        return min(p.budget, N) - 1
    return 0 if isinstance(p, NoneParams) else -1


def select_from_pool(score_list, token_list, parents_list, num_draft_token: int, topk: int,
                     params: List[Optional[PolicyParams]], native=None):
    """``organize_draft_results`` with per-request policies.

    Parameters
    ----------
    score_list, token_list, parents_list, num_draft_token : as SGLang passes them
    topk : the server's ``speculative_eagle_topk``
    params : one policy per request (None = SGLang's own selection)
    native : optional ``(parent_list, top_scores_index, draft_tokens)`` from SGLang's function;
        rows without a policy take it verbatim (exact native behaviour, ties included)

    Returns
    -------
    (parent_list, top_scores_index ``[bs, N-1]``, draft_tokens ``[bs, N-1]``, keep ``[bs, N]`` bool)
        As SGLang returns them, plus ``keep[b, i]``: verify node i (0 = root) is part of
        request b's policy tree (the rest is filler, unlinked by :func:`unlink_filler`).
    """
    N = num_draft_token
    pool = PoolView(score_list, token_list, parents_list, topk)
    bs, P = pool.scores.shape
    dev = pool.scores.device
    # SGLang's ranking, ties toward the earlier (shallower) candidate; sorted position j < limit <=> rank < limit
    order = torch.sort(pool.scores, dim=-1, descending=True, stable=True).indices  # [bs, P]
    limit = torch.tensor([_top_limit(p, N) for p in params], device=dev)
    ar = torch.arange(P, device=dev)
    # [bs, P]: native and eagle2 rows keep their top `limit`; policy rows are set below
    keep = torch.zeros_like(pool.scores, dtype=torch.bool).scatter(1, order, ar[None, :] < limit[:, None])
    others = [i for i, p in enumerate(params) if _top_limit(p, N) < 0]
    if others:
        rows = torch.tensor(others, device=dev)
        keep[rows] = _policy_keep(pool.rows(rows), [params[i] for i in others], N)
    # pad to exactly N-1 with the best unselected candidates: a prefix of SGLang's ranking, which is
    # closed under ancestors because a parent never scores below its child
    need = (N - 1) - keep.long().sum(-1, keepdim=True)
    unsel = ~torch.gather(keep, 1, order)
    fill = torch.zeros_like(keep).scatter(1, order, unsel & (unsel.long().cumsum(-1) <= need))
    idx = torch.where(keep | fill, ar, P)
    top_scores_index = torch.sort(idx, dim=-1).values[:, :N - 1]
    node_keep = torch.cat([torch.ones(bs, 1, dtype=torch.bool, device=dev),
                           torch.gather(keep, 1, top_scores_index)], dim=1)
    if native is not None:
        is_native = torch.tensor([p is None for p in params], device=dev)[:, None]
        top_scores_index = torch.where(is_native, native[1], top_scores_index)
        node_keep = node_keep | is_native
    draft_tokens = torch.gather(pool.tokens, 1, top_scores_index)
    return pool.parent_list, top_scores_index, draft_tokens, node_keep


def share_batch_budget(scores: torch.Tensor, top_scores_index: torch.Tensor, keep: torch.Tensor,
                       shares: torch.Tensor, per_request: int) -> torch.Tensor:
    """One verify budget for the sharing requests of a batch (issue 13) on SGLang's verify layout.

    Parameters
    ----------
    scores : ``[bs, P]`` the pool's cumulative path probabilities (:class:`PoolView`).
    top_scores_index : ``[bs, N-1]`` pool index of verify nodes 1..N-1 (ascending: parents first).
    keep : ``[bs, N]`` bool, each request's own policy tree (:func:`select_from_pool`).
    shares : ``[bs]`` bool, the requests that share the budget (the others keep their tree whole).
    per_request : mean verified tokens per sharing request (roots included).

    Returns
    -------
    ``[bs, N]`` bool: the sharing requests' ``(per_request - 1) * n_sharing`` best non-root nodes of the
    batch by path probability, within their own trees; ancestor-closed (a child's cumulative score never
    exceeds its parent's and a parent has the smaller column); other rows as given.

    Example: two sharing rows with node scores [.9, .8, .1] and [.3, .2, .1] (all kept), per_request 3:
    4 nodes go to the batch's best, .9 .8 .3 .2 -> keep [[T, T, T, F], [T, T, T, F]].
    """
    bs, N = keep.shape
    col = torch.arange(N, device=keep.device).expand(bs, N)
    vals = torch.cat([torch.full((bs, 1), float("inf"), device=scores.device),
                      torch.gather(scores, 1, top_scores_index)], dim=1)  # [bs, N] root: +inf
    pool_rows = shares[:, None] & (col >= 1)  # [bs, N] the nodes the budget decides on
    left = (per_request - 1) * shares.long().sum()  # non-root tokens of the sharing rows
    chosen = select_best(vals, col, keep & pool_rows, left)
    return (keep & ~pool_rows) | chosen


def unlink_filler(next_token: torch.Tensor, next_sibling: torch.Tensor, keep: torch.Tensor):
    """Remove non-kept (filler) nodes from SGLang's first-child / next-sibling chains.

    ``[bs, N]`` int64 chains, ``[bs, N]`` bool keep -> new chains: a kept node's first child becomes
    its first *kept* child and its next sibling the next *kept* sibling; fillers get -1. The kept
    set is closed under ancestors, so no kept node hangs below a filler.

    Example: the root's children 1 -> 2 -> 3 (sibling chain), keep = {0, 1, 3}:
    next_token[0] = 1, next_sibling[1] = 3.
    """
    bs, N = keep.shape
    ar = torch.arange(N, device=keep.device)
    # J[x] = first kept node on x's sibling chain starting at x (pointer jumping, log2 N rounds)
    J = torch.where(keep, ar[None, :], next_sibling)
    for _ in range(max(N, 2).bit_length()):
        J = torch.where(J >= 0, torch.gather(J, 1, J.clamp(min=0)), J)

    def skip(ptr):
        return torch.where(ptr >= 0, torch.gather(J, 1, ptr.clamp(min=0)), -1)

    return torch.where(keep, skip(next_token), -1), torch.where(keep, skip(next_sibling), -1)
