"""oneDNN-prepacked linears for CPU inference (bf16 and float32).

``nn.Linear`` on a CPU calls its GEMM with the weight in PyTorch's plain layout. Reordering the weight
once at load into oneDNN's blocked layout (``torch.ops.mkldnn._reorder_linear_weight``, what inductor's
CPU freezing does) makes the small-M linears of decoding and tree verification cheaper:

- **bf16** (AMX / AVX512-BF16): a 576x1536 linear at M=1 halves (87 -> 44 us, one thread) and M=16
  saves ~25%. The results equal ``nn.Linear``'s bit for bit on every model-sized layer measured (Intel
  Xeon with AMX: 0 of 10 million outputs differ at M = 1, 2, 8); on a 48-input layer at M=1 about one
  output in 260k comes out one bf16 ulp apart (a summation-order flip at a sum that cancels near zero).
- **float32**: on a 2-core AMD EPYC with AVX2 only (2 threads) the 576x1536 linear costs 62 / 124 /
  210 us at M = 1 / 8 / 16 against 90 / 223 / 323 us, and the 576x49152 LM head 4.0 / 6.0 / 8.7 ms
  against 9.8 / 16.7 / 19.6 ms. The results are not bit-identical to ``nn.Linear`` (a few ulp), but
  they are **batch-invariant**: a row's output is the same bit for bit whether it is computed alone or
  among M rows. Default float32 ``nn.Linear`` is not (MKL's M=1 path sums in another order than its
  M>1 path), so packing makes a token's target logits independent of how many tree nodes are verified
  beside it, which is what token-for-token lossless tree verification leans on.

Neither is taken on trust. :func:`onednn_bf16_supported` and :func:`onednn_fp32_supported` ask the
kernel itself once per process (a small probe) and :func:`packing_available` is False where they say
no: oneDNN's bf16 reorder needs AVX512 (BW / VL / DQ) or AVX-NE-CONVERT and raises on an AVX2-only CPU;
a float32 kernel that is not batch-invariant, or drifts from ``nn.Linear`` by more than float32
rounding, is refused. Those CPUs keep plain ``nn.Linear``. :func:`pack_linears_` probes every linear
again before swapping it in.

Inference only: a packed linear has no gradient. The plain ``weight`` is kept (tied embeddings and
``SpecEngine.set_token_map`` read it), so a packed model holds its linear weights twice.
"""

from __future__ import annotations

import functools
from typing import Tuple

import torch
from torch import nn

__all__ = ["PackedLinear", "pack_linears_", "packing_available", "onednn_bf16_supported", "onednn_fp32_supported",
           "agrees"]

PROBE_ROWS = (1, 2, 5, 8, 17)  # M values a probe runs at: decode, small trees, and past one 16-row block


def _reorder(weight: torch.Tensor, batch_hint: int) -> torch.Tensor:
    """``weight`` ``[out, in]`` (bf16 or float32) -> oneDNN's blocked layout (opaque). Raises
    ``RuntimeError`` on a CPU without the kernel for that dtype."""
    return torch.ops.mkldnn._reorder_linear_weight(weight, batch_hint)


def _packed_linear(x: torch.Tensor, packed: torch.Tensor, bias) -> torch.Tensor:
    """``x`` ``[..., in]`` @ the packed ``[out, in]`` weight (+ ``bias`` ``[out]``) -> ``[..., out]``."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def _ops_present() -> bool:
    ops = getattr(torch.ops, "mkldnn", None)
    return (torch.backends.mkldnn.is_available() and hasattr(ops, "_reorder_linear_weight")
            and hasattr(ops, "_linear_pointwise"))


def agrees(packed_fn, weight: torch.Tensor, bias=None, seed: int = 0) -> Tuple[bool, str]:
    """Whether ``packed_fn(x)`` may stand in for ``F.linear(x, weight, bias)`` -> (yes, why not).

    ``packed_fn``: ``x [M, in] -> [M, out]``. bf16: equal bit for bit at every M of :data:`PROBE_ROWS`.
    float32: every row equal bit for bit to that row computed alone (batch-invariant), and within float32
    rounding of ``F.linear`` (``|diff| <= 1e-5 * (1 + |y|)``, about 80 ulp at |y| = 1; oneDNN and MKL
    differ by a few ulp from their summation order, a wrong kernel by far more).

    Examples
    --------
    >>> w = torch.randn(8, 4).to(torch.bfloat16)
    >>> agrees(lambda x: torch.nn.functional.linear(x, w), w)
    (True, '')
    >>> w = torch.randn(8, 4)
    >>> agrees(lambda x: torch.nn.functional.linear(x, w) * 1.01, w)
    (False, 'differs from nn.Linear by more than float32 rounding at M=1')
    """
    g = torch.Generator().manual_seed(seed)
    dt = weight.dtype
    with torch.inference_mode():
        for m in PROBE_ROWS:
            x = torch.randn(m, weight.shape[1], generator=g).to(dt)
            y, want = packed_fn(x), nn.functional.linear(x, weight, bias)
            if dt == torch.bfloat16:
                if not torch.equal(y, want):
                    return False, f"differs from nn.Linear at M={m}"
                continue
            if not bool(((y - want).abs() <= 1e-5 * (1 + want.abs())).all()):
                return False, f"differs from nn.Linear by more than float32 rounding at M={m}"
            alone = torch.cat([packed_fn(x[r:r + 1]) for r in range(m)])
            if not torch.equal(alone, y):
                return False, f"not batch-invariant: a row computed among M={m} differs from the row alone"
    return True, ""


def _kernel_check(dtype: torch.dtype) -> Tuple[bool, str]:
    if not _ops_present():
        return False, "this torch build has no oneDNN weight prepacking"
    g = torch.Generator().manual_seed(0)
    w = torch.randn(48, 40, generator=g).to(dtype)
    try:
        packed = _reorder(w, 16)
        ok, why = agrees(lambda x: _packed_linear(x, packed, None), w)
    except RuntimeError as e:  # e.g. "bf16 path needs the cpu support avx_ne_convert or avx512bw, ..."
        return False, f"oneDNN has no {dtype_label(dtype)} linear kernel for this CPU ({str(e).splitlines()[0][:120]})"
    return (True, "") if ok else (False, f"oneDNN's packed {dtype_label(dtype)} linear {why} on this CPU")


def dtype_label(dtype: torch.dtype) -> str:
    return {torch.bfloat16: "bf16", torch.float32: "float32"}.get(dtype, str(dtype))


@functools.lru_cache(maxsize=None)
def onednn_bf16_supported() -> Tuple[bool, str]:
    """Whether oneDNN packs and runs bf16 linears on this CPU, equal to ``nn.Linear`` bit for bit on the probe
    -> (yes, why not). Asks the kernel (:func:`agrees` on a 48x40 probe weight) rather than the CPU flags; cached."""
    return _kernel_check(torch.bfloat16)


@functools.lru_cache(maxsize=None)
def onednn_fp32_supported() -> Tuple[bool, str]:
    """Whether oneDNN packs and runs float32 linears on this CPU batch-invariantly and within float32
    rounding of ``nn.Linear`` -> (yes, why not). A kernel probe (:func:`agrees`); cached per process."""
    return _kernel_check(torch.float32)


def _capability(dtype: torch.dtype, device) -> Tuple[bool, str]:
    """The probe's answer for ``dtype`` on ``device`` -> (yes, why not); only bf16 / float32 on a CPU are
    probed (the checks are looked up at call time, so tests can force either answer)."""
    dev = torch.device(device)
    if dev.type != "cpu" or dtype not in (torch.bfloat16, torch.float32):
        return False, f"prepacking is for bf16 / float32 on a CPU, this engine runs {dtype_label(dtype)} on {dev.type}"
    return (onednn_bf16_supported if dtype == torch.bfloat16 else onednn_fp32_supported)()


def packing_available(dtype: torch.dtype, device) -> bool:
    """True on a CPU whose oneDNN passes the probe for ``dtype`` (bf16 or float32); False elsewhere."""
    return _capability(dtype, device)[0]


class PackedLinear(nn.Module):
    """``y = x @ W.T + b`` with ``W`` prepacked for oneDNN; ``x`` ``[..., in]`` -> ``[..., out]``.

    The packed copy follows the plain ``weight``: an in-place change (``weight.copy_``, ``load_state_dict``,
    an optimizer step) or a new ``weight`` tensor is seen on the next call (the tensor's version counter and
    storage, two host integers: no device sync) and the weight is packed again. Where autograd needs a
    gradient (grad mode on and the weight or the input requires one) it runs ``nn.functional.linear`` on the
    plain weight, since oneDNN's packed op has no backward: training a head inside a packed engine works.
    The packed copy is neither a parameter nor a buffer: ``.to(...)``, ``copy.deepcopy`` and ``state_dict``
    see only the plain weight and bias; after a move off the CPU (or to another dtype) it runs
    ``nn.functional.linear``, and a copy packs again on its first call.
    """

    def __init__(self, lin: nn.Linear, batch_hint: int = 16):
        super().__init__()
        self.weight = lin.weight  # plain layout, shared with whatever else holds it
        self.bias = lin.bias
        self.in_features, self.out_features = lin.in_features, lin.out_features
        self.batch_hint = batch_hint
        self._packed, self._packed_from = None, None
        self._repack()

    def _stamp(self):
        w = self.weight
        # an inference tensor (made under inference_mode, e.g. by a copy there) has no version counter
        return (-1 if w.is_inference() else w._version), w.data_ptr()

    def _repack(self) -> None:
        self._packed = _reorder(self.weight.detach(), self.batch_hint)  # opaque oneDNN tensor
        self._packed_from = self._stamp()

    def __getstate__(self):  # copy / pickle: an opaque oneDNN tensor has no storage to copy
        state = self.__dict__.copy()
        state["_packed"], state["_packed_from"] = None, None
        return state

    def forward(self, x):  # x: [..., in] -> [..., out]
        w = self.weight
        if (torch.is_grad_enabled() and (w.requires_grad or x.requires_grad)) or w.device.type != "cpu" \
                or w.dtype not in (torch.bfloat16, torch.float32):
            return nn.functional.linear(x, w, self.bias)  # autograd (no packed backward), or moved off the CPU
        if self._packed is None or self._stamp() != self._packed_from:
            self._repack()
        return _packed_linear(x, self._packed, self.bias)


def pack_linears_(module: nn.Module, batch_hint: int = 16) -> int:
    """Replace every bf16 / float32 CPU ``nn.Linear`` inside ``module`` by a :class:`PackedLinear` that
    passes :func:`agrees` against it (else it is left alone). Returns how many were packed; 0 where
    :func:`packing_available` says no for a linear's dtype (that linear is then untouched)."""
    n = 0
    for name, child in list(module.named_children()):
        if isinstance(child, nn.Linear):
            if not packing_available(child.weight.dtype, child.weight.device):
                continue
            p = PackedLinear(child, batch_hint)
            if agrees(p, child.weight.detach(), None if child.bias is None else child.bias.detach())[0]:
                setattr(module, name, p)
                n += 1
        else:
            n += pack_linears_(child, batch_hint)
    return n


def resolve_pack(pack, dtype: torch.dtype, device) -> Tuple[bool, str]:
    """An engine's ``pack`` option -> (pack its linears, one line saying what its linears are and why).

    ``pack``: None = where :func:`packing_available` (the default), False = never, True = required (raises
    ``ValueError`` with the probe's reason where it is not available: no silent fallback).

    Examples
    --------
    >>> resolve_pack(False, torch.float32, "cpu")
    (False, 'plain nn.Linear (pack=False)')
    """
    if pack is not None and not isinstance(pack, bool):
        raise ValueError(f"pack must be None (auto), True or False, got {pack!r}")
    if pack is False:
        return False, "plain nn.Linear (pack=False)"
    ok, why = _capability(dtype, device)
    if ok:
        what = ("equal to nn.Linear bit for bit on the probe" if dtype == torch.bfloat16 else
                "batch-invariant, within float32 rounding of nn.Linear")
        return True, f"oneDNN-prepacked {dtype_label(dtype)} ({what})"
    if pack:
        raise ValueError(f"pack=True: {why}")
    return False, f"plain nn.Linear ({why})"
