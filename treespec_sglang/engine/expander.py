"""Draft-side tree expansion for :class:`~treespec_sglang.engine.SpecEngine` (grow_tree's ``expand``).

:class:`TreeExpander` runs the draft head on a working tree's frontier nodes with tree attention
over the committed draft cache; :class:`EntropyRecorder` wraps it to keep each node's parent
entropy for C2T training data.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..tree import DraftTree, ancestor_mask, kept_rows, to_grid
from .kv_cache import KVCache

__all__ = ["TreeExpander", "EntropyRecorder"]


class TreeExpander:
    """grow_tree's ``expand``: run the draft on the frontier nodes of the working tree.

    Node u's input pair is (draft feature of parent(u), token(u)) at position len + depth(u);
    it attends to the committed draft cache (slots 1..len) and to the tree-region KV of its
    ancestors, kept in a per-round buffer indexed by working-tree node.
    """

    def __init__(self, models, dcache: KVCache, lens: torch.Tensor, f_root: torch.Tensor, lmax: int,
                 ragged: bool = False):
        # models: the engine's ModelCalls (the draft, its head, the token map)
        self.m, self.dcache, self.lens, self.f_root, self.lmax = models, dcache, lens, f_root, lmax
        self.calls = 0
        self.C = None
        # ragged: grow_tree (draft pruning) hands over the live count; the draft's linears and LM head then
        # run on the live frontier nodes only
        self.ragged = ragged

    def _alloc(self, C: int):
        bs, H = self.f_root.shape
        _, _, h, _, hd = self.dcache.k.shape
        self.C = C
        self.tk = torch.zeros(bs, h, C, hd, dtype=self.m.dtype, device=self.m.device)
        self.tv = torch.zeros_like(self.tk)
        self.feat = torch.zeros(bs, C, H, dtype=self.m.dtype, device=self.m.device)
        self.feat[:, 0] = self.f_root

    def __call__(self, tree: DraftTree, frontier: torch.Tensor, n_live: Optional[int] = None) -> torch.Tensor:
        # tree [bs, C] working tree, frontier [bs, width] -> [bs, width, vocab] child log-probs
        # n_live (host int, ragged): the live frontier entries; -1 rows then come back -inf
        if self.C is None:
            self._alloc(tree.n_nodes)
        self.calls += 1
        bs, W = frontier.shape
        fr = frontier.clamp(min=0)
        par = torch.gather(tree.parents, 1, fr)
        tok = self.m.to_target_ids(torch.gather(tree.tokens, 1, fr), par < 0).clamp(min=0)
        par = par.clamp(min=0)
        pfeat = torch.gather(self.feat, 1, par[:, :, None].expand(bs, W, self.feat.shape[-1]))
        pos = self.lens[:, None] + torch.gather(tree.depth, 1, fr).clamp(min=0)
        # ancestors-or-self of each frontier node within the tree region; the root is excluded
        # (its pair is the committed slot len)
        anc = ancestor_mask(tree, frontier)
        anc[:, :, 0] = False
        Lk = self.lmax + 1
        col = torch.arange(Lk, device=fr.device)[None, None, :]
        committed = (col >= 1) & (col <= self.lens[:, None, None])
        mask = torch.cat([committed.expand(bs, W, Lk), anc], dim=-1)
        idx = fr[:, None, :, None].expand(-1, self.tk.shape[1], -1, self.tk.shape[-1])
        dk, dv = self.dcache.k[0], self.dcache.v[0]

        def store(k, v):
            self.tk.scatter_(2, idx, k)
            self.tv.scatter_(2, idx, v)
            return torch.cat([dk[:, :, :Lk], self.tk], dim=2), torch.cat([dv[:, :, :Lk], self.tv], dim=2)

        if n_live is not None and n_live < bs * W:
            return self._ragged(tok, pfeat, pos, store, mask, frontier, n_live)
        out = self.m.draft(tok, pfeat, pos, store, mask)  # [bs, width, hidden]
        valid = (frontier >= 0)[:, :, None]
        cur_feat = torch.gather(self.feat, 1, fr[:, :, None].expand_as(out))
        self.feat.scatter_(1, fr[:, :, None].expand_as(out), torch.where(valid, out, cur_feat))
        return self.m.draft_logprobs(out)

    def _ragged(self, tok, pfeat, pos, store, mask, frontier, n_live: int) -> torch.Tensor:
        """The draft on the ``n_live`` live frontier entries only; their features go to their nodes and
        their log-probs to their grid rows (the others -inf: no children).

        Example: frontier [[3, -1], [-1, 5]] (bs 2, width 2), n_live 2 -> rows [0, 3] of the flat grid;
        feature slots b * C + node = [3, C + 5]."""
        bs, W = frontier.shape
        flat = frontier.reshape(-1)  # [bs * width]
        rows = kept_rows(frontier >= 0, n_live)  # [T]
        out = self.m.draft(tok, pfeat, pos, store, mask, rows=rows)  # [T, hidden]
        slot = torch.div(rows, W, rounding_mode="floor") * self.C + flat.index_select(0, rows)  # [T]
        self.feat.view(bs * self.C, -1).index_copy_(0, slot, out)
        return to_grid(self.m.draft_logprobs(out), rows, bs, W, fill=float("-inf"))  # [bs, width, vocab]


class EntropyRecorder:
    """Wraps an ``expand`` to remember, per working-tree node, the entropy (top-1000, C2T Eq. 7) of
    the distribution its children are drawn from. Used only when an observer is attached."""

    def __init__(self, expand, root_logprobs):
        from ..policies.classifier import entropy_topm

        self.expand, self.entropy_topm = expand, entropy_topm
        self.root = entropy_topm(root_logprobs.float())  # [bs]
        self.buf = None

    def __call__(self, tree, frontier):
        out = self.expand(tree, frontier)
        if self.buf is None:
            self.buf = torch.zeros(tree.tokens.shape, device=out.device)
            self.buf[:, 0] = self.root
        ent = self.entropy_topm(out.float())  # [bs, width]
        fr = frontier.clamp(min=0)
        self.buf.scatter_(1, fr, torch.where(frontier >= 0, ent, torch.gather(self.buf, 1, fr)))
        return out

    def parent_entropy(self, tree):
        """``[bs, n_nodes]`` entropy of each node's parent distribution. Valid when the final tree
        keeps the working tree's node order (EAGLE-2 with the full pool as budget, TALON, C2T, chain)."""
        if self.buf is None:
            buf = self.root[:, None].expand(tree.tokens.shape).clone()
        else:
            buf = self.buf[:, :tree.n_nodes]
        return torch.gather(buf, 1, tree.parents.clamp(min=0))
