"""FlashInfer tree attention over heterogeneous trees (ragged qo_indptr + flat custom mask).

Imported lazily: ``flashinfer`` (``flashinfer-python``) is only needed on a GPU. Checked
against :class:`~treespec_sglang.attention.reference.TorchTreeAttention` in ``tests/attention``
(``gpu`` marker).
"""

from __future__ import annotations

import torch

from ..tree import DraftTree, flashinfer_layout
from .base import TreeAttentionBackend, register_backend

try:
    import flashinfer
except ImportError as e:  # pragma: no cover - depends on the machine
    raise ImportError("the 'flashinfer' attention backend needs flashinfer-python on a CUDA machine "
                      "(pip install flashinfer-python==0.7.2.post1); use backend 'torch' on CPU") from e

__all__ = ["FlashInferTreeAttention"]

WORKSPACE_BYTES = 128 * 1024 * 1024


@register_backend
class FlashInferTreeAttention(TreeAttentionBackend):
    """``BatchPrefillWithRaggedKVCacheWrapper`` (or the paged wrapper with page size 1) with the
    per-request ``[qo_i, kv_i]`` row-major custom mask. ``paged=True`` expects ``k``/``v`` of
    ``run`` as ``[sum kv_i, kv_heads, head_dim]`` too and views them as one-token pages."""

    name = "flashinfer"

    def __init__(self, device="cuda", paged: bool = False):
        super().__init__(device)
        self.paged = paged
        ws = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=self.device)
        if paged:
            self.wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD")
        else:
            self.wrapper = flashinfer.BatchPrefillWithRaggedKVCacheWrapper(ws, "NHD")

    def plan(self, tree: DraftTree, prefix_lens: torch.Tensor, num_qo_heads: int, num_kv_heads: int,
             head_dim: int, dtype=torch.float16) -> None:
        lay = flashinfer_layout(tree, prefix_lens)
        self.layout = lay
        dev = self.device
        if self.paged:
            kv_len = lay.kv_indptr[1:] - lay.kv_indptr[:-1]
            self.wrapper.plan(lay.qo_indptr.to(dev), lay.kv_indptr.to(dev),
                              torch.arange(int(lay.kv_indptr[-1]), dtype=torch.int32, device=dev),
                              torch.ones_like(kv_len).to(dev), num_qo_heads, num_kv_heads, head_dim, 1,
                              custom_mask=lay.custom_mask.to(dev), causal=False, q_data_type=dtype,
                              kv_data_type=dtype)
        else:
            self.wrapper.plan(lay.qo_indptr.to(dev), lay.kv_indptr.to(dev), num_qo_heads, num_kv_heads,
                              head_dim, custom_mask=lay.custom_mask.to(dev), causal=False, q_data_type=dtype,
                              kv_data_type=dtype)

    def run(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if self.paged:  # [pages, 2, page_size=1, kv_heads, head_dim]
            return self.wrapper.run(q, torch.stack([k, v], dim=1)[:, :, None])
        return self.wrapper.run(q, k, v)
