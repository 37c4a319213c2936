"""Torch stand-ins for ``sgl_kernel``'s CPU attention ops, as SGLang 0.5.23's ``intel_amx`` backend calls them.

* ``decode_attention_cpu``: one query token per row; stores the row's new K/V at ``loc`` first,
  then attends over ``req_to_token[req_pool_indices[b], :seq_lens[b]]`` (the new token included).
* ``extend_attention_cpu``: ``extend_seq_lens[b]`` query tokens per request; the prefix
  (``seq_lens - extend_seq_lens`` tokens) comes from the KV buffers through ``req_to_token``, the
  extend part from ``k_extend`` / ``v_extend``; the extend part is causal, or follows the per-request
  ``[ext, ext]`` ``tree_mask`` (SGLang's QLEN_ONLY layout, requests concatenated) when one is given.

Both pad the batch to its longest row and run one ``scaled_dot_product_attention`` (grouped-query
heads broadcast, no per-token Python loops). ``logit_cap`` (tanh capping), sliding windows and
attention sinks are honoured; cross-attention is refused. No sglang import.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

__all__ = ["decode_attention_cpu", "extend_attention_cpu", "attend"]


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float,
           logit_cap: float = 0.0, sinks: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Masked grouped-query attention.

    q ``[bs, Hq, Lq, D]``, k ``[bs, Hkv, Lk, D]``, v ``[bs, Hkv, Lk, Dv]``, mask ``[bs, Lq, Lk]`` bool
    (True = visible); ``Hq`` a multiple of ``Hkv``. ``sinks`` ``[Hq]``: one extra logit per head that
    only enters the softmax denominator. Returns ``[bs, Hq, Lq, Dv]`` in q's dtype.
    """
    if not logit_cap and sinks is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None], scale=scale,
                                              enable_gqa=q.shape[1] != k.shape[1])
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    s = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale  # [bs, Hq, Lq, Lk]
    if logit_cap and logit_cap > 0:
        s = logit_cap * torch.tanh(s / logit_cap)
    s = s.masked_fill(~mask[:, None], float("-inf"))
    if sinks is not None:
        sink = sinks.float()[None, :, None, None].expand(*s.shape[:3], 1)
        p = torch.softmax(torch.cat([s, sink], -1), -1)[..., :-1]
    else:
        p = torch.softmax(s, -1)
    return torch.matmul(p, v.float()).to(q.dtype)


def _check(is_cross_attn: bool) -> None:
    if is_cross_attn:
        raise NotImplementedError("treespec CPU attention stand-ins do not implement cross-attention")


def _window(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int) -> torch.Tensor:
    """``[..., Lq, Lk]`` bool: key within the sliding window (``window <= 0``: no window)."""
    if window <= 0:
        return torch.ones(1, dtype=torch.bool, device=q_pos.device)
    return (q_pos[..., :, None] - k_pos[..., None, :]) < window


def decode_attention_cpu(query, k_cache, v_cache, k_scale: float, v_scale: float, output, key, value, loc,
                         attn_logits, req_to_token, req_pool_indices, seq_lens, sm_scale: float, logit_cap: float,
                         is_cross_attn: bool, sliding_window_size: int, encoder_lens, sinks) -> None:
    """Decode attention; query ``[bs, Hq, D]``, caches ``[slots, Hkv, D]``, output ``[bs, Hq, Dv]`` (mutated)."""
    _check(is_cross_attn)
    bs, hq, d = query.shape
    if key is not None and value is not None:
        k_cache[loc.long()] = key.reshape(bs, -1, d).to(k_cache.dtype)
        v_cache[loc.long()] = value.reshape(bs, -1, v_cache.shape[-1]).to(v_cache.dtype)
    seq = seq_lens.long()
    L = int(seq.max())
    ar = torch.arange(L, device=seq.device)
    idx = req_to_token[req_pool_indices.long()][:, :L].long()  # [bs, L] cache slots
    visible = ar[None, :] < seq[:, None]  # [bs, L]
    mask = (visible[:, None, :] & _window((seq - 1)[:, None], ar[None, :], sliding_window_size))
    k = k_cache[idx].transpose(1, 2)  # [bs, Hkv, L, D]
    v = v_cache[idx].transpose(1, 2)
    if k_scale != 1.0:
        k = k * k_scale
    if v_scale != 1.0:
        v = v * v_scale
    q = query[:, :, None, :].to(k.dtype)  # [bs, Hq, 1, D]
    out = attend(q, k, v, mask, sm_scale, logit_cap, sinks)  # [bs, Hq, 1, Dv]
    output.copy_(out[:, :, 0].to(output.dtype))


def _extend_mask(pre: torch.Tensor, ext: torch.Tensor, Lp: int, Le: int, tree_mask, is_causal: bool,
                 window: int) -> torch.Tensor:
    """``[bs, Le, Lp + Le]`` visibility of the padded prefix + extend keys for the padded queries.

    Tree mask layout (QLEN_ONLY): request b's ``[ext_b, ext_b]`` block starts at ``sum_{c<b} ext_c^2``.
    Example: ext [2, 3] -> blocks at 0 and 4; row i column j of request 1 at 4 + 3 i + j.
    """
    dev = pre.device
    ap, ae = torch.arange(Lp, device=dev), torch.arange(Le, device=dev)
    qvalid = ae[None, :] < ext[:, None]  # [bs, Le]
    pmask = (ap[None, :] < pre[:, None])[:, None, :].expand(-1, Le, -1)  # [bs, Le, Lp]
    kvalid = qvalid[:, None, :] & qvalid[:, :, None]  # [bs, Le, Le]
    if tree_mask is not None:
        off = torch.cumsum(ext * ext, 0) - ext * ext  # [bs]
        flat = off[:, None, None] + ae[None, :, None] * ext[:, None, None] + ae[None, None, :]
        emask = kvalid & tree_mask.reshape(-1)[flat.clamp(max=tree_mask.numel() - 1)].bool()
    elif is_causal:
        emask = kvalid & (ae[None, :, None] >= ae[None, None, :])
    else:
        emask = kvalid
    mask = torch.cat([pmask, emask], -1)
    if window > 0:
        q_pos = pre[:, None] + ae[None, :]  # [bs, Le]
        k_pos = torch.cat([ap[None, :].expand(len(pre), -1), pre[:, None] + ae[None, :]], -1)  # [bs, Lp + Le]
        mask = mask & _window(q_pos, k_pos, window)
    return mask | ~qvalid[:, :, None]  # padded query rows see everything (discarded; avoids NaN)


def extend_attention_cpu(q_extend, k_extend, v_extend, o_extend, k_buffer, v_buffer, k_scale: float,
                         v_scale: float, req_to_token, req_pool_indices, seq_lens, extend_seq_lens, extend_start_loc,
                         max_len_extend, sm_scale: float, logit_cap: float, is_cross_attn: bool,
                         sliding_window_size: int, encoder_lens, sinks, tree_mask, is_causal: bool) -> None:
    """Extend (prefill / verify / draft-extend) attention; q_extend ``[T, Hq, D]``, o_extend ``[T, Hq, Dv]`` (mutated)."""
    _check(is_cross_attn)
    dev = q_extend.device
    ext, start, seq = extend_seq_lens.long(), extend_start_loc.long(), seq_lens.long()
    pre = seq - ext
    Le, Lp = int(ext.max()), int(pre.max())
    ae, ap = torch.arange(Le, device=dev), torch.arange(Lp, device=dev)
    qvalid = ae[None, :] < ext[:, None]  # [bs, Le]
    qi = (start[:, None] + ae[None, :]).clamp(max=q_extend.shape[0] - 1)  # [bs, Le] rows of q_extend
    rows = req_to_token[req_pool_indices.long()].long()  # [bs, pool_len]
    pslots = rows[:, :Lp] if Lp > 0 else rows[:, :0]  # [bs, Lp]
    if k_extend is None:  # KV-shared layers: the extend part is already in the buffers
        eslots = torch.gather(rows, 1, (pre[:, None] + ae[None, :]).clamp(max=rows.shape[1] - 1))
        ke, ve = k_buffer[eslots], v_buffer[eslots]
    else:
        ke, ve = k_extend[qi], v_extend[qi]  # [bs, Le, Hkv, D]
    k = torch.cat([k_buffer[pslots], ke.to(k_buffer.dtype)], 1).transpose(1, 2)  # [bs, Hkv, Lp + Le, D]
    v = torch.cat([v_buffer[pslots], ve.to(v_buffer.dtype)], 1).transpose(1, 2)
    if k_scale != 1.0:
        k = k * k_scale
    if v_scale != 1.0:
        v = v * v_scale
    mask = _extend_mask(pre, ext, Lp, Le, tree_mask, is_causal, sliding_window_size)
    q = q_extend[qi].transpose(1, 2).to(k.dtype)  # [bs, Hq, Le, D]
    out = attend(q, k, v, mask, sm_scale, logit_cap, sinks).transpose(1, 2)  # [bs, Le, Hq, Dv]
    o_extend[qi[qvalid]] = out[qvalid].to(o_extend.dtype)
