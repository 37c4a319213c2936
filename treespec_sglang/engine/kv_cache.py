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
        (``[bs, q]`` int64) and return the first ``kv_len`` slots as the attention keys.

        The write is one ``index_put_`` with index tensors built once per forward (``scatter_`` on a
        bf16 CPU tensor copies the whole buffer; per-layer Python indexing costs ~30 small ops).
        """
        bs, q = slots.shape
        h = self.k.shape[2]
        dev = slots.device
        b = torch.arange(bs, device=dev)[:, None, None]  # [bs, 1, 1]
        hh = torch.arange(h, device=dev)[None, :, None]  # [1, kv_heads, 1]
        idx = (b, hh, slots[:, None, :])  # broadcast to [bs, kv_heads, q]

        def make(layer):
            kl, vl = self.k[layer], self.v[layer]

            def store(k, v):
                kl.index_put_(idx, k.to(kl.dtype))
                vl.index_put_(idx, v.to(vl.dtype))
                return kl[:, :, :kv_len], vl[:, :, :kv_len]
            return store

        return [make(i) for i in range(self.k.shape[0])]

    def compact(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy slot ``src[b, j]`` to ``dst[b, j]`` in every layer (``[bs, m]`` int64).

        Example: len 10, accepted path nodes [0, 2, 5] -> src [10, 12, 15], dst [10, 11, 12].
        The reads happen before the writes (one gather, one ``index_put_`` per buffer), so
        overlapping source and destination slots are safe.
        """
        L, bs, h, _, _ = self.k.shape
        dev = src.device
        li = torch.arange(L, device=dev)[:, None, None, None]  # [L, 1, 1, 1]
        bi = torch.arange(bs, device=dev)[None, :, None, None]  # [1, bs, 1, 1]
        hi = torch.arange(h, device=dev)[None, None, :, None]  # [1, 1, kv_heads, 1]
        for buf in (self.k, self.v):
            moved = buf[li, bi, hi, src[None, :, None, :]]  # [L, bs, kv_heads, m, head_dim]
            buf.index_put_((li, bi, hi, dst[None, :, None, :]), moved)

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
