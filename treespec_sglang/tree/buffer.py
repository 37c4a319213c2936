"""A growable batched tree used while a policy builds its draft tree, and the ops that compact it.

Everything here is sync-free: sizes live in tensors, writes go through ``scatter_`` with a
spare "dump" column that swallows invalid entries, so no boolean-mask indexing is needed.
"""

from __future__ import annotations

import torch

from .draft_tree import DraftTree

__all__ = ["TreeBuffer", "pack_left", "compact", "NEG_INF"]

NEG_INF = float("-inf")


def pack_left(keep: torch.Tensor, values: torch.Tensor, width: int, fill) -> torch.Tensor:
    """Move the kept entries of each row to the front, preserving their order.

    Parameters
    ----------
    keep : torch.Tensor
        ``[bs, m]`` bool.
    values : torch.Tensor
        ``[bs, m]`` any dtype.
    width : int
        Output width; kept entries beyond it are dropped.
    fill : scalar
        Value for the unused tail.

    Returns
    -------
    torch.Tensor
        ``[bs, width]``.

    Examples
    --------
    keep = [[F, T, T]], values = [[4, 5, 6]], width 2 -> [[5, 6]];
    keep = [[T, F, F]] -> [[4, fill]].
    """
    bs, m = keep.shape
    slot = keep.long().cumsum(-1) - 1  # position among kept entries
    slot = torch.where(keep & (slot < width), slot, width)  # dropped -> dump column
    out = torch.full((bs, width + 1), fill, dtype=values.dtype, device=values.device)
    out.scatter_(1, slot, values)
    return out[:, :width]


class TreeBuffer:
    """Append-only batched tree with a fixed capacity (the policy's static maximum).

    Parameters
    ----------
    root_tokens : torch.Tensor
        ``[bs]`` int64.
    capacity : int
        Maximum number of nodes per request, root included.
    """

    def __init__(self, root_tokens: torch.Tensor, capacity: int):
        bs = root_tokens.shape[0]
        dev = root_tokens.device
        self.capacity = capacity
        c1 = capacity + 1  # last column is the dump slot for invalid writes
        self.tokens = torch.full((bs, c1), -1, dtype=torch.int64, device=dev)
        self.parents = torch.full((bs, c1), -1, dtype=torch.int64, device=dev)
        self.depth = torch.full((bs, c1), -1, dtype=torch.int64, device=dev)
        self.logprob = torch.full((bs, c1), NEG_INF, dtype=torch.float32, device=dev)
        self.tokens[:, 0] = root_tokens
        self.depth[:, 0] = 0
        self.logprob[:, 0] = 0.0
        self.size = torch.ones(bs, dtype=torch.int64, device=dev)

    def append(self, tokens: torch.Tensor, parents: torch.Tensor, logprob: torch.Tensor,
               valid: torch.Tensor) -> torch.Tensor:
        """Append the valid candidates of each row, in column order.

        Parameters
        ----------
        tokens, parents : torch.Tensor
            ``[bs, m]`` int64 (parents are node indices already in the buffer).
        logprob : torch.Tensor
            ``[bs, m]`` float32 path log-probabilities.
        valid : torch.Tensor
            ``[bs, m]`` bool.

        Returns
        -------
        torch.Tensor
            ``[bs, m]`` int64 new node indices, -1 where invalid or over capacity.

        Examples
        --------
        size = [3], valid = [[T, F, T]] -> returns [[3, -1, 4]] and size becomes [5].
        """
        cap = self.capacity
        slot = self.size[:, None] + valid.long().cumsum(-1) - 1  # [bs, m]
        ok = valid & (slot < cap)
        slot = torch.where(ok, slot, cap)
        pdepth = torch.gather(self.depth, 1, parents.clamp(min=0))
        self.tokens.scatter_(1, slot, tokens)
        self.parents.scatter_(1, slot, parents)
        self.depth.scatter_(1, slot, pdepth + 1)
        self.logprob.scatter_(1, slot, logprob.float())
        self.size = self.size + ok.long().sum(-1)
        return torch.where(ok, slot, -1)

    def gather_logprob(self, idx: torch.Tensor) -> torch.Tensor:
        """``[bs, w]`` node indices (-1 allowed) -> ``[bs, w]`` path log-probs (-inf for -1)."""
        lp = torch.gather(self.logprob, 1, idx.clamp(min=0))
        return torch.where(idx >= 0, lp, NEG_INF)

    def gather_depth(self, idx: torch.Tensor) -> torch.Tensor:
        """``[bs, w]`` node indices (-1 allowed) -> ``[bs, w]`` depths (-1 for -1)."""
        d = torch.gather(self.depth, 1, idx.clamp(min=0))
        return torch.where(idx >= 0, d, -1)

    def view(self, depth_bound: int) -> DraftTree:
        """The current tree as a :class:`DraftTree` (views, no copy) of ``capacity`` columns."""
        c = self.capacity
        return DraftTree(self.tokens[:, :c], self.parents[:, :c], self.depth[:, :c],
                         self.logprob[:, :c], self.size, depth_bound)


def compact(tree: DraftTree, keep: torch.Tensor, n_out: int) -> DraftTree:
    """Keep an ancestor-closed subset of nodes, renumbered in their original order.

    Parameters
    ----------
    tree : DraftTree
        ``[bs, n_nodes]`` source tree (parents precede children).
    keep : torch.Tensor
        ``[bs, n_nodes]`` bool; must contain the root and every kept node's parent.
    n_out : int
        Output width (>= the largest kept count).

    Returns
    -------
    DraftTree
        ``[bs, n_out]``.

    Examples
    --------
    parents = [-1, 0, 0, 1, 2], keep = [T, F, T, F, T]
    new index = cumsum(keep) - 1 = [0, _, 1, _, 2]; new parents = [-1, 0, 1].
    """
    bs, n = keep.shape
    dev = keep.device
    new_idx = keep.long().cumsum(-1) - 1  # [bs, n_nodes]
    slot = torch.where(keep & (new_idx < n_out), new_idx, n_out)
    par = tree.parents
    new_par = torch.where(par >= 0, torch.gather(new_idx, 1, par.clamp(min=0)), -1)

    def put(src, fill, dtype):
        out = torch.full((bs, n_out + 1), fill, dtype=dtype, device=dev)
        out.scatter_(1, slot, src)
        return out[:, :n_out]

    tokens = put(tree.tokens, -1, torch.int64)
    parents = put(new_par, -1, torch.int64)
    depth = put(tree.depth, -1, torch.int64)
    logprob = put(tree.logprob, NEG_INF, torch.float32)
    size = torch.minimum(keep.long().sum(-1), torch.tensor(n_out, device=dev))
    return DraftTree(tokens, parents, depth, logprob, size, min(tree.depth_bound, max(n_out - 1, 0)))
