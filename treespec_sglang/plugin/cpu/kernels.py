"""Torch stand-ins for the index / tree ``sgl_kernel`` CPU ops SGLang 0.5.23's EAGLE path calls.

Each function keeps the call site's argument order and names (SGLang passes some by keyword, e.g.
``retrive_index=``) and mutates the arguments the compiled op mutates. The semantics are those of
SGLang's own Triton reference kernels in the same call-site modules (``kernels/ops/speculative/
spec_tree.py`` ``sgl_build_tree_kernel_efficient_triton`` / ``verify_tree_greedy_kernel_triton``,
``cache_locs.py``, ``eagle.py``); the tests run those references under ``TRITON_INTERPRET=1``.

Each op first checks its arguments as the compiled op does (``sgl-kernel/csrc/cpu/spec.cpp``,
``kvcache.cpp``: ``CHECK_INPUT`` = a contiguous CPU tensor, dtypes, sizes) and, for the two tree ops, as
SGLang's JIT CUDA kernels do too (``kernels/jit/csrc/speculative/tree.cuh``: int64 tree tensors, int32
verify outputs, ``TensorMatcher`` strides): a stand-in looser than a real kernel hides the defects users
hit first. :mod:`.matcher` raises ``RuntimeError`` naming the op, the argument and the rule.

On the CPU device memory is host memory, so the ``.tolist()`` / boolean indexing here costs no
device sync; every op is vectorised over the batch (loops only over tree depth / sibling rank).
No sglang import.
"""

from __future__ import annotations

import ctypes

import torch

from .matcher import Device, Matcher, Size, check

__all__ = ["assign_req_to_token_pool_cpu", "assign_extend_cache_locs_cpu", "assign_draft_cache_locs_contiguous_cpu",
           "fill_bonus_tokens_cpu", "fill_accept_out_cache_loc_cpu", "copy_all_layer_kv_cache_cpu",
           "build_tree_kernel_efficient_cpu", "verify_tree_greedy_cpu", "build_draft_decode_metadata_cpu",
           "tree_parents"]


def _segments(start: torch.Tensor, end: torch.Tensor):
    """Flatten per-row ranges ``[start_b, end_b)`` into (row, column, out offset) triples.

    Example: start [2, 0], end [4, 3] -> rows [0, 0, 1, 1, 1], cols [2, 3, 0, 1, 2] (out slots 0..4).
    """
    lens = (end.long() - start.long()).clamp(min=0)  # [bs]
    rows = torch.repeat_interleave(torch.arange(lens.numel(), device=lens.device), lens)  # [total]
    first = torch.cumsum(lens, 0) - lens  # [bs] exclusive prefix sum
    cols = start.long()[rows] + torch.arange(rows.numel(), device=lens.device) - first[rows]
    return rows, cols


_INDEX = (torch.int32, torch.int64)  # AT_DISPATCH_INDEX_TYPES


def _inputs(op: str, **tensors) -> None:
    """``CHECK_INPUT`` on each: a contiguous tensor on the CPU."""
    for name, t in tensors.items():
        Matcher(op, [-1] * t.dim()).device(Device("cpu")).verify(t, name)


def _req_to_token(op: str, req_to_token, pool_len: int) -> None:
    """``CHECK_DIM(2, req_to_token)``, int32, ``pool_len`` columns."""
    Matcher(op, [-1, pool_len]).dtype(torch.int32).device(Device("cpu")).verify(req_to_token, "req_to_token")


def _rows(op: str, bs: int, dtypes=_INDEX, **tensors) -> None:
    """Each a ``[bs]``-element tensor of one of ``dtypes``."""
    for name, t in tensors.items():
        check(op, t.numel() == bs, f"{name} has {t.numel()} elements, expected {bs}")
        check(op, t.dtype in dtypes, f"{name} must be {' or '.join(str(d) for d in dtypes)}, got {t.dtype}")


def _segments_checked(op: str, req_pool_indices, req_to_token, start_offset, end_offset, out_cache_loc,
                      pool_len: int, need: str) -> None:
    """The checks shared by the two segment ops (``assign_req_to_token_pool_cpu``, ``assign_extend_cache_locs_cpu``)."""
    _inputs(op, req_pool_indices=req_pool_indices, req_to_token=req_to_token, start_offset=start_offset,
            end_offset=end_offset, out_cache_loc=out_cache_loc)
    _req_to_token(op, req_to_token, pool_len)
    check(op, out_cache_loc.dtype == torch.int64, f"out_cache_loc must be int64, got {out_cache_loc.dtype}")
    check(op, end_offset.dtype == start_offset.dtype, "start_offset and end_offset must have the same dtype")
    bs = req_pool_indices.numel()
    _rows(op, bs, req_pool_indices=req_pool_indices, start_offset=start_offset, end_offset=end_offset)
    total = int((end_offset.long() - start_offset.long()).clamp(min=0).sum())
    check(op, total <= out_cache_loc.numel(),
          f"out_cache_loc has {out_cache_loc.numel()} entries but offsets require {total} ({need})")


def assign_req_to_token_pool_cpu(req_pool_indices, req_to_token, start_offset, end_offset, out_cache_loc,
                                 pool_len: int) -> None:
    """``req_to_token[req_pool_indices[b], start_b:end_b] = out_cache_loc[packed segment b]``.

    req_pool_indices, start_offset, end_offset ``[bs]``; req_to_token ``[rows, pool_len]`` (mutated);
    out_cache_loc ``[sum(end - start)]`` slots packed request after request.
    """
    _segments_checked("assign_req_to_token_pool_cpu", req_pool_indices, req_to_token, start_offset, end_offset,
                      out_cache_loc, pool_len, "the slots to store")
    rows, cols = _segments(start_offset, end_offset)
    req_to_token[req_pool_indices.long()[rows], cols] = out_cache_loc[: rows.numel()].to(req_to_token.dtype)


def assign_extend_cache_locs_cpu(req_pool_indices, req_to_token, start_offset, end_offset, out_cache_loc,
                                 pool_len: int) -> None:
    """The gather twin: ``out_cache_loc[packed segment b] = req_to_token[req_pool_indices[b], start_b:end_b]``."""
    _segments_checked("assign_extend_cache_locs_cpu", req_pool_indices, req_to_token, start_offset, end_offset,
                      out_cache_loc, pool_len, "the slots to gather")
    rows, cols = _segments(start_offset, end_offset)
    out_cache_loc[: rows.numel()] = req_to_token[req_pool_indices.long()[rows], cols].to(out_cache_loc.dtype)


def assign_draft_cache_locs_contiguous_cpu(req_pool_indices, req_to_token, seq_lens, out_cache_loc, pool_len: int,
                                           topk: int, num_steps: int) -> None:
    """``out_cache_loc.view(bs, topk * num_steps)[b] = req_to_token[req_pool_indices[b], seq_len_b:][:topk*num_steps]``.

    The slots are laid out ``[bs, topk, num_steps]`` (branch k's step s at ``k * num_steps + s``).
    """
    op = "assign_draft_cache_locs_contiguous_cpu"
    _inputs(op, req_pool_indices=req_pool_indices, req_to_token=req_to_token, seq_lens=seq_lens,
            out_cache_loc=out_cache_loc)
    _req_to_token(op, req_to_token, pool_len)
    bs = req_pool_indices.numel()
    _rows(op, bs, req_pool_indices=req_pool_indices, seq_lens=seq_lens)
    check(op, out_cache_loc.dtype == torch.int64, f"out_cache_loc must be int64, got {out_cache_loc.dtype}")
    check(op, out_cache_loc.numel() == bs * topk * num_steps,
          f"out_cache_loc has {out_cache_loc.numel()} entries, expected bs * topk * num_steps = {bs * topk * num_steps}")
    width = topk * num_steps
    cols = seq_lens.long()[:, None] + torch.arange(width, device=seq_lens.device)  # [bs, width]
    vals = req_to_token[req_pool_indices.long()[:, None], cols]
    out_cache_loc[: vals.numel()] = vals.reshape(-1).to(out_cache_loc.dtype)


def fill_bonus_tokens_cpu(accept_tokens, accept_lens, bonus_tokens, accept_stride: int) -> None:
    """``bonus_tokens[b] = accept_tokens.flat[accept_stride * b + accept_lens[b] - 1]`` (the last accepted)."""
    op = "fill_bonus_tokens_cpu"
    _inputs(op, accept_tokens=accept_tokens, accept_lens=accept_lens, bonus_tokens=bonus_tokens)
    bs = accept_lens.shape[0]
    _rows(op, bs, (torch.int32,), accept_lens=accept_lens, bonus_tokens=bonus_tokens)
    check(op, accept_tokens.dtype == torch.int32, f"accept_tokens must be int32, got {accept_tokens.dtype}")
    check(op, accept_tokens.numel() == bs * accept_stride,
          f"accept_tokens has {accept_tokens.numel()} elements, expected bs * accept_stride = {bs * accept_stride}")
    lens = accept_lens.long()
    check(op, bs == 0 or bool(((lens >= 1) & (lens <= accept_stride)).all()),
          f"accept_lens must be in [1, accept_stride = {accept_stride}], got {lens.tolist()}")  # the op reads there
    idx = torch.arange(bs, device=accept_lens.device) * accept_stride + lens - 1
    bonus_tokens.copy_(accept_tokens.reshape(-1)[idx].to(bonus_tokens.dtype))


def fill_accept_out_cache_loc_cpu(accept_index, out_cache_loc, accept_out_cache_loc) -> None:
    """Pack ``out_cache_loc[accept_index]`` over the entries != -1, in order, into ``accept_out_cache_loc``.

    Example: accept_index [[0, 2, -1], [3, -1, -1]] -> out_cache_loc[[0, 2, 3]].
    """
    op = "fill_accept_out_cache_loc_cpu"
    _inputs(op, accept_index=accept_index, out_cache_loc=out_cache_loc, accept_out_cache_loc=accept_out_cache_loc)
    check(op, accept_index.dtype in _INDEX, f"accept_index must be int32 or int64, got {accept_index.dtype}")
    for name, t in (("out_cache_loc", out_cache_loc), ("accept_out_cache_loc", accept_out_cache_loc)):
        check(op, t.dtype == torch.int64, f"{name} must be int64, got {t.dtype}")
    check(op, accept_out_cache_loc.numel() >= accept_index.numel(),
          f"accept_out_cache_loc has {accept_out_cache_loc.numel()} entries, fewer than accept_index's "
          f"{accept_index.numel()}")
    flat = accept_index.reshape(-1).long()
    keep = flat >= 0
    check(op, not bool((flat[keep] >= out_cache_loc.numel()).any()), "accept_index out of range")
    vals = out_cache_loc[flat[keep]]
    accept_out_cache_loc[: vals.numel()] = vals.to(accept_out_cache_loc.dtype)


def copy_all_layer_kv_cache_cpu(data_ptrs, strides, tgt_loc, src_loc) -> None:
    """For every buffer i (raw address ``data_ptrs[i]``, slot size ``strides[i]`` bytes): slot tgt = slot src.

    SGLang hands over raw addresses (the Triton kernel does pointer arithmetic); we view each buffer's
    first ``max(loc) + 1`` slots as bytes. Sources are read before any target is written.
    """
    op = "copy_all_layer_kv_cache_cpu"
    _inputs(op, data_ptrs=data_ptrs, strides=strides, tgt_loc=tgt_loc, src_loc=src_loc)
    check(op, data_ptrs.dtype == torch.uint64, f"data_ptrs must be uint64, got {data_ptrs.dtype}")
    check(op, strides.dtype == torch.int64, f"strides must be int64, got {strides.dtype}")
    check(op, tgt_loc.dtype == src_loc.dtype and tgt_loc.dtype in _INDEX,
          f"tgt_loc and src_loc must share an int32 / int64 dtype, got {tgt_loc.dtype}, {src_loc.dtype}")
    check(op, strides.numel() == data_ptrs.numel(), "strides must have one entry per buffer")
    check(op, src_loc.numel() == tgt_loc.numel(), "src_loc and tgt_loc must have the same length")
    if tgt_loc.numel() == 0 or data_ptrs.numel() == 0:  # after the size checks, as kvcache.cpp
        return
    tgt, src = tgt_loc.long(), src_loc.long()
    n_slots = int(torch.maximum(tgt.max(), src.max())) + 1
    for ptr, stride in zip(data_ptrs.tolist(), strides.tolist()):
        raw = (ctypes.c_uint8 * (n_slots * stride)).from_address(ptr)
        rows = torch.frombuffer(raw, dtype=torch.uint8).view(n_slots, stride)
        rows[tgt] = rows[src]  # advanced indexing on the right copies first


# ----------------------------------------------------------------------------------------- trees
def tree_parents(parent_list, selected_index, topk: int):
    """Parents of SGLang's verify nodes, as ``build_tree_kernel_efficient`` resolves them.

    Node 0 is the bonus token; node i >= 1 is the draft ``selected_index[i - 1]`` (an index into the
    flattened beam scores). Its parent's beam slot is ``selected_index[i - 1] // topk``: slot 0 is the
    root, any other slot names the flat index ``parent_list[slot]``, found among ``selected_index``.

    Returns ``(parent, found)``: ``[bs, N]`` int64 parent node (-1 for the root and for a node whose
    parent was not selected) and ``[bs, N]`` bool (linked into the traversal).
    Example: topk 2, selected [0, 1, 2], parent_list [-1, 0, 1] -> parent [-1, 0, 0, 1].
    """
    bs, n1 = selected_index.shape
    dev = selected_index.device
    root = torch.full((bs, 1), -1, dtype=torch.int64, device=dev)
    if n1 == 0:  # a one-node tree: the root alone
        return root, torch.zeros_like(root, dtype=torch.bool)
    sel = selected_index.long()
    slot = sel // topk  # [bs, N-1]
    if parent_list.shape[1] == 0:  # one draft step: SGLang's table is empty, every slot is the root's (0)
        parent_list = root
    ptok = torch.gather(parent_list.long(), 1, slot)  # [bs, N-1]
    match = sel[:, None, :] == ptok[:, :, None]  # [bs, N-1 (child), N-1 (candidate)]
    pos = match.long().argmax(-1) + 1  # first match
    found = (slot == 0) | match.any(-1)
    par = torch.where(slot == 0, 0, torch.where(found, pos, -1))
    return torch.cat([root, par], 1), torch.cat([torch.zeros_like(root, dtype=torch.bool), found], 1)


def _links(parent: torch.Tensor, found: torch.Tensor):
    """First child (lowest index) and next sibling (next higher index) of every node, -1 = none."""
    bs, n = parent.shape
    ar = torch.arange(n, device=parent.device)
    child = found[:, None, :] & (parent[:, None, :] == ar[None, :, None])  # [bs, p, j]: j is a child of p
    first = torch.where(child, ar, n).min(-1).values
    sib = found[:, :, None] & found[:, None, :] & (parent[:, :, None] == parent[:, None, :]) & (ar[:, None] < ar[None, :])
    nxt = torch.where(sib, ar, n).min(-1).values
    return torch.where(first < n, first, -1), torch.where(nxt < n, nxt, -1)


def _packed_width(n: int) -> int:
    """Bytes per row of a bit-packed (QLEN_ONLY_BITPACKING) tree mask of ``n`` nodes: 1, 2 or 4."""
    return 4 if n > 16 else 2 if n > 8 else 1


def _check_build_tree(parent_list, selected_index, verified_seq_len, tree_mask, positions, retrive_index,
                      retrive_next_token, retrive_next_sibling, topk, depth, n, mode) -> None:
    """The entry checks of SGLang's tree kernel (``kernels/jit/csrc/speculative/tree.cuh``
    ``build_tree_kernel_efficient``), on the CPU device: int64 everywhere, ``selected_index`` ``[bs, N-1]``
    and ``parent_list`` ``[bs, 1 + (depth-1) topk]`` row-contiguous, the links ``[bs, N]`` and ``positions``
    ``[bs * N]`` contiguous, the mask large enough for its mode."""
    op = "build_tree_kernel_efficient_cpu"
    check(op, topk > 0 and depth > 0, f"topk and depth must be > 0, got {topk}, {depth}")
    check(op, 0 < n <= 1024, f"draft_token_num must be in [1, 1024], got {n}")
    check(op, 0 <= mode <= 2, f"tree_mask_mode must be 0 (FULL_MASK), 1 (QLEN_ONLY) or 2 (QLEN_ONLY_BITPACKING), "
                              f"got {mode}")
    bs, width, dev = Size("batch_size"), Size("parent_width"), Device("cpu")
    width_stride = parent_list.shape[1] if parent_list.dim() == 2 and parent_list.shape[1] > 0 else -1
    Matcher(op, [bs, width]).strides([width_stride, 1]).dtype(torch.int64).device(dev).verify(parent_list, "parent_list")
    check(op, depth == 1 or width.unwrap() == topk * (depth - 1) + 1,
          f"parent_list has {width.unwrap()} columns, expected topk * (depth - 1) + 1 = {topk * (depth - 1) + 1}")
    Matcher(op, [bs, n - 1]).strides([-1 if n == 1 else n - 1, 1]).dtype(torch.int64).device(dev) \
        .verify(selected_index, "selected_index")
    Matcher(op, [bs]).dtype(torch.int64).device(dev).verify(verified_seq_len, "verified_seq_len")
    Matcher(op, [bs, n]).dtype(torch.int64).device(dev).verify(retrive_index, "retrive_index") \
        .verify(retrive_next_token, "retrive_next_token").verify(retrive_next_sibling, "retrive_next_sibling")
    Matcher(op, [bs.unwrap() * n]).dtype(torch.int64).device(dev).verify(positions, "positions")
    # the kernels only add links, to chains the caller filled with -1 (eagle_utils does): a caller that skips the
    # fill gets garbage from them, so it gets a refusal here
    for name, t in (("retrive_next_token", retrive_next_token), ("retrive_next_sibling", retrive_next_sibling)):
        check(op, bool((t == -1).all()), f"{name} must come filled with -1 (the kernel only adds links)")
    Matcher(op, [-1]).device(dev).verify(tree_mask, "tree_mask")
    item = tree_mask.element_size()
    if mode == 2:  # the GPU kernel's bit-packed mode (the compiled CPU op refuses it; SGLang's CPU path never asks)
        check(op, n <= 32, f"QLEN_ONLY_BITPACKING needs draft_token_num <= 32, got {n}")
        need = bs.unwrap() * n * _packed_width(n)
        check(op, tree_mask.numel() * item >= need, f"tree_mask holds {tree_mask.numel() * item} bytes, needs >= {need}")
        return
    # the compiled CPU op: a bool mask of exactly its mode's size (QLEN_ONLY [bs, N, N], FULL_MASK per request
    # [N, seq_len + N])
    check(op, tree_mask.dtype == torch.bool, f"tree_mask must be bool, got {tree_mask.dtype}")
    need = bs.unwrap() * n * n if mode == 1 else (int(verified_seq_len.sum()) + bs.unwrap() * n) * n
    check(op, tree_mask.numel() == need, f"tree_mask has {tree_mask.numel()} entries, expected {need} for mode {mode}")


def _check_verify_greedy(op, predicts, accept_index, accept_token_num, candidates, retrive_index, retrive_next_token,
                         retrive_next_sibling, **per_node) -> tuple:
    """The entry checks of SGLang's greedy / sampling tree verify (``tree.cuh`` ``verify_tree_greedy``,
    ``sampling.cuh``): ``[bs, N]`` int64 tree tensors (``per_node``: more of them), int32 outputs, all
    contiguous on one device. Returns the bound ``(batch_size, draft_tokens)`` symbols."""
    bs, n, steps, dev = Size("batch_size"), Size("draft_tokens"), Size("spec_tokens"), Device("cpu")
    m = Matcher(op, [bs, n]).dtype(torch.int64).device(dev).verify(candidates, "candidates") \
        .verify(retrive_index, "retrive_index").verify(retrive_next_token, "retrive_next_token") \
        .verify(retrive_next_sibling, "retrive_next_sibling")
    for name, t in per_node.items():
        m.verify(t, name)
    Matcher(op, [bs, steps]).dtype(torch.int32).device(dev).verify(accept_index, "accept_index")
    Matcher(op, [bs]).dtype(torch.int32).device(dev).verify(accept_token_num, "accept_token_num")
    Matcher(op, [bs.unwrap() * n.unwrap()]).dtype(torch.int32).device(dev).verify(predicts, "predicts")
    check(op, n.unwrap() > 0 and steps.unwrap() > 0, "draft_tokens and spec_tokens must be > 0")
    return bs, n


def build_tree_kernel_efficient_cpu(parent_list, selected_index, verified_seq_len, tree_mask, positions,
                                    retrive_index, retrive_next_token, retrive_next_sibling, topk: int, depth: int,
                                    draft_token_num: int, tree_mask_mode: int) -> None:
    """SGLang's verify tree from the beam's selection (semantics of ``sgl_build_tree_kernel_efficient_triton``).

    parent_list ``[bs, slots]``, selected_index ``[bs, N-1]``, verified_seq_len ``[bs]``. Writes
    ``positions [bs*N]`` (seq_len + depth), ``retrive_* [bs, N]`` and the mask: mode 0 FULL_MASK, request
    b's ``[N, seq_len_b + N]`` block row-major (only its N tree columns are written), mode 1 QLEN_ONLY
    ``[bs, N, N]`` bool, mode 2 QLEN_ONLY_BITPACKING one integer per row, bit j = column j.
    Every row sees the root; a node whose parent was not selected hangs off the root for the mask
    and positions but is not linked into the traversal (as the kernel does).
    """
    _check_build_tree(parent_list, selected_index, verified_seq_len, tree_mask, positions, retrive_index,
                      retrive_next_token, retrive_next_sibling, topk, depth, draft_token_num, tree_mask_mode)
    bs, n = selected_index.shape[0], draft_token_num
    dev = selected_index.device
    parent, found = tree_parents(parent_list, selected_index, topk)
    ar = torch.arange(n, device=dev)
    # ancestors-or-self by pointer jumping over the mask parents (orphans hang off the root)
    up = torch.where(found | (ar == 0), parent, 0)
    up = torch.where(ar == 0, -1, up)  # [bs, N]
    anc = torch.zeros(bs, n, n, dtype=torch.bool, device=dev)
    anc[:, ar, ar] = True
    cur = up.clone()
    node_depth = torch.zeros(bs, n, dtype=torch.int64, device=dev)
    for _ in range(depth + 1):
        ok = cur >= 0
        anc |= torch.zeros_like(anc).scatter_(2, cur.clamp(min=0)[:, :, None], ok[:, :, None])
        node_depth += ok.long()
        cur = torch.where(ok, torch.gather(up, 1, cur.clamp(min=0)), -1)
    anc[:, :, 0] = True
    seq = verified_seq_len.long()
    positions[: bs * n] = (seq[:, None] + node_depth).reshape(-1).to(positions.dtype)
    first, nxt = _links(parent, found)
    retrive_index[:bs] = (torch.arange(bs, device=dev)[:, None] * n + ar).to(retrive_index.dtype)
    retrive_next_token[:bs] = first.to(retrive_next_token.dtype)
    retrive_next_sibling[:bs] = nxt.to(retrive_next_sibling.dtype)
    if tree_mask_mode == 0:
        # row x of request b starts at N*N*b + N*prefix_b + (seq_b + N)*x; tree columns after seq_b
        prefix = torch.cumsum(seq, 0) - seq
        start = n * n * torch.arange(bs, device=dev) + n * prefix  # [bs]
        idx = start[:, None, None] + (seq[:, None, None] + n) * ar[None, :, None] + seq[:, None, None] + ar
        tree_mask[idx.reshape(-1)] = anc.reshape(-1)
    elif tree_mask_mode == 1:
        tree_mask[: bs * n * n] = anc.reshape(-1)
    else:  # 2, QLEN_ONLY_BITPACKING (the mode was checked at entry): row r's bits, little-endian, in the mask's
        # bytes [r * width, (r + 1) * width), as the kernel writes them (SGLang allocates one uint8 / uint16 / uint32
        # per row; a byte buffer of the same size reads the same)
        width = _packed_width(n)
        bits = (anc.long() << ar).sum(-1).reshape(-1)  # [bs * N]
        raw = (bits[:, None] >> (8 * torch.arange(width, device=dev))) & 0xFF  # [bs * N, width]
        tree_mask.view(torch.uint8)[: bs * n * width] = raw.reshape(-1).to(torch.uint8)


def verify_tree_greedy_cpu(predicts, accept_index, accept_token_num, candidates, retrive_index, retrive_next_token,
                           retrive_next_sibling, target_predict) -> None:
    """Greedy tree verification (semantics of ``verify_tree_greedy_kernel_triton``).

    candidates, retrive_*, target_predict ``[bs, N]``; writes predicts ``[bs*N]`` (the target's token at
    every accepted node, the bonus at the last), accept_index ``[bs, S+1]`` (flat indices of the accepted
    path, root first; later entries untouched) and accept_token_num ``[bs]`` (accepted drafts).
    From the current node, the accepted child is the first in sibling order whose token equals the
    target's argmax there.
    """
    _check_verify_greedy("verify_tree_greedy_cpu", predicts, accept_index, accept_token_num, candidates, retrive_index,
                         retrive_next_token, retrive_next_sibling, target_predict=target_predict)
    bs, n = candidates.shape
    steps = accept_index.shape[1]
    dev = candidates.device
    rows = torch.arange(bs, device=dev)
    nt, ns = retrive_next_token.long(), retrive_next_sibling.long()
    # the target's token at node u is target_predict.flat[retrive_index[b, u]] (the Triton / CUDA kernels' lookup)
    cand, tgt = candidates.long(), target_predict.reshape(-1)[retrive_index.long()].long()  # [bs, N]
    # chosen[b, u]: u's first child (sibling order) carrying the target's token at u, -1 = none
    chosen = torch.full((bs, n), -1, dtype=torch.int64, device=dev)
    c = nt.clone()
    for _ in range(n):
        live = c >= 0
        hit = live & (chosen < 0) & (torch.gather(cand, 1, c.clamp(min=0)) == tgt)
        chosen = torch.where(hit, c, chosen)
        c = torch.where(live, torch.gather(ns, 1, c.clamp(min=0)), -1)
    ridx = retrive_index.long()
    cur = torch.zeros(bs, dtype=torch.int64, device=dev)
    accept_index[:, 0] = ridx[:, 0].to(accept_index.dtype)
    count = torch.zeros(bs, dtype=torch.int64, device=dev)
    active = torch.ones(bs, dtype=torch.bool, device=dev)
    flat_tgt = target_predict.reshape(-1)
    for j in range(1, steps):
        nxt = chosen[rows, cur]
        active = active & (nxt >= 0)
        # the target token at an accepted node is committed there before moving on
        at = ridx[rows, cur]
        predicts[at[active]] = flat_tgt[at[active]].to(predicts.dtype)
        cur = torch.where(active, nxt, cur)
        accept_index[active, j] = ridx[rows, cur][active].to(accept_index.dtype)
        count += active.long()
    accept_token_num.copy_(count.to(accept_token_num.dtype))
    last = ridx[rows, cur]
    predicts[last] = flat_tgt[last].to(predicts.dtype)


def build_draft_decode_metadata_cpu(req_to_token, req_pool_indices, seq_lens, topk: int, num_steps: int,
                                    pool_len: int) -> torch.Tensor:
    """``[bs * topk, pool_len]`` token table for the draft decode steps.

    Row ``b * topk + k`` is request b's prefix (``req_to_token[req_pool_indices[b], :seq_len_b]``) followed
    by branch k's draft slots (``seq_len_b + k * num_steps + s``, s < num_steps); the rest is 0.
    Example: seq_len 3, topk 2, num_steps 2, row slots [a b c | d e | f g]: branch 1 -> [a b c f g].
    """
    op = "build_draft_decode_metadata_cpu"
    _inputs(op, req_to_token=req_to_token, req_pool_indices=req_pool_indices, seq_lens=seq_lens)
    _req_to_token(op, req_to_token, pool_len)
    bs = req_pool_indices.shape[0]
    _rows(op, bs, req_pool_indices=req_pool_indices, seq_lens=seq_lens)
    dev = seq_lens.device
    seq = seq_lens.long()
    src_rows = req_to_token[req_pool_indices.long()]  # [bs, pool_len]
    col = torch.arange(pool_len, device=dev)
    k = torch.arange(topk, device=dev)
    # column c of branch k reads c itself in the prefix, seq + k * num_steps + (c - seq) in the draft part
    src_col = torch.where(col[None, None, :] < seq[:, None, None], col[None, None, :],
                          col[None, None, :] + k[None, :, None] * num_steps)  # [bs, topk, pool_len]
    valid = col[None, None, :] < (seq[:, None, None] + num_steps)
    out = torch.gather(src_rows[:, None, :].expand(bs, topk, pool_len), 2, src_col.clamp(max=pool_len - 1))
    return torch.where(valid, out, 0).reshape(bs * topk, pool_len).to(req_to_token.dtype)
