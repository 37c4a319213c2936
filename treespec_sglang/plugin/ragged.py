"""Ragged verify: the target's verify forward over each request's real tree nodes only (no sglang import;
the hook bodies receive SGLang's objects from :mod:`.hooks`).

SGLang verifies ``N`` tokens per request; a policy's smaller tree is padded to ``N`` with unlinked
filler nodes (:mod:`.pool`), which the target would otherwise still compute. :func:`plan_ragged`
compacts the verify batch to the kept nodes (``sum_b n_b`` tokens instead of ``bs * N``) and
restricts each request's ``[N, N]`` tree mask to them; :func:`scatter_rows` puts the forward's
per-token outputs back into SGLang's ``[bs * N]`` layout (filler rows zero: never read, since no
traversal link reaches them). The attention needs per-request extend lengths and masks, which the
plugin's hook on SGLang's CPU attention metadata supplies from the plan.

Compaction needs ``T = sum_b n_b`` on the host (the forward's shape depends on it): one size read
per verify round, inherent to a ragged batch.
"""

from __future__ import annotations

import contextvars
import os
from dataclasses import dataclass
from typing import Callable, Optional

import torch

__all__ = ["RaggedVerify", "plan_ragged", "scatter_rows", "ragged_verify_forward", "amx_extend_metadata",
           "ENV_RAGGED"]

ENV_RAGGED = "TREESPEC_RAGGED_VERIFY"
# The plan of the ragged verify forward in progress (SGLang may re-plan on a copy of the ForwardBatch).
_PLAN: contextvars.ContextVar = contextvars.ContextVar("treespec_ragged_plan", default=None)


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
    """

    rows: torch.Tensor
    lens: torch.Tensor
    starts: torch.Tensor
    tree_mask: Optional[torch.Tensor]
    n: int

    def __post_init__(self):
        if self.rows.dim() != 1 or self.lens.dim() != 1 or self.lens.shape != self.starts.shape:
            raise ValueError("rows must be [T]; lens and starts [bs]")

    @property
    def total(self) -> int:
        return self.rows.shape[0]


def plan_ragged(keep: torch.Tensor, tree_mask: Optional[torch.Tensor]) -> RaggedVerify:
    """Compact SGLang's verify batch to the kept nodes.

    Parameters
    ----------
    keep : ``[bs, N]`` bool, True for the nodes a policy selected (the root always).
    tree_mask : ``[bs * N * N]`` bool QLEN_ONLY mask (row = ancestors-or-self), or None (chain).

    Example: keep [[1, 1, 0, 1]] -> rows [0, 1, 3], lens [3]; mask rows/cols {0, 1, 3} of the [4, 4] block.
    """
    if keep.dim() != 2 or keep.dtype != torch.bool:
        raise ValueError(f"keep must be a [bs, N] bool tensor, got {keep.dtype} {tuple(keep.shape)}")
    bs, n = keep.shape
    dev = keep.device
    lens = keep.long().sum(-1)  # [bs]
    starts = torch.cumsum(lens, 0) - lens
    ar = torch.arange(n, device=dev)
    # kept local indices first, each group in index order: sort by (not kept) * N + index
    # e.g. keep [1, 1, 0, 1] -> keys [0, 1, 6, 3] -> sorted [0, 1, 3, 6] -> order [0, 1, 3, 2]
    order = torch.sort(torch.where(keep, ar, n + ar), dim=-1).values % n  # [bs, N]
    valid = ar[None, :] < lens[:, None]  # [bs, N] slot i holds a kept node
    rows = (torch.arange(bs, device=dev)[:, None] * n + order)[valid]  # [T]
    mask = None
    if tree_mask is not None:
        m = tree_mask.reshape(bs, n, n)
        sub = torch.gather(torch.gather(m, 1, order[:, :, None].expand(bs, n, n)), 2, order[:, None, :].expand(bs, n, n))
        pair = valid[:, :, None] & valid[:, None, :]  # [bs, N, N] (i, j) both real
        mask = sub[pair]  # request-major, row-major within a request: [sum n_b^2]
    return RaggedVerify(rows, lens, starts, mask, n)


def scatter_rows(x: torch.Tensor, plan: RaggedVerify, bs: int) -> torch.Tensor:
    """``[T, ...]`` compacted outputs -> ``[bs * N, ...]`` with zeros at the filler rows."""
    out = x.new_zeros((bs * plan.n,) + tuple(x.shape[1:]))
    out[plan.rows] = x
    return out


# ------------------------------------------------------------------------ hook bodies (plugin.hooks)
def ragged_enabled(model_runner) -> bool:
    """Ragged verify runs where SGLang's attention takes per-request extend lengths: the CPU backend."""
    if os.environ.get(ENV_RAGGED, "1").strip().lower() in ("0", "false", "no", "off"):
        return False
    return type(getattr(model_runner, "attn_backend", None)).__name__ == "IntelAMXAttnBackend"


def ragged_verify_forward(original, runner, forward_batch, keep: torch.Tensor, record: Callable, *args, **kwargs):
    """``ModelRunner.forward`` of a target verify over the kept nodes only (``keep`` ``[bs, N]``).

    The batch's ``input_ids`` / ``positions`` / ``out_cache_loc`` are compacted for the forward and
    restored after it; logits and hidden states come back in SGLang's ``[bs * N]`` rows. ``record``
    receives the tokens run per request (N each when the batch runs padded).
    """
    bs, n = keep.shape
    if not ragged_enabled(runner) or bool(keep.all()):  # CPU backend: the check reads host memory
        record([n] * bs)
        return original(runner, forward_batch, *args, **kwargs)
    spec = forward_batch.spec_info
    plan = plan_ragged(keep, spec.custom_mask.bool() if spec.tree_topk != 1 else None)
    full = {f: getattr(forward_batch, f) for f in ("input_ids", "positions", "out_cache_loc")}
    for f, v in full.items():
        setattr(forward_batch, f, v[plan.rows])
    token = _PLAN.set(plan)
    try:
        # SGLang planned this verify's attention metadata for bs * N tokens before the forward (and
        # marked it ready): plan again for the compacted batch (amx_extend_metadata reads the plan)
        runner.attn_backend.init_forward_metadata(forward_batch)
        out = original(runner, forward_batch, *args, **kwargs)
    finally:
        _PLAN.reset(token)
        for f, v in full.items():
            setattr(forward_batch, f, v)
    lo = out.logits_output
    lo.next_token_logits = scatter_rows(lo.next_token_logits, plan, bs)
    if getattr(lo, "hidden_states", None) is not None:
        lo.hidden_states = scatter_rows(lo.hidden_states, plan, bs)
    record(plan.lens.tolist())  # the forward's total was checked against the plan in amx_extend_metadata
    return out


def amx_extend_metadata(original, backend, forward_batch, *args, **kwargs):
    """``IntelAMXAttnBackend._build_extend_metadata`` for a ragged verify: (seq_lens after the extend,
    per-request extend lens, extend starts, compacted tree mask); SGLang's own otherwise."""
    plan = _PLAN.get()
    if plan is None or not forward_batch.forward_mode.is_target_verify():
        return original(backend, forward_batch, *args, **kwargs)
    if forward_batch.input_ids.shape[0] != plan.total:
        raise RuntimeError(f"ragged verify: {forward_batch.input_ids.shape[0]} tokens in the forward, "
                           f"{plan.total} planned")
    lens = plan.lens.to(forward_batch.seq_lens.device)
    return (forward_batch.seq_lens + lens, lens.to(torch.int32), plan.starts.to(torch.int32), plan.tree_mask)
