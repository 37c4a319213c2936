"""Torch stand-ins for ``sgl_kernel``'s CPU attention ops, as SGLang 0.5.23's ``intel_amx`` backend calls them.

* ``decode_attention_cpu``: one query token per row; stores the row's new K/V at ``loc`` first,
  then attends over ``req_to_token[req_pool_indices[b], :seq_lens[b]]`` (the new token included).
* ``extend_attention_cpu``: ``extend_seq_lens[b]`` query tokens per request; the prefix
  (``seq_lens - extend_seq_lens`` tokens) comes from the KV buffers through ``req_to_token``, the
  extend part from ``k_extend`` / ``v_extend``; the extend part is causal, or follows the ``[bs, L, L]``
  ``tree_mask`` (SGLang's QLEN_ONLY layout) when one is given, which the compiled kernel takes only
  when every request extends by ``L = max_len_extend`` tokens.

Entry checks are the compiled ops' (``sgl-kernel/csrc/cpu/decode.cpp`` / ``extend.cpp``): last-dimension
contiguous queries, keys and values, a contiguous ``o_extend``, int64 ``seq_lens`` / ``req_pool_indices`` /
``loc``, outputs, new keys and values of the query's dtype, KV buffers of one dtype, ``sinks`` one per head,
int32 or int64 ``req_to_token`` with extend lengths and starts of the same dtype, head sizes a multiple of
32, a contiguous bool tree mask of ``bs * L^2`` entries and uniform extend lengths with it. One rule is
left out: the compiled ops take bf16 / fp16 queries only, and the CPU test bed runs float32 so that its
greedy output can be compared with plain decoding token for token.

Both pad the batch to its longest row and run one ``scaled_dot_product_attention`` (grouped-query
heads broadcast, no per-token Python loops). ``logit_cap`` (tanh capping), sliding windows and
attention sinks are honoured; cross-attention is refused. No sglang import.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from .matcher import Device, Matcher, check

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


def _last_dim(op: str, **tensors) -> None:
    """``CHECK_LAST_DIM_CONTIGUOUS_INPUT`` + ``CHECK_DIM(3, x)``."""
    for name, t in tensors.items():
        check(op, t.device.type == "cpu", f"{name} must be a CPU tensor")
        check(op, t.dim() == 3, f"{name} must be a 3D tensor, got {t.dim()}D")
        check(op, t.stride(-1) == 1, f"{name} must be contiguous at last dimension")


def _indices(op: str, req_to_token, req_pool_indices, seq_lens, bs: int) -> None:
    check(op, req_to_token.dtype in (torch.int32, torch.int64),
          f"expect req_to_token to be int32 or int64, got {req_to_token.dtype}")
    check(op, seq_lens.dtype == torch.int64, f"expect req_lens to be int64, got {seq_lens.dtype}")
    check(op, req_pool_indices.dtype == torch.int64, f"expect req_pool_indices to be int64, got {req_pool_indices.dtype}")
    check(op, req_pool_indices.shape[0] == bs, f"req_pool_indices has {req_pool_indices.shape[0]} rows, expected {bs}")


def _check_decode(query, k_cache, v_cache, output, key, value, loc, attn_logits, req_to_token, req_pool_indices,
                  seq_lens, sinks=None) -> None:
    op = "decode_attention_cpu"
    _last_dim(op, query=query, k_buffer=k_cache, v_buffer=v_cache)
    bs, hq = query.shape[0], query.shape[1]
    if key is not None or value is not None:
        check(op, key is not None and value is not None, "key and value should have values at the same time")
        _last_dim(op, key=key, value=value)
        check(op, loc is not None and loc.dim() == 1 and loc.numel() == bs, f"loc must be a 1D tensor of {bs} slots")
    check(op, attn_logits.dim() == 4 and attn_logits.shape[0] == bs and attn_logits.shape[1] == hq
          and attn_logits.shape[3] == v_cache.shape[-1] + 1,
          f"attn_logits must be [{bs}, {hq}, splits, {v_cache.shape[-1] + 1}], got {tuple(attn_logits.shape)}")
    check(op, attn_logits.dtype == torch.float32, f"attn_logits must be float32, got {attn_logits.dtype}")
    _indices(op, req_to_token, req_pool_indices, seq_lens, bs)
    if loc is not None:
        check(op, loc.dtype == torch.int64, f"loc must be int64, got {loc.dtype}")
    _dtypes(op, query, k_cache, v_cache, sinks, output=output, key=key, value=value)


def _dtypes(op: str, query, k_buffer, v_buffer, sinks, **same) -> None:
    """The kernels read ``same`` (output, new keys and values) as the query's type, the KV buffers as one type (the
    query's, or float8 e4m3 with scales), ``sinks`` as one logit per query head."""
    for name, t in same.items():
        if t is not None:
            check(op, t.dtype == query.dtype, f"{name} must have the query's dtype {query.dtype}, got {t.dtype}")
    check(op, k_buffer.dtype == v_buffer.dtype and k_buffer.dtype in (query.dtype, torch.float8_e4m3fn),
          f"the KV buffers must share the query's dtype (or float8_e4m3fn), got {k_buffer.dtype}, {v_buffer.dtype}")
    if sinks is not None:
        check(op, sinks.dim() == 1 and sinks.shape[0] == query.shape[1],
              f"sinks must be 1D with one entry per query head ({query.shape[1]}), got {tuple(sinks.shape)}")


def _check_extend(q_extend, k_extend, v_extend, o_extend, k_buffer, v_buffer, req_to_token, req_pool_indices,
                  seq_lens, extend_seq_lens, extend_start_loc, max_len_extend, sliding_window_size,
                  tree_mask, sinks=None) -> None:
    op = "extend_attention_cpu"
    _last_dim(op, q_extend=q_extend, k_buffer=k_buffer, v_buffer=v_buffer)
    Matcher(op, [-1, -1, -1]).device(Device("cpu")).verify(o_extend, "o_extend")  # CHECK_INPUT: fully contiguous
    if k_extend is not None:
        _last_dim(op, k_extend=k_extend, v_extend=v_extend)
        check(op, v_extend.shape[1] == k_buffer.shape[1], "v_extend and k_buffer must have the same KV heads")
    bs = seq_lens.shape[0]
    _indices(op, req_to_token, req_pool_indices, seq_lens, bs)
    check(op, extend_seq_lens.shape[0] == bs and extend_start_loc.shape[0] == bs,
          f"extend_seq_lens and extend_start_loc must have {bs} rows")
    check(op, extend_seq_lens.dtype == req_to_token.dtype and extend_start_loc.dtype == req_to_token.dtype,
          "expect extend_seq_lens and extend_start_loc to have same dtype as req_to_token.")
    for name, size in (("head_size", q_extend.shape[-1]), ("head_size_v", v_buffer.shape[-1])):
        check(op, size % 32 == 0, f"invalid {name} {size}")
    _dtypes(op, q_extend, k_buffer, v_buffer, sinks, o_extend=o_extend, k_extend=k_extend, v_extend=v_extend)
    if tree_mask is not None:
        Matcher(op, [-1]).dtype(torch.bool).device(Device("cpu")).verify(tree_mask, "tree_mask")
        check(op, max_len_extend is not None, "max_len_extend must be given with a tree_mask")
        check(op, tree_mask.numel() == bs * max_len_extend * max_len_extend,
              f"expect tree_mask numel to be num_seqs * max_len_extend^2 = {bs * max_len_extend ** 2}, "
              f"got {tree_mask.numel()}")
        check(op, sliding_window_size <= 0, "tree_mask is not supported with sliding window attention")
        uniform = bool((extend_seq_lens == max_len_extend).all())
        check(op, uniform, f"tree_mask requires uniform extend_seq_lens, got {extend_seq_lens.tolist()} vs "
                           f"{max_len_extend}")


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
    _check_decode(query, k_cache, v_cache, output, key, value, loc, attn_logits, req_to_token, req_pool_indices,
                  seq_lens, sinks)
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
    k = k_cache[idx].transpose(1, 2).to(query.dtype)  # [bs, Hkv, L, D] (a float8 cache read in the query's type)
    v = v_cache[idx].transpose(1, 2).to(query.dtype)
    if k_scale != 1.0:
        k = k * k_scale
    if v_scale != 1.0:
        v = v * v_scale
    out = attend(query[:, :, None, :], k, v, mask, sm_scale, logit_cap, sinks)  # [bs, Hq, 1, Dv]
    output.copy_(out[:, :, 0])


def _extend_mask(pre: torch.Tensor, ext: torch.Tensor, Lp: int, Le: int, tree_mask, is_causal: bool,
                 window: int) -> torch.Tensor:
    """``[bs, Le, Lp + Le]`` visibility of the padded prefix + extend keys for the padded queries.

    Tree mask layout (QLEN_ONLY, the compiled kernel's): ``[bs, Le, Le]`` row-major, every request extending
    by ``Le`` tokens (checked at entry). Example: Le 3 -> row i column j of request 1 at 9 + 3 i + j.
    """
    dev = pre.device
    ap, ae = torch.arange(Lp, device=dev), torch.arange(Le, device=dev)
    qvalid = ae[None, :] < ext[:, None]  # [bs, Le]
    pmask = (ap[None, :] < pre[:, None])[:, None, :].expand(-1, Le, -1)  # [bs, Le, Lp]
    kvalid = qvalid[:, None, :] & qvalid[:, :, None]  # [bs, Le, Le]
    if tree_mask is not None:
        emask = kvalid & tree_mask.reshape(len(ext), Le, Le)
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
    _check_extend(q_extend, k_extend, v_extend, o_extend, k_buffer, v_buffer, req_to_token, req_pool_indices,
                  seq_lens, extend_seq_lens, extend_start_loc, max_len_extend, sliding_window_size, tree_mask, sinks)
    dev = q_extend.device
    ext, start, seq = extend_seq_lens.long(), extend_start_loc.long(), seq_lens.long()
    pre = seq - ext
    Le, Lp = int(ext.max()), int(pre.max())
    ae = torch.arange(Le, device=dev)
    qvalid = ae[None, :] < ext[:, None]  # [bs, Le]
    qi = (start[:, None] + ae[None, :]).clamp(max=q_extend.shape[0] - 1)  # [bs, Le] rows of q_extend
    rows = req_to_token[req_pool_indices.long()].long()  # [bs, pool_len]
    pslots = rows[:, :Lp]  # [bs, Lp]
    if k_extend is None:  # KV-shared layers: the extend part is already in the buffers
        eslots = torch.gather(rows, 1, (pre[:, None] + ae[None, :]).clamp(max=rows.shape[1] - 1))
        ke, ve = k_buffer[eslots], v_buffer[eslots]
    else:
        ke, ve = k_extend[qi], v_extend[qi]  # [bs, Le, Hkv, D]
    dt = q_extend.dtype  # a float8 cache is read in the query's type
    k = torch.cat([k_buffer[pslots].to(dt), ke.to(dt)], 1).transpose(1, 2)  # [bs, Hkv, Lp + Le, D]
    v = torch.cat([v_buffer[pslots].to(dt), ve.to(dt)], 1).transpose(1, 2)
    if k_scale != 1.0:
        k = k * k_scale
    if v_scale != 1.0:
        v = v * v_scale
    mask = _extend_mask(pre, ext, Lp, Le, tree_mask, is_causal, sliding_window_size)
    out = attend(q_extend[qi].transpose(1, 2), k, v, mask, sm_scale, logit_cap, sinks).transpose(1, 2)  # [bs, Le, Hq, Dv]
    o_extend[qi[qvalid]] = out[qvalid]
