"""oneDNN-prepacked bf16 linears for CPU inference (issue 10 item 2).

``nn.Linear`` in bf16 on a CPU calls oneDNN with the weight in PyTorch's plain layout, so every call
reorders it into the blocked layout the AMX / AVX512-BF16 kernel wants. Reordering once at load
(``torch.ops.mkldnn._reorder_linear_weight``, what inductor's CPU freezing does) halves a 576x1536
linear at M=1 (87 -> 44 us, one thread) and saves ~25% at M=16. The results are bit-identical to
``nn.Linear`` at every M (checked at pack time and in ``tests/models``), so packing changes speed,
never outputs.

Inference only: a packed linear has no gradient. The plain ``weight`` is kept (tied embeddings and
``SpecEngine.set_token_map`` read it), so a packed model holds its linear weights twice.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["PackedLinear", "pack_linears_", "packing_available"]


def packing_available(dtype: torch.dtype, device) -> bool:
    ops = getattr(torch.ops, "mkldnn", None)
    return (dtype == torch.bfloat16 and torch.device(device).type == "cpu" and torch.backends.mkldnn.is_available()
            and hasattr(ops, "_reorder_linear_weight") and hasattr(ops, "_linear_pointwise"))


class PackedLinear(nn.Module):
    """``y = x @ W.T + b`` with ``W`` prepacked for oneDNN; ``x`` ``[..., in]`` -> ``[..., out]``."""

    def __init__(self, lin: nn.Linear, batch_hint: int = 16):
        super().__init__()
        self.weight = lin.weight  # plain layout, shared with whatever else holds it
        self.bias = lin.bias
        self.in_features, self.out_features = lin.in_features, lin.out_features
        self.register_buffer("packed", torch.ops.mkldnn._reorder_linear_weight(lin.weight.detach(), batch_hint),
                             persistent=False)

    def forward(self, x):
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


def pack_linears_(module: nn.Module, batch_hint: int = 16) -> int:
    """Replace every bf16 CPU ``nn.Linear`` inside ``module`` by a :class:`PackedLinear` that gives the
    same output on a probe input (else it is left alone). Returns how many were packed."""
    n = 0
    for name, child in list(module.named_children()):
        if isinstance(child, nn.Linear) and packing_available(child.weight.dtype, child.weight.device):
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
