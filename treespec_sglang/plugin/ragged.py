"""Ragged verify: the target's verify forward over each request's real tree nodes only (no sglang import;
the hook bodies receive SGLang's objects from :mod:`.hooks`).

SGLang verifies ``N`` tokens per request; a policy's smaller tree is padded to ``N`` with unlinked
filler nodes (:mod:`.pool`), which the target would otherwise still compute. :func:`plan_ragged`
compacts the verify batch to the kept nodes (``sum_b n_b`` tokens instead of ``bs * N``) and
restricts each request's ``[N, N]`` tree mask to them; :func:`scatter_rows` puts the forward's
per-token outputs back into SGLang's ``[bs * N]`` layout (filler rows zero: never read, since no
traversal link reaches them). The attention needs per-request extend lengths and masks, which the
plugin's hook on SGLang's CPU attention metadata supplies from the plan. SGLang's compiled CPU extend kernel
takes a tree mask only when every request extends by the same length (``[bs, L, L]``), so a CPU tree verify
runs every request at the batch's widest kept tree (``plan_ragged(uniform=True)``); a CPU chain verify (no
mask, causal) and FlashInfer (per-request custom masks) run each request's own nodes.

Compaction needs ``T = sum_b n_b`` on the host (the forward's shape depends on it): one size read
per verify round, inherent to a ragged batch. With ``TREESPEC_RAGGED_VERIFY=tuned`` (and ``auto`` on the CPU,
:func:`.ragged_support.ragged_tuned`) each verify runs ragged or padded (SGLang's own, in its graph on a GPU) as
:mod:`.ragged_tuner` measured faster at the batch's size and width N.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Optional, Sequence, Tuple

import torch

from ..tree import kept_rows, to_grid
from ..utils.syncs import read_host
from .ragged_support import ragged_mode, ragged_tuned
from .ragged_tuner import bucket, tuner
from .ranks import digests_dir, perturbed_rank, record_digest, verify_group
from .round import current, opened

__all__ = ["RaggedVerify", "plan_ragged", "scatter_rows", "compact_paged_verify_args", "ragged_verify_forward",
           "ran_ragged", "amx_extend_metadata", "amx_forward_metadata", "flashinfer_verify_args", "eager_while_ragged"]


def _plan():
    """The round's ragged verify plan while its forward runs (SGLang may re-plan on a copy of the ForwardBatch)."""
    r = current()
    return None if r is None else r.plan


@dataclass(frozen=True)
class RaggedVerify:
    """The compacted verify batch.

    Attributes
    ----------
    rows : ``[T]`` int64 flat rows (``b * N + i``) of the kept nodes, request-major, index order.
    lens : ``[bs]`` int64 kept nodes per request (``n_b``, root included).
    starts : ``[bs]`` int64 first row of request b in the compacted batch.
    tree_mask : ``[sum_b n_b^2]`` bool, request b's ``[n_b, n_b]`` mask row-major (None: chain, causal).
    n : int, SGLang's ``N`` (the padded width).
    keep : ``[bs, N]`` bool kept nodes; mode : which attention path re-plans from this plan.
    width : int, every request's length in a uniform plan (None: each its own).
    host_lens : ``lens`` on the host (the plan's one host read), what the verify-token stats record.
    host_prefix : each request's committed prefix length ``P_b`` on the host (SGLang's ``seq_lens_cpu``, no
        device read), which sizes the FlashInfer compaction (None: read from SGLang's ``kv_indptr`` there).
    """

    rows: torch.Tensor
    lens: torch.Tensor
    starts: torch.Tensor
    tree_mask: Optional[torch.Tensor]
    n: int
    keep: Optional[torch.Tensor] = None  # [bs, N] bool, for the FlashInfer argument compaction
    mode: str = "cpu"  # "cpu" (intel_amx extend metadata) | "flashinfer" (paged verify arguments)
    width: Optional[int] = None  # every request's extend length when uniform (the CPU kernel's max_len_extend)
    host_lens: Optional[Tuple[int, ...]] = None
    host_prefix: Optional[Tuple[int, ...]] = None

    def __post_init__(self):
        if self.rows.dim() != 1 or self.lens.dim() != 1 or self.lens.shape != self.starts.shape:
            raise ValueError("rows must be [T]; lens and starts [bs]")

    @property
    def total(self) -> int:
        return self.rows.shape[0]


def plan_ragged(keep: torch.Tensor, tree_mask: Optional[torch.Tensor], mode: str = "cpu",
                uniform: bool = False, host_lens: Optional[Sequence[int]] = None,
                host_prefix: Optional[Sequence[int]] = None) -> RaggedVerify:
    """Compact SGLang's verify batch to the kept nodes.

    Parameters
    ----------
    keep : ``[bs, N]`` bool, True for the nodes a policy selected (the root always).
    tree_mask : ``[bs * N * N]`` bool QLEN_ONLY mask (row = ancestors-or-self), or None (chain).
    uniform : every request verifies ``L = max_b n_b`` nodes, its kept ones first and then fillers in index
        order (unlinked: their outputs are never read). SGLang's compiled CPU extend kernel takes a tree mask
        only over uniform extend lengths (``[bs, L, L]``), so the CPU verifies trees this way.
    host_lens : ``keep``'s kept nodes per request already read to the host (None: read here, the plan's one
        host read: the compacted batch's shape depends on them).
    host_prefix : ``[bs]`` committed prefix lengths on the host, kept for :func:`compact_paged_verify_args`.

    Example: keep [[1, 1, 0, 1]] -> rows [0, 1, 3], lens [3]; mask rows/cols {0, 1, 3} of the [4, 4] block.
    Uniform, keep [[1, 1, 0, 0], [1, 0, 0, 0]] -> L 2: rows [0, 1, 4, 5], lens [2, 2].
    """
    if keep.dim() != 2 or keep.dtype != torch.bool:
        raise ValueError(f"keep must be a [bs, N] bool tensor, got {keep.dtype} {tuple(keep.shape)}")
    bs, n = keep.shape
    dev = keep.device
    lens = keep.long().sum(-1)  # [bs]
    host = tuple(lens.tolist() if host_lens is None else host_lens)
    ar = torch.arange(n, device=dev)
    # kept local indices first, each group in index order: sort by (not kept) * N + index
    # e.g. keep [1, 1, 0, 1] -> keys [0, 1, 6, 3] -> sorted [0, 1, 3, 6] -> order [0, 1, 3, 2]
    order = torch.sort(torch.where(keep, ar, n + ar), dim=-1).values % n  # [bs, N]
    width = None
    if uniform:  # the batch's widest tree
        width = max(host)
        host = (width,) * bs
        lens = torch.full_like(lens, width)
        rows = (torch.arange(bs, device=dev)[:, None] * n + order[:, :width]).reshape(-1)  # [bs * L]
    else:
        rows = kept_rows(keep, sum(host))  # [T]
    starts = torch.cumsum(lens, 0) - lens
    valid = ar[None, :] < lens[:, None]  # [bs, N] slot i holds a verified node
    mask = None
    if tree_mask is not None:
        m = tree_mask.reshape(bs, n, n)
        sub = torch.gather(torch.gather(m, 1, order[:, :, None].expand(bs, n, n)), 2, order[:, None, :].expand(bs, n, n))
        if uniform:
            mask = sub[:, :width, :width].contiguous().view(-1)  # [bs * L * L] (a reshape may stay a strided view)
        else:
            pair = valid[:, :, None] & valid[:, None, :]  # [bs, N, N] (i, j) both real
            mask = sub[pair]  # request-major, row-major within a request: [sum n_b^2]
    return RaggedVerify(rows, lens, starts, mask, n, keep, mode, width, host,
                        None if host_prefix is None else tuple(host_prefix))


def scatter_rows(x: torch.Tensor, plan: RaggedVerify, bs: int) -> torch.Tensor:
    """``[T, ...]`` compacted outputs -> ``[bs * N, ...]`` with zeros at the filler rows."""
    return to_grid(x, plan.rows, bs, plan.n).flatten(0, 1)


def compact_paged_verify_args(kv_indices: torch.Tensor, kv_indptr: torch.Tensor, custom_mask: torch.Tensor,
                              keep: torch.Tensor, host_lens: Optional[Sequence[int]] = None,
                              host_prefix: Optional[Sequence[int]] = None):
    """SGLang's padded FlashInfer verify arguments -> the ragged ones over the kept nodes.

    Parameters
    ----------
    kv_indices : ``[>= sum_b (P_b + N)]`` int32 KV slots per request: its prefix, then its N draft nodes (a
        longer buffer's tail is ignored).
    kv_indptr : ``[bs + 1]`` int32 offsets into ``kv_indices`` (``P_b + N`` per request).
    custom_mask : ``[>= sum_b N * (P_b + N)]`` bool (or uint8) FULL_MASK, request b's ``[N, P_b + N]`` block
        row-major (SGLang may pad the tail for CUDA graphs; the tail is ignored). Its prefix columns are all True:
        SGLang's FlashInfer verify has no verify mask, its tree-mask kernel fills them True, and only the tree part
        is read here.
    keep : ``[bs, N]`` bool kept nodes (root included), closed under ancestors.
    host_lens : ``keep.sum(-1)`` on the host when the caller has it (the plan's), else read here.
    host_prefix : ``[bs]`` prefix lengths ``P_b`` on the host when the caller has them (SGLang's
        ``seq_lens_cpu``: ``kv_indptr`` is their cumulative sum plus ``N`` per request), else read from
        ``kv_indptr`` here.

    Returns
    -------
    kv_indices ``[sum_b (P_b + n_b)]``, kv_indptr ``[bs + 1]``, qo_indptr ``[bs + 1]`` (``cumsum n_b``) and
    custom_mask ``[sum_b n_b * (P_b + n_b)]``: request b's kept rows x (prefix + kept columns), row-major:
    the per-request ``[qo_len, kv_len]`` layout FlashInfer's ``plan(custom_mask=...)`` packs itself.

    Memory: the outputs, one bool and one int64 per padded KV slot, and ``[bs, N, N]`` index tensors for the
    tree blocks (nothing per mask element: a long prefix costs its mask bytes only). The outputs' sizes depend on
    the prefix lengths and ``keep``'s sizes: no host read with ``host_prefix`` and ``host_lens``, else a read of
    ``kv_indptr`` and of ``keep``'s sizes for each one missing.

    Example: P = [2], N = 3, keep [[1, 0, 1]] -> kv columns {0, 1, 2, 4} of [p0 p1 d0 d1 d2], mask rows {0, 2}.
    """
    bs, n = keep.shape
    dev = kv_indices.device
    keep = keep.to(dev)
    if host_prefix is None:
        ptr = kv_indptr.tolist()  # [bs + 1] host
        prefix_host = [ptr[b + 1] - ptr[b] - n for b in range(bs)]
    else:
        prefix_host = list(host_prefix)
        if len(prefix_host) != bs:
            raise ValueError(f"host_prefix has {len(prefix_host)} lengths for a batch of {bs}")
    n_kept = list(host_lens) if host_lens is not None else keep.sum(-1).tolist()  # [bs] host n_b
    padded_kv = sum(prefix_host) + bs * n  # sum_b (P_b + N): SGLang's kv_indptr[-1]
    total_kv = sum(p + k for p, k in zip(prefix_host, n_kept))
    total_mask = sum(k * (p + k) for p, k in zip(prefix_host, n_kept))
    start = kv_indptr[:-1].long()  # [bs] first padded KV slot of request b
    prefix = kv_indptr[1:].long() - start - n  # [bs] P_b
    lens = keep.long().sum(-1)  # [bs] n_b
    node = torch.arange(n, device=dev)  # [N]
    # KV slots: every prefix slot, the kept nodes' slots; the kept ones moved to their rank among the kept
    keep_slot = torch.ones(padded_kv, dtype=torch.bool, device=dev)  # [sum L_b]
    keep_slot[((start + prefix)[:, None] + node).reshape(-1)] = keep.reshape(-1)
    to = torch.where(keep_slot, keep_slot.long().cumsum(0) - 1, total_kv)  # [sum L_b] (dropped: a spare slot)
    out_kv = kv_indices.new_empty(total_kv + 1).scatter_(0, to, kv_indices[:padded_kv])[:total_kv]
    # mask: prefix columns True; request b's kept rows x kept columns of its tree block, kept nodes in index order
    order = torch.sort((~keep).to(torch.int8), dim=1, stable=True).indices  # [bs, N] kept nodes first
    r, j = node[None, :, None], node[None, None, :]  # [1, N, 1], [1, 1, N]
    new_len = prefix + lens  # [bs] P_b + n_b
    row_of = lambda b_: b_[:, None, None]  # noqa: E731  [bs] -> [bs, 1, 1]
    src = row_of(n * start + prefix) + order[:, :, None] * row_of(prefix + n) + order[:, None, :]  # [bs, N, N]
    first = torch.cumsum(lens * new_len, 0) - lens * new_len  # [bs] the request's first compacted mask element
    dst = row_of(first + prefix) + r * row_of(new_len) + j  # [bs, N, N]
    valid = (r < row_of(lens)) & (j < row_of(lens))  # [bs, N, N] both kept
    out_mask = torch.ones(total_mask + 1, dtype=torch.bool, device=dev)
    out_mask[torch.where(valid, dst, total_mask).reshape(-1)] = custom_mask[src.reshape(-1)].bool()
    zero = torch.zeros(1, dtype=torch.int32, device=dev)
    new_kv_indptr = torch.cat([zero, torch.cumsum(new_len, 0).to(torch.int32)])
    qo_indptr = torch.cat([zero, torch.cumsum(lens, 0).to(torch.int32)])
    return out_kv, new_kv_indptr, qo_indptr, out_mask[:total_mask]


# ------------------------------------------------------------------------ hook bodies (plugin.hooks)
def ran_ragged(verified: list, n: int) -> bool:
    """Whether a verify ran fewer than N tokens for some request (``verified``: :func:`ragged_verify_forward`'s
    tokens per request): a batch with nothing to compact ran SGLang's padded forward."""
    return any(v != n for v in verified)


def ragged_verify_forward(original, runner, forward_batch, keep: torch.Tensor, *args, **kwargs):
    """``ModelRunner.forward`` of a target verify over the kept nodes only (``keep`` ``[bs, N]``).

    Returns ``(SGLang's forward output, the tokens run per request)`` (N each when the batch runs padded).
    The batch's ``input_ids`` / ``positions`` / ``out_cache_loc`` are compacted for the forward and
    restored after it; logits and hidden states come back in SGLang's ``[bs * N]`` rows. While the forward
    runs, the plan is the round's (``round.plan``, :mod:`.round`), where the attention hooks read it. The forward
    runs eagerly (:func:`eager_while_ragged`: a CUDA graph was captured for ``bs * N`` tokens), and SGLang's eager
    runner plans a target verify's attention metadata from the live batch: on the CPU from the plan
    (:func:`amx_extend_metadata`), with FlashInfer from SGLang's padded arguments compacted
    (:func:`flashinfer_verify_args`).
    """
    bs, n = keep.shape
    mode = ragged_mode(runner)
    spec = forward_batch.spec_info
    if mode == "flashinfer" and getattr(spec, "custom_mask", None) is None:
        mode = None  # a chain verify without a custom mask: nothing to compact the mask from
    if mode is None:
        return original(runner, forward_batch, *args, **kwargs), [n] * bs
    if not ragged_tuned(mode):
        return _ragged_forward(mode, original, runner, forward_batch, keep, *args, **kwargs)
    group = verify_group()
    t = tuner(contrary=perturbed_rank(group))
    ragged = t.choose(bs, n, group)  # the same on every rank of the group
    if digests_dir():  # debug: this rank's own proposal for the batch's bucket and the path every rank runs
        record_digest([torch.tensor([t.proposal(t.buckets[bucket(bs, n)])])], [torch.tensor([ragged])], group,
                      "ragged-")
    with t.timed(bs, n, ragged, keep.device) as sample:
        if not ragged:
            return original(runner, forward_batch, *args, **kwargs), [n] * bs
        out, verified = _ragged_forward(mode, original, runner, forward_batch, keep, *args, **kwargs)
        # a batch with nothing to compact ran SGLang's padded forward after a host read: a sample of neither path
        sample.kept = ran_ragged(verified, n)
        return out, verified


def _ragged_forward(mode: str, original, runner, forward_batch, keep: torch.Tensor, *args, **kwargs):
    """:func:`ragged_verify_forward` once ragged: compact, forward, scatter (a batch with nothing to compact runs
    padded). The kept sizes are the one host read: the compacted batch's shape depends on them."""
    bs, n = keep.shape
    spec = forward_batch.spec_info
    host_lens = keep.sum(-1).tolist()  # [bs] on the host (a bool sum is int64)
    uniform = mode == "cpu" and spec.tree_topk != 1  # CPU trees: one width, the widest (the compiled kernel's rule)
    if (max(host_lens) if uniform else min(host_lens)) == n:  # nothing to compact
        return original(runner, forward_batch, *args, **kwargs), [n] * bs
    plan = plan_ragged(keep, spec.custom_mask.bool() if uniform else None, mode, uniform=uniform, host_lens=host_lens,
                       host_prefix=_host_prefix(forward_batch, bs) if mode == "flashinfer" else None)
    full = {f: getattr(forward_batch, f) for f in ("input_ids", "positions", "out_cache_loc")}
    for f, v in full.items():
        setattr(forward_batch, f, v[plan.rows])
    r = current()
    with (contextlib.nullcontext(r) if r is not None else opened()) as r:  # a round of its own when called alone
        r.plan = plan
        try:
            # SGLang planned this verify's attention metadata for bs * N tokens before the forward; its eager
            # runner plans a target verify again from the live batch every time (EagerRunner._execute_extend),
            # here the compacted one, with the plan in force for the hooks below (planning it here too ran every
            # FlashInfer compaction and plan twice)
            out = original(runner, forward_batch, *args, **kwargs)
        finally:
            r.plan = None
            for f, v in full.items():
                setattr(forward_batch, f, v)
    lo = out.logits_output
    lo.next_token_logits = scatter_rows(lo.next_token_logits, plan, bs)
    if getattr(lo, "hidden_states", None) is not None:
        lo.hidden_states = scatter_rows(lo.hidden_states, plan, bs)
    return out, list(plan.host_lens)  # the forward's total was checked against the plan in amx_extend_metadata


def _host_prefix(forward_batch, bs: int) -> Optional[Tuple[int, ...]]:
    """A target verify's committed prefix lengths ``P_b`` from SGLang's host copy ``seq_lens_cpu`` (``[>= bs]``,
    in host memory: no device read), or None when the batch carries none."""
    seq_cpu = getattr(forward_batch, "seq_lens_cpu", None)
    return None if seq_cpu is None else tuple(read_host(seq_cpu[:bs]))


def amx_extend_metadata(original, backend, forward_batch, *args, **kwargs):
    """``IntelAMXAttnBackend._build_extend_metadata`` for a ragged verify: (seq_lens after the extend,
    per-request extend lens, extend starts, compacted tree mask); SGLang's own otherwise."""
    plan = _plan()
    if plan is None or not forward_batch.forward_mode.is_target_verify():
        return original(backend, forward_batch, *args, **kwargs)
    if forward_batch.input_ids.shape[0] != plan.total:
        raise RuntimeError(f"ragged verify: {forward_batch.input_ids.shape[0]} tokens in the forward, "
                           f"{plan.total} planned")
    lens = plan.lens.to(forward_batch.seq_lens.device)
    return (forward_batch.seq_lens + lens, lens.to(torch.int32), plan.starts.to(torch.int32), plan.tree_mask)


def amx_forward_metadata(result, backend, forward_batch, *args, **kwargs):
    """``IntelAMXAttnBackend.init_forward_metadata`` AFTER: during a uniform CPU ragged verify the extend's
    ``max_extend_len`` is the plan's width (SGLang sets N, and the compiled kernel requires every request's
    extend length to equal it when a tree mask is given)."""
    plan = _plan()
    if plan is not None and plan.width is not None and forward_batch.forward_mode.is_target_verify():
        attn_logits, _ = backend.forward_metadata
        backend.forward_metadata = (attn_logits, plan.width)
    return result


def flashinfer_verify_args(original, spec_info, *args, **kwargs):
    """``EagleVerifyInput.generate_attn_arg_prefill`` during a FlashInfer ragged verify: SGLang's padded
    ``(kv_indices, kv_indptr, qo_indptr, custom_mask)`` compacted to the kept nodes."""
    out = original(spec_info, *args, **kwargs)
    plan = _plan()
    if plan is None or plan.mode != "flashinfer" or plan.keep is None:
        return out
    kv_indices, kv_indptr, _qo_indptr, custom_mask = out
    total = kwargs.get("paged_kernel_lens_sum")  # SGLang's host sum of the prefixes its kv_indptr was built from
    if plan.host_prefix is not None and total is not None and sum(plan.host_prefix) != total:
        raise RuntimeError(f"ragged verify: the batch's seq_lens_cpu sum to {sum(plan.host_prefix)}, SGLang's "
                           f"paged_kernel_lens_sum is {total}")
    return compact_paged_verify_args(kv_indices, kv_indptr, custom_mask, plan.keep, plan.host_lens, plan.host_prefix)


def eager_while_ragged(original, runner, forward_batch, *args, **kwargs):
    """``*CudaGraphRunner.can_run_graph``: False while a ragged verify runs (graphs hold ``bs * N`` tokens)."""
    if _plan() is not None:
        return False
    return original(runner, forward_batch, *args, **kwargs)
