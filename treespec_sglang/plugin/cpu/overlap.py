"""Torch stand-ins for the Triton kernels SGLang 0.5.23's overlap scheduler calls on a speculative batch.

SGLang turns its overlap scheduler off for speculative decoding on a CPU; the test bed turns it back on
(:func:`.host.allow_cpu_overlap`) to run on the CPU the scheduling a GPU server runs by default. That loop then
calls Triton kernels with no CPU build, which :func:`install_overlap` replaces in the process where SGLang calls
them (each scheduler process: the plugin's entry point runs there), with the kernels' own checks and semantics:

| kernel | SGLang call site | here |
|---|---|---|
| ``gather_spec_extras`` (``kernels/ops/speculative/gather_spec_extras.py``) | ``managers/overlap_utils.py`` | :func:`gather_spec_extras` |

Where SGLang runs as it does on a CPU by default (no overlap) none of them is ever called. No sglang import but in
:func:`install_overlap`.
"""

from __future__ import annotations

from typing import Optional

import torch

from .matcher import check

__all__ = ["gather_spec_extras", "install_overlap"]

_OP = "gather_spec_extras"


def gather_spec_extras(indices: torch.Tensor, topk_p_buf: torch.Tensor, topk_index_buf: torch.Tensor,
                       output_tokens_buf: torch.Tensor, hidden_states_buf: Optional[torch.Tensor]):
    """Rows ``indices`` of SGLang's future-map buffers, each into a new tensor of its dtype and trailing shape.

    Parameters
    ----------
    indices : ``[m]`` integer row indices (any layout: the kernel's wrapper makes them contiguous).
    topk_p_buf, topk_index_buf, output_tokens_buf : ``[rows, ...]`` buffers; hidden_states_buf : ``[rows, ...]`` or
        None (a draft that captures no hidden states).

    Returns
    -------
    ``(topk_p [m, ...], topk_index [m, ...], bonus_tokens [m, ...], hidden_states [m, ...] or None)``.

    The Triton kernel addresses each source as rows of its trailing element count (``src + row * n + col``), so a
    source that is not contiguous would be read at wrong places on a GPU: refused here, as are an index tensor that
    is not 1-D integers, a row out of range (the kernel would read past the buffer) and buffers on another device.
    """
    check(_OP, indices.dim() == 1 and not indices.dtype.is_floating_point and indices.dtype != torch.bool,
          f"indices must be a 1-D integer tensor, got {indices.dtype} {tuple(indices.shape)}")
    bufs = {"topk_p_buf": topk_p_buf, "topk_index_buf": topk_index_buf, "output_tokens_buf": output_tokens_buf}
    if hidden_states_buf is not None:
        bufs["hidden_states_buf"] = hidden_states_buf
    for name, buf in bufs.items():
        check(_OP, buf.is_contiguous(), f"{name} must be contiguous (the kernel reads it as rows), got strides "
                                        f"{tuple(buf.stride())} for shape {tuple(buf.shape)}")
        check(_OP, buf.device == indices.device, f"{name} is on {buf.device}, indices on {indices.device}")
    idx = indices.long()
    if idx.numel():
        rows = min(b.shape[0] for b in bufs.values())
        lo, hi = int(idx.min()), int(idx.max())
        check(_OP, 0 <= lo and hi < rows, f"indices must be in [0, {rows}), got [{lo}, {hi}]")
    out = [buf.index_select(0, idx) for buf in (topk_p_buf, topk_index_buf, output_tokens_buf)]
    out.append(None if hidden_states_buf is None else hidden_states_buf.index_select(0, idx))
    return tuple(out)


def install_overlap() -> None:
    """Point SGLang's overlap future map at :func:`gather_spec_extras` in this process (idempotent)."""
    from sglang.srt.managers import overlap_utils

    overlap_utils.gather_spec_extras = gather_spec_extras
