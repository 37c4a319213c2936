"""Lossless verification of a batch of draft trees against the target (greedy and sampling).

The walk (EAGLE-2 / SGLang "target-only"): at node u with
processed target distribution p_u, visit u's children in index order and accept child c with
probability p(c) / (mass not yet rejected); a rejected child's mass is zeroed. With one coin
r ~ U[0,1) per visited node this is: accept the first child c_j with r < p(c_1) + ... + p(c_j)
(a repeated sibling token counts once: after its first copy is rejected its mass is 0).
If no child is accepted, the bonus token is drawn from p_u with every child token zeroed.
The emitted tokens are then distributed exactly as target sampling. Greedy (T = 0) is the same
walk with one-hot p: follow the argmax child, bonus = argmax.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from ..tree import DraftTree
from .sampling import Num, is_greedy, sample_probs, target_probs, uniform

__all__ = ["VerifyResult", "verify_tree", "walk_tree", "walk_greedy", "emitted_tokens", "first_sibling_mask"]


@dataclass(frozen=True)
class VerifyResult:
    """Outcome of one verification step.

    Attributes
    ----------
    path : ``[bs, depth + 1]`` int64 accepted node indices starting with the root 0, -1 padded.
    num_accepted : ``[bs]`` int64 accepted draft tokens (root excluded).
    bonus : ``[bs]`` int64 the token sampled after the last accepted node.
    """

    path: torch.Tensor
    num_accepted: torch.Tensor
    bonus: torch.Tensor


def first_sibling_mask(tree: DraftTree) -> torch.Tensor:
    """``[bs, n_nodes]`` bool: valid non-root node whose token no earlier sibling carries."""
    n = tree.n_nodes
    ar = torch.arange(n, device=tree.device)
    inner = tree.valid & (ar[None, :] > 0)
    same = (tree.parents[:, :, None] == tree.parents[:, None, :]) & (tree.tokens[:, :, None] == tree.tokens[:, None, :])
    earlier = same & inner[:, None, :] & (ar[None, None, :] < ar[None, :, None])  # [bs, i, j<i]
    return inner & ~earlier.any(-1)


def verify_tree(tree: DraftTree, target_logits: torch.Tensor, *, temperature: Num = 0.0, top_k: Num = -1,
                top_p: Num = 1.0, generator: Optional[torch.Generator] = None, validate: bool = True) -> VerifyResult:
    """Verify draft trees against the target model's outputs.

    Parameters
    ----------
    tree : DraftTree
        ``[bs, n_nodes]``.
    target_logits : torch.Tensor
        ``[bs, n_nodes, vocab]``; row i is the target's next-token logits after node i.
    temperature, top_k, top_p : scalar or ``[bs]`` tensor
        Applied exactly as plain sampling (:func:`target_probs`) would; T = 0 is greedy.
    generator : torch.Generator, optional
        Source of the per-node coins and the bonus draw.
    validate : bool
        If True (default), refuse target logits holding NaN or +inf, or a row that is -inf
        everywhere (nothing to emit), at a valid node (padding rows are never read): ``ValueError`` naming the
        request and node, one host read.
        ``-inf`` entries are fine (masked tokens). Engines whose logits come from their own model
        forward pass False (no sync).

    Returns
    -------
    VerifyResult

    Examples
    --------
    >>> t = DraftTree.from_lists([[9, 1, 2, 3]], [[-1, 0, 0, 1]])
    >>> logits = torch.full((1, 4, 5), -9.0); logits[0, 0, 1] = logits[0, 1, 4] = 9.0
    >>> r = verify_tree(t, logits)
    >>> r.path.tolist(), r.num_accepted.tolist(), r.bonus.tolist()
    ([[0, 1, -1]], [1], [4])
    """
    bs, n = tree.tokens.shape
    if target_logits.dim() != 3 or target_logits.shape[:2] != (bs, n):
        raise ValueError(f"target_logits must be [bs, n_nodes, vocab] = [{bs}, {n}, vocab], "
                         f"got {tuple(target_logits.shape)}")
    if validate:
        bad = (torch.isnan(target_logits).any(-1) | torch.isposinf(target_logits).any(-1)
               | torch.isneginf(target_logits).all(-1)) & tree.valid  # [bs, n_nodes]: a padding row is never read
        if bool(bad.any()):
            b, i = (int(x) for x in bad.nonzero()[0])
            raise ValueError(f"target_logits of request {b}, node {i} hold NaN / +inf or are -inf everywhere: "
                             f"no token can be verified from them")
    if is_greedy(temperature):  # host-side check, no sync
        return walk_greedy(tree, target_logits.argmax(-1))  # == walk_tree on one-hot rows, no [.., vocab] work
    probs = target_probs(target_logits, temperature, top_k, top_p)  # [bs, n_nodes, vocab]
    return walk_tree(tree, probs, uniform((bs, tree.depth_bound + 1), tree.device, generator))


def walk_greedy(tree: DraftTree, argmax: torch.Tensor) -> VerifyResult:
    """The greedy walk: :func:`walk_tree` on one-hot target rows, computed from their argmax only.

    Parameters
    ----------
    tree : DraftTree
        ``[bs, n_nodes]``.
    argmax : torch.Tensor
        ``[bs, n_nodes]`` int64, the target's argmax after each node.

    Returns
    -------
    VerifyResult: the first sibling whose token is its parent's argmax is accepted, depth by depth;
    the bonus is the argmax after the last accepted node (none of its children matched it, so the
    one-hot residual of :func:`walk_tree` is that argmax itself).

    Example: tokens [9, 1, 2, 3], parents [-1, 0, 0, 1], argmax [1, 4, 0, 0] -> path [0, 1, -1, -1],
    bonus 4 (node 1 matches the root's argmax 1; node 3's token 3 is not node 1's argmax 4).
    """
    par = tree.parents
    # node j is acceptable iff it is a real child, the first sibling with its token, and its token is
    # its parent's argmax
    match = (tree.tokens == torch.gather(argmax, 1, par.clamp(min=0))) & (par >= 0) & first_sibling_mask(tree)
    bs, D = par.shape[0], tree.depth_bound
    path = torch.full((bs, D + 1), -1, dtype=torch.int64, device=par.device)
    path[:, 0] = 0
    cur = torch.zeros(bs, dtype=torch.int64, device=par.device)
    active = torch.ones(bs, dtype=torch.bool, device=par.device)
    for d in range(D):
        hit = match & (par == cur[:, None])  # [bs, n_nodes]
        active = active & hit.any(-1)
        cur = torch.where(active, hit.long().argmax(-1), cur)
        path[:, d + 1] = torch.where(active, cur, -1)
    num_accepted = (path[:, 1:] >= 0).long().sum(-1)
    return VerifyResult(path, num_accepted, torch.gather(argmax, 1, cur[:, None])[:, 0])


def walk_tree(tree: DraftTree, probs: torch.Tensor, coins: torch.Tensor) -> VerifyResult:
    """The sampling walk of :func:`verify_tree` on processed target distributions.

    Parameters
    ----------
    tree : DraftTree
        ``[bs, n_nodes]``; a node whose parent is -1 (other than the root) is never accepted.
    probs : torch.Tensor
        ``[bs, n_nodes, vocab]`` float; row i is the target's next-token distribution after node i
        (temperature / top-k / top-p already applied; one-hot rows give the greedy walk).
    coins : torch.Tensor
        ``[bs, depth_bound + 1]`` uniforms in [0, 1): column d decides depth d + 1, the last one
        draws the bonus token.

    Returns
    -------
    VerifyResult
    """
    bs, n = tree.tokens.shape
    dev = tree.device
    V = probs.shape[-1]
    par = tree.parents
    tok = tree.tokens.clamp(0, V - 1)
    # mass of each child's token under its parent's distribution (0 for repeats / padding)
    # flat index example: V = 5, parent 2, token 3 -> probs.view(bs, -1)[b, 2 * 5 + 3]
    child_p = torch.gather(probs.reshape(bs, n * V), 1, par.clamp(min=0) * V + tok)
    child_p = torch.where(first_sibling_mask(tree), child_p, 0.0)  # [bs, n_nodes]

    D = tree.depth_bound
    path = torch.full((bs, D + 1), -1, dtype=torch.int64, device=dev)
    path[:, 0] = 0
    cur = torch.zeros(bs, dtype=torch.int64, device=dev)
    active = torch.ones(bs, dtype=torch.bool, device=dev)
    for d in range(D):
        is_child = par == cur[:, None]  # [bs, n_nodes]; padding has parent -1, never a child
        cp = torch.where(is_child, child_p, 0.0)
        hit = is_child & (cp > 0) & (coins[:, d:d + 1] < cp.cumsum(-1))
        nxt = hit.long().argmax(-1)  # first accepted child
        active = active & hit.any(-1)
        cur = torch.where(active, nxt, cur)
        path[:, d + 1] = torch.where(active, nxt, -1)
    num_accepted = (path[:, 1:] >= 0).long().sum(-1)

    # bonus: p at the last accepted node with all of its children's tokens zeroed (all rejected)
    p_last = torch.gather(probs, 1, cur[:, None, None].expand(bs, 1, V))[:, 0].float()  # [bs, vocab]
    kids = (par == cur[:, None]) & tree.valid
    zero = torch.zeros(bs, V + 1, device=dev)
    zero.scatter_add_(1, torch.where(kids, tok, V), kids.float())
    residual = torch.where(zero[:, :V] > 0, 0.0, p_last)
    # the residual can only vanish by rounding (children held all the mass); fall back to p
    residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, p_last)
    bonus = sample_probs(residual, u=coins[:, D])
    return VerifyResult(path, num_accepted, bonus)


def emitted_tokens(tree: DraftTree, result: VerifyResult) -> torch.Tensor:
    """Tokens a round commits: accepted draft tokens then the bonus, ``[bs, depth + 1]``, -1 padded.

    Example: path [0, 3, 5, -1], bonus 7 -> [tok(3), tok(5), 7, -1].
    """
    acc = torch.gather(tree.tokens, 1, result.path[:, 1:].clamp(min=0))
    acc = torch.where(result.path[:, 1:] >= 0, acc, -1)
    out = torch.cat([acc, acc.new_full((acc.shape[0], 1), -1)], dim=1)
    out.scatter_(1, result.num_accepted[:, None], result.bonus[:, None])
    return out
