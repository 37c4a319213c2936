"""oneDNN-prepacked bf16 linears for CPU inference.

``nn.Linear`` in bf16 on a CPU calls oneDNN with the weight in PyTorch's plain layout, so every call
reorders it into the blocked layout the AMX / AVX512-BF16 kernel wants. Reordering once at load
(``torch.ops.mkldnn._reorder_linear_weight``, what inductor's CPU freezing does) halves a 576x1536
linear at M=1 (87 -> 44 us, one thread) and saves ~25% at M=16. The results are bit-identical to
``nn.Linear`` at every M (checked at pack time and in ``tests/models``), so packing changes speed,
never outputs.

Not every CPU has that kernel: oneDNN's bf16 reorder needs AVX512 (BW / VL / DQ) or AVX-NE-CONVERT
and raises on an AVX2-only CPU. :func:`onednn_bf16_supported` asks the kernel itself once (a 16x16
probe) and :func:`packing_available` is False where it says no: those CPUs keep plain ``nn.Linear``
(bf16 then runs emulated, slower but correct).

Inference only: a packed linear has no gradient. The plain ``weight`` is kept (tied embeddings and
``SpecEngine.set_token_map`` read it), so a packed model holds its linear weights twice.
"""

from __future__ import annotations

import functools
from typing import Tuple

import torch
from torch import nn

__all__ = ["PackedLinear", "pack_linears_", "packing_available", "onednn_bf16_supported"]


def _reorder(weight: torch.Tensor, batch_hint: int) -> torch.Tensor:
    """``weight`` ``[out, in]`` bf16 -> oneDNN's blocked layout (opaque). Raises ``RuntimeError`` on a
    CPU without the bf16 kernel."""
    return torch.ops.mkldnn._reorder_linear_weight(weight, batch_hint)


def _packed_linear(x: torch.Tensor, packed: torch.Tensor, bias) -> torch.Tensor:
    """``x`` ``[..., in]`` @ the packed ``[out, in]`` weight (+ ``bias`` ``[out]``) -> ``[..., out]``."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def _ops_present() -> bool:
    ops = getattr(torch.ops, "mkldnn", None)
    return (torch.backends.mkldnn.is_available() and hasattr(ops, "_reorder_linear_weight")
            and hasattr(ops, "_linear_pointwise"))


@functools.lru_cache(maxsize=None)
def onednn_bf16_supported() -> Tuple[bool, str]:
    """Whether oneDNN packs and runs bf16 linears on this CPU -> (yes, why not).

    Asks the kernel rather than the CPU flags: a 16x16 bf16 weight is packed and applied once; the
    answer is yes only if that runs and equals ``nn.functional.linear`` bit for bit. Cached per process.
    """
    if not _ops_present():
        return False, "this torch build has no oneDNN weight prepacking"
    g = torch.Generator().manual_seed(0)
    w = torch.randn(16, 16, generator=g).to(torch.bfloat16)
    x = torch.randn(2, 16, generator=g).to(torch.bfloat16)
    try:
        with torch.inference_mode():
            same = torch.equal(_packed_linear(x, _reorder(w, 16), None), nn.functional.linear(x, w))
    except RuntimeError as e:  # e.g. "bf16 path needs the cpu support avx_ne_convert or avx512bw, ..."
        return False, f"oneDNN has no bf16 linear kernel for this CPU ({str(e).splitlines()[0][:120]})"
    return (True, "") if same else (False, "oneDNN's packed bf16 linear differs from nn.Linear on this CPU")


def packing_available(dtype: torch.dtype, device) -> bool:
    """True for bf16 on a CPU whose oneDNN packs bf16 linears (:func:`onednn_bf16_supported`)."""
    return dtype == torch.bfloat16 and torch.device(device).type == "cpu" and onednn_bf16_supported()[0]


class PackedLinear(nn.Module):
    """``y = x @ W.T + b`` with ``W`` prepacked for oneDNN; ``x`` ``[..., in]`` -> ``[..., out]``."""

    def __init__(self, lin: nn.Linear, batch_hint: int = 16):
        super().__init__()
        self.weight = lin.weight  # plain layout, shared with whatever else holds it
        self.bias = lin.bias
        self.in_features, self.out_features = lin.in_features, lin.out_features
        self.register_buffer("packed", _reorder(lin.weight.detach(), batch_hint), persistent=False)

    def forward(self, x):  # x: [..., in] -> [..., out]
        return _packed_linear(x, self.packed, self.bias)


def pack_linears_(module: nn.Module, batch_hint: int = 16) -> int:
    """Replace every bf16 CPU ``nn.Linear`` inside ``module`` by a :class:`PackedLinear` that gives the
    same output on a probe input (else it is left alone). Returns how many were packed; 0 where
    :func:`packing_available` says no (the module is then untouched)."""
    n = 0
    for name, child in list(module.named_children()):
        if isinstance(child, nn.Linear):
            if not packing_available(child.weight.dtype, child.weight.device):
                continue
            p = PackedLinear(child, batch_hint)
            with torch.inference_mode():
                probe = torch.randn(3, child.in_features, generator=torch.Generator().manual_seed(0)).to(child.weight.dtype)
                same = torch.equal(p(probe), child(probe))
            if same:
                setattr(module, name, p)
                n += 1
        else:
            n += pack_linears_(child, batch_hint)
    return n
