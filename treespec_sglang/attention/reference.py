"""Plain-torch tree attention: the oracle every fast backend is checked against."""

from __future__ import annotations

import math
from typing import Optional

import torch

from ..tree import DraftTree, flashinfer_layout
from .base import TreeAttentionBackend, register_backend

__all__ = ["tree_attention", "TorchTreeAttention"]


def tree_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                   scale: Optional[float] = None) -> torch.Tensor:
    """Masked softmax attention.

    Parameters
    ----------
    q : ``[bs, heads, n_q, head_dim]``
    k, v : ``[bs, kv_heads, n_kv, head_dim]`` (``heads`` a multiple of ``kv_heads``: GQA)
    mask : ``[bs, n_q, n_kv]`` bool, True = may attend (e.g. :func:`prefix_tree_mask`)
    scale : float, default ``1/sqrt(head_dim)``

    Returns
    -------
    ``[bs, heads, n_q, head_dim]`` in float32.

    Examples
    --------
    With a causal mask this is ordinary causal attention; with ``prefix_tree_mask`` each node
    sees the prefix, its ancestors and itself.
    """
    g = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(g, dim=1, output_size=q.shape[1])
    v = v.repeat_interleave(g, dim=1, output_size=q.shape[1])
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    s = torch.einsum("bhqd,bhkd->bhqk", q.float(), k.float()) * scale
    s = s.masked_fill(~mask[:, None], float("-inf"))
    return torch.einsum("bhqk,bhkd->bhqd", torch.softmax(s, dim=-1), v.float())


@register_backend
class TorchTreeAttention(TreeAttentionBackend):
    """Ragged-batch reference: each request's ``[qo_i, kv_i]`` block of the FlashInfer layout,
    attended one request at a time with :func:`tree_attention` (an oracle, not a fast path)."""

    name = "torch"

    def plan(self, tree: DraftTree, prefix_lens: torch.Tensor, num_qo_heads: int, num_kv_heads: int,
             head_dim: int) -> None:
        self.layout = flashinfer_layout(tree, prefix_lens)
        self.qo = self.layout.qo_indptr.tolist()
        self.kv = self.layout.kv_indptr.tolist()
        self.mi = self.layout.mask_indptr.tolist()

    def run(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
        for i in range(len(self.qo) - 1):
            q0, q1, k0, k1 = self.qo[i], self.qo[i + 1], self.kv[i], self.kv[i + 1]
            m = self.layout.custom_mask[self.mi[i]:self.mi[i + 1]].view(q1 - q0, k1 - k0)
            o = tree_attention(q[q0:q1].transpose(0, 1)[None], k[k0:k1].transpose(0, 1)[None],
                               v[k0:k1].transpose(0, 1)[None], m[None])
            out[q0:q1] = o[0].transpose(0, 1)
        return out
