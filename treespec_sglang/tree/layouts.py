"""Attention layouts of a :class:`DraftTree`: dense masks, positions, FlashInfer ragged custom masks
and SGLang's ``retrive_*`` arrays.

The dense mask is the oracle; every other layout is tested against it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .draft_tree import DraftTree

__all__ = ["ancestor_mask", "dense_mask", "positions", "prefix_tree_mask", "FlashInferLayout", "flashinfer_layout",
           "pack_segments_little", "flat_block_mask", "SGLangRetrive", "sglang_retrive", "SGLangVerifyArrays",
           "sglang_verify_arrays"]


def ancestor_mask(tree: DraftTree, nodes: torch.Tensor) -> torch.Tensor:
    """Ancestor-or-self sets of some query nodes.

    Parameters
    ----------
    tree : DraftTree
        ``[bs, n_nodes]``.
    nodes : torch.Tensor
        ``[bs, width]`` int64 query node indices, -1 = none.

    Returns
    -------
    torch.Tensor
        ``[bs, width, n_nodes]`` bool, row w True at ``nodes[w]`` and each of its ancestors (all
        False for -1). Pointer jumping, one level per iteration, ``depth_bound + 1`` iterations.

    Examples
    --------
    parents [-1, 0, 0, 1], nodes [[3, -1]] -> [[[1, 1, 0, 1], [0, 0, 0, 0]]]
    """
    n = tree.n_nodes
    mask = torch.zeros(*nodes.shape, n, dtype=torch.bool, device=nodes.device)
    cur = nodes.clone()
    for _ in range(tree.depth_bound + 1):
        mask |= torch.nn.functional.one_hot(cur.clamp(min=0), n).bool() & (cur >= 0)[..., None]
        cur = torch.where(cur >= 0, torch.gather(tree.parents, 1, cur.clamp(min=0)), -1)
    return mask


def dense_mask(tree: DraftTree) -> torch.Tensor:
    """Ancestor-or-self mask of every tree.

    Parameters
    ----------
    tree : DraftTree
        ``[bs, n_nodes]``.

    Returns
    -------
    torch.Tensor
        ``[bs, n_nodes, n_nodes]`` bool; row = query node, True = may attend (itself and its
        ancestors). A padding row (parent -1) attends to itself only, so softmax stays finite.

    Examples
    --------
    parents [-1, 0, 0, 1] ->
    [[1,0,0,0],
     [1,1,0,0],
     [1,0,1,0],
     [1,1,0,1]]
    """
    ar = torch.arange(tree.n_nodes, device=tree.device)
    return ancestor_mask(tree, ar.expand(tree.bs, -1))


def positions(tree: DraftTree, prefix_lens: torch.Tensor) -> torch.Tensor:
    """Position ids: ``prefix_len + depth`` (``[bs]`` int64 -> ``[bs, n_nodes]`` int64).

    The root (the last committed token) sits at position ``prefix_len`` where ``prefix_len``
    counts the committed tokens before it. Padding gets ``prefix_len``.
    """
    return prefix_lens[:, None].long() + tree.depth.clamp(min=0)


def prefix_tree_mask(tree: DraftTree, prefix_lens: torch.Tensor, max_prefix: int) -> torch.Tensor:
    """Mask for keys laid out as ``[prefix (padded to max_prefix) | tree nodes]``.

    Returns ``[bs, n_nodes, max_prefix + n_nodes]`` bool: prefix column j is True iff
    ``j < prefix_lens[b]``; the tree block is :func:`dense_mask`.
    """
    ar = torch.arange(max_prefix, device=tree.device)
    pre = (ar[None, :] < prefix_lens[:, None])[:, None, :].expand(tree.bs, tree.n_nodes, max_prefix)
    return torch.cat([pre, dense_mask(tree)], dim=-1)


@dataclass(frozen=True)
class FlashInferLayout:
    """Ragged custom-mask layout for FlashInfer batch prefill (requests of different tree sizes).

    Attributes
    ----------
    qo_indptr : ``[bs + 1]`` int32, cumsum of tree sizes.
    kv_indptr : ``[bs + 1]`` int32, cumsum of ``prefix_len + tree_size``.
    custom_mask : ``[sum qo_i * kv_i]`` bool, request i's ``[qo_i, kv_i]`` block row-major.
    mask_indptr : ``[bs + 1]`` int32, cumsum of ``qo_i * kv_i``.
    packed_mask : ``[sum ceil(qo_i * kv_i / 8)]`` uint8, little bit order, each segment byte-padded.
    packed_indptr : ``[bs + 1]`` int32, cumsum of ``ceil(qo_i * kv_i / 8)``.
    """

    qo_indptr: torch.Tensor
    kv_indptr: torch.Tensor
    custom_mask: torch.Tensor
    mask_indptr: torch.Tensor
    packed_mask: torch.Tensor
    packed_indptr: torch.Tensor


def _indptr(lens: torch.Tensor) -> torch.Tensor:
    return torch.cat([lens.new_zeros(1), lens.cumsum(0)])


def pack_segments_little(bits: torch.Tensor, indptr: torch.Tensor, total_bytes: int):
    """Pack each segment of a flat bool tensor into bytes, little bit order, byte-padded.

    Parameters
    ----------
    bits : ``[L]`` bool; indptr : ``[bs + 1]`` int64 segment bounds; total_bytes : host int.

    Returns
    -------
    (packed ``[total_bytes]`` uint8, packed_indptr ``[bs + 1]`` int64)

    Examples
    --------
    segments [1,0,1] and [1,1,1,1,1,1,1,1,1] -> bytes [0b101=5] and [255, 1].
    """
    seg_len = indptr[1:] - indptr[:-1]
    packed_indptr = _indptr((seg_len + 7) // 8)
    byte = torch.arange(total_bytes, device=bits.device)
    seg = torch.searchsorted(packed_indptr[1:], byte, right=True)  # segment of each byte
    local = (byte - packed_indptr[seg])[:, None] * 8 + torch.arange(8, device=bits.device)  # [bytes, 8]
    ok = local < seg_len[seg][:, None]
    src = (indptr[seg][:, None] + local).clamp(max=max(bits.numel() - 1, 0))
    vals = bits[src] & ok if bits.numel() else ok
    weights = (1 << torch.arange(8, device=bits.device))
    packed = (vals.long() * weights).sum(-1).to(torch.uint8)
    return packed, packed_indptr


def flat_block_mask(dense: torch.Tensor, qo: torch.Tensor, prefix_lens: torch.Tensor):
    """Concatenate per-request ``[qo_b, prefix_b + qo_b]`` attention blocks, row-major.

    Parameters
    ----------
    dense : ``[bs, n_nodes, n_nodes]`` bool tree mask; qo : ``[bs]`` int64 query rows per request
    (<= n_nodes); prefix_lens : ``[bs]`` int64 (prefix columns are all True).

    Returns
    -------
    (mask ``[sum qo_b (prefix_b + qo_b)]`` bool, indptr ``[bs + 1]`` int64). One host sync: the total.

    Examples
    --------
    qo [2], prefix [1], dense [[1,0],[1,1]] -> [1,1,0, 1,1,1], indptr [0, 6].
    """
    dev = dense.device
    pre_all = prefix_lens.long()
    kv = pre_all + qo
    indptr = _indptr(qo * kv)
    total = int(indptr[-1])  # the one host sync (layout sizes)
    t = torch.arange(total, device=dev)
    req = torch.searchsorted(indptr[1:], t, right=True)  # request of each flat entry
    local = t - indptr[req]
    kv_r = kv[req]
    row, col = local // kv_r, local % kv_r
    pre = pre_all[req]
    in_tree = dense[req, row, (col - pre).clamp(min=0, max=dense.shape[-1] - 1)]
    return (col < pre) | in_tree, indptr


def flashinfer_layout(tree: DraftTree, prefix_lens: torch.Tensor) -> FlashInferLayout:
    """Build FlashInfer's ragged custom-mask layout for heterogeneous trees.

    Parameters
    ----------
    tree : DraftTree
        ``[bs, n_nodes]``; request i contributes ``qo_i = size_i`` query rows.
    prefix_lens : torch.Tensor
        ``[bs]`` int64 committed tokens before the root.

    Returns
    -------
    FlashInferLayout

    Notes
    -----
    This runs once per step in ``plan()`` (FlashInfer's planner is host-side anyway) and does one
    host sync to learn the flat lengths. Pass ``custom_mask`` (not ``packed_custom_mask``) to
    FlashInfer for multi-request batches (flashinfer PR #2201).

    Examples
    --------
    Two requests, sizes [2, 1], prefixes [1, 0]: qo_indptr [0, 2, 3], kv_indptr [0, 3, 4],
    request 0 block [[1,1,0],[1,1,1]] (prefix column, root, child), request 1 block [[1]].
    """
    qo = tree.size
    kv = prefix_lens.long() + tree.size
    custom, mask_indptr = flat_block_mask(dense_mask(tree), qo, prefix_lens)
    total_bytes = int(((qo * kv + 7) // 8).sum())
    packed, packed_indptr = pack_segments_little(custom, mask_indptr, total_bytes)
    i32 = torch.int32
    return FlashInferLayout(_indptr(qo).to(i32), _indptr(kv).to(i32), custom, mask_indptr.to(i32),
                            packed, packed_indptr.to(i32))


@dataclass(frozen=True)
class SGLangRetrive:
    """SGLang's verify traversal arrays (``eagle_utils.build_tree_kernel_efficient`` outputs).

    Attributes
    ----------
    retrive_index : ``[bs, n_nodes]`` int64 flat index of each node into the batch's draft tokens
        (``b * n_nodes + i``, or ``qo_indptr[b] + i`` when ragged), -1 for padding.
    retrive_next_token : ``[bs, n_nodes]`` int64 first child (lowest index), -1 = leaf.
    retrive_next_sibling : ``[bs, n_nodes]`` int64 next sibling in index order, -1 = none.
    """

    retrive_index: torch.Tensor
    retrive_next_token: torch.Tensor
    retrive_next_sibling: torch.Tensor


def sglang_retrive(tree: DraftTree, ragged: bool = False) -> SGLangRetrive:
    """Build SGLang's ``retrive_*`` arrays for a batch of trees.

    The kernel walks nodes from last to first and pushes each as its parent's first child,
    so ``next_token[p]`` is p's lowest-index child and siblings chain in increasing index order.

    Examples
    --------
    parents [-1, 0, 0, 1] -> next_token [1, 3, -1, -1], next_sibling [-1, 2, -1, -1].
    """
    bs, n = tree.tokens.shape
    dev = tree.device
    ar = torch.arange(n, device=dev)
    valid = tree.valid
    inner = valid & (ar[None, :] > 0)
    par = tree.parents
    # same_parent[b, i, j]: j is a later sibling of i (j > i, same parent)
    sib = inner[:, :, None] & inner[:, None, :] & (par[:, :, None] == par[:, None, :]) \
        & (ar[None, :, None] < ar[None, None, :])
    big = torch.full_like(par, n)
    next_sib = torch.where(sib, ar[None, None, :], n).min(-1).values
    next_sib = torch.where(next_sib < n, next_sib, -1)
    # is_child[b, p, j]: j is a child of p
    is_child = inner[:, None, :] & (par[:, None, :] == ar[None, :, None])
    first = torch.where(is_child, ar[None, None, :], big[:, :, None]).min(-1).values
    first = torch.where(valid & (first < n), first, -1)
    if ragged:
        offset = _indptr(tree.size)[:-1]
    else:
        offset = torch.arange(bs, device=dev) * n
    index = torch.where(valid, offset[:, None] + ar[None, :], -1)
    return SGLangRetrive(index, first, next_sib)


@dataclass(frozen=True)
class SGLangVerifyArrays:
    """What SGLang 0.5.23's ``build_tree_kernel_efficient`` returns (FULL_MASK mode), for our trees.

    Attributes
    ----------
    tree_mask : ``[sum_b N * (seq_len_b + N)]`` bool, request b's ``[N, seq_len_b + N]`` block row-major.
    positions : ``[bs * N]`` int64, ``seq_len + depth``.
    retrive_index, retrive_next_token, retrive_next_sibling : ``[bs, N]`` int64.
    draft_tokens : ``[bs * N]`` int64 (node 0 = the bonus/root token).
    """

    tree_mask: torch.Tensor
    positions: torch.Tensor
    retrive_index: torch.Tensor
    retrive_next_token: torch.Tensor
    retrive_next_sibling: torch.Tensor
    draft_tokens: torch.Tensor


def sglang_verify_arrays(tree: DraftTree, seq_lens: torch.Tensor) -> SGLangVerifyArrays:
    """SGLang's verify input for a batch of trees padded to ``N = tree.n_nodes``.

    Every request keeps SGLang's fixed shape of N verify tokens. Nodes past a request's ``size``
    are unlinked: no ``retrive_next_token`` / ``retrive_next_sibling`` chain reaches them, so
    verification never accepts them; they attend to the prefix, the root and themselves and
    carry token 0. For full trees (size = N) the result equals the CUDA kernel's output.

    Examples
    --------
    parents [-1, 0, 0, 1], seq_len 2 -> positions [2, 3, 3, 4]; row 3 of the mask is
    [1, 1 | 1, 1, 0, 1] (prefix | root, node 1, node 2, itself).
    """
    bs, n = tree.tokens.shape
    dev = tree.device
    dense = dense_mask(tree)  # [bs, N, N]; padding rows: self only
    dense[:, :, 0] = True  # every row sees the root (the kernel sets it for all N rows)
    seq = seq_lens.long()
    mask, _ = flat_block_mask(dense, torch.full_like(seq, n), seq)  # all N rows per request
    r = sglang_retrive(tree)
    ar = torch.arange(n, device=dev)
    index = torch.arange(bs, device=dev)[:, None] * n + ar[None, :]  # all N slots are real verify rows
    pos = (seq[:, None] + tree.depth.clamp(min=0)).reshape(-1)
    return SGLangVerifyArrays(mask, pos, index, r.retrive_next_token, r.retrive_next_sibling,
                              tree.tokens.clamp(min=0).reshape(-1))
