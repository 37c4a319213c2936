"""Per-request contiguous KV cache with explicit write slots, compaction and row selection.

Request b's committed tokens occupy slots ``[0, len_b)``; a verify step writes tree node i at
slot ``len_b + i`` and masks by the tree, then :meth:`KVCache.compact` moves the accepted path's
entries down to ``len_b, len_b + 1, ...``. Slots past the committed length are never attended
(the mask stops at ``len_b``), so nothing of a rejected branch leaks into later steps.
"""

from __future__ import annotations

from typing import List

import torch

__all__ = ["KVCache", "prefill"]


class KVCache:
    """``k, v``: ``[layers, bs, kv_heads, max_len, head_dim]``."""

    def __init__(self, layers: int, bs: int, kv_heads: int, max_len: int, head_dim: int, dtype, device):
        shape = (layers, bs, kv_heads, max_len, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.max_len = max_len

    def stores(self, slots: torch.Tensor, kv_len: int) -> List:
        """One ``store(k, v)`` per layer: write ``[bs, kv_heads, q, head_dim]`` at ``slots``
        (``[bs, q]`` int64) and return the first ``kv_len`` slots as the attention keys."""
        hd = self.k.shape[-1]
        idx = slots[:, None, :, None].expand(-1, self.k.shape[2], -1, hd)  # [bs, kv_heads, q, head_dim]

        def make(layer):
            def store(k, v):
                self.k[layer].scatter_(2, idx, k.to(self.k.dtype))
                self.v[layer].scatter_(2, idx, v.to(self.v.dtype))
                return self.k[layer, :, :, :kv_len], self.v[layer, :, :, :kv_len]
            return store

        return [make(i) for i in range(self.k.shape[0])]

    def compact(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy slot ``src[b, j]`` to ``dst[b, j]`` in every layer (``[bs, m]`` int64).

        Example: len 10, accepted path nodes [0, 2, 5] -> src [10, 12, 15], dst [10, 11, 12].
        """
        L, bs, h, _, hd = self.k.shape
        gi = src[None, :, None, :, None].expand(L, bs, h, -1, hd)
        di = dst[None, :, None, :, None].expand(L, bs, h, -1, hd)
        for buf in (self.k, self.v):
            buf.scatter_(3, di, torch.gather(buf, 3, gi))

    def select(self, rows: torch.Tensor) -> None:
        """Keep only ``rows`` (``[bs']`` int64) of the batch."""
        self.k = self.k.index_select(1, rows)
        self.v = self.v.index_select(1, rows)


def prefill(model, ids: List[List[int]], max_len: int):
    """One batched causal forward of right-padded prompts into a fresh cache.

    Parameters
    ----------
    model : LlamaModel; ids : token-id lists; max_len : cache slots per request (>= longest prompt)

    Returns
    -------
    (cache, inp ``[bs, P]`` int64 padded ids, hidden ``[bs, P, hidden]`` final-norm states,
    lens ``[bs]`` int64). Padding columns hold garbage that no later step attends to.
    """
    param = next(model.parameters())
    dev, cfg = param.device, model.config
    bs, P = len(ids), max(len(x) for x in ids)
    inp = torch.zeros(bs, P, dtype=torch.long, device=dev)
    for b, x in enumerate(ids):
        inp[b, :len(x)] = torch.tensor(list(x), device=dev)
    lens = torch.tensor([len(x) for x in ids], device=dev)
    pos = torch.arange(P, device=dev).expand(bs, P)
    cache = KVCache(cfg.num_hidden_layers, bs, cfg.num_key_value_heads, max_len, cfg.head_dim, param.dtype, dev)
    mask = (pos[:, None, :] <= pos[:, :, None]) & (pos[:, None, :] < lens[:, None, None])
    hidden = model(inp, pos, cache.stores(pos, P), mask)  # [bs, P, hidden]
    return cache, inp, hidden, lens
