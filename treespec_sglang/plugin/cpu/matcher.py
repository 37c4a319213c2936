"""What the real kernels check of their tensors, for the stand-ins: a torch twin of SGLang's ``TensorMatcher``.

A stand-in must refuse what the kernel it replaces refuses, or a defect that crashes the real kernel
(a strided view where it wants a contiguous tensor, an int32 where it wants int64) passes every CPU test
and first shows on a user's GPU. SGLang 0.5.23's JIT kernels check their arguments at entry with
``TensorMatcher`` (``kernels/jit/include/sgl_kernel/tensor.h``); the compiled CPU ops of ``sgl_kernel``
check theirs with ``CHECK_INPUT`` / ``CHECK_DIM`` / ``CHECK_EQ`` style macros. :class:`Matcher` has the
same rules as ``TensorMatcher``:

* a shape of fixed sizes (``-1``: bound by the first tensor) and :class:`Size` symbols, which bind to the first tensor's size
  and must match in every later one (``Size mismatch for shape#0('batch_size'): expected 4 but got 3``);
* strides given with :meth:`Matcher.strides` are checked per dimension (a dimension of size 1 whose
  stride is a fixed number is skipped); without them the tensor must be contiguous
  (``Tensor is not contiguous as expected``);
* a dtype (one of several) and a device (a :class:`Device` symbol binds to the first tensor's device).

Every failure raises ``RuntimeError`` naming the op, the argument and the rule, as the kernel's
``Panic`` / ``RuntimeCheck`` does.

Example
-------
>>> import torch
>>> bs = Size("batch_size")
>>> m = Matcher("op", [bs, 7]).dtype(torch.int64)
>>> _ = m.verify(torch.zeros(2, 7, dtype=torch.int64), "a")
>>> m.verify(torch.zeros(2, 36, dtype=torch.int64)[:, :7], "b")
Traceback (most recent call last):
...
RuntimeError: op: b: Tensor is not contiguous as expected (shape (2, 7), strides (36, 1))
"""

from __future__ import annotations

from typing import Optional, Sequence, Union

import torch

__all__ = ["Size", "Device", "Matcher", "check"]


class Size:
    """A symbolic size (``SymbolicSize``): unset until a tensor binds it, then every tensor must agree."""

    def __init__(self, name: str = ""):
        self.name = name
        self.value: Optional[int] = None

    def verify(self, value: int, what: str) -> Optional[str]:
        if self.value is None:
            self.value = int(value)
            return None
        if self.value != value:
            label = f"{what}('{self.name}')" if self.name else what
            return f"Size mismatch for {label}: expected {self.value} but got {value}"
        return None

    def unwrap(self) -> int:
        if self.value is None:
            raise RuntimeError(f"Size value is not set ({self.name})")
        return self.value


class Device:
    """A symbolic device (``SymbolicDevice``) of a given type: every tensor on one device of that type."""

    def __init__(self, kind: str = "cpu"):
        self.kind = kind
        self.value: Optional[torch.device] = None

    def verify(self, device: torch.device) -> Optional[str]:
        if device.type != self.kind:
            return f"Device mismatch: expected {self.kind} but got {device}"
        if self.value is None:
            self.value = device
        elif self.value != device:
            return f"Device mismatch: expected {self.value} but got {device}"
        return None


SizeRef = Union[int, Size]


def _ref(ref: SizeRef) -> Size:
    """``SizeRef``: a symbol as given; a number binds a fresh symbol to it; ``-1`` a fresh unbound one (it binds
    to the first tensor the matcher verifies, so ``.verify(a).verify(b)`` still makes ``b`` agree with ``a``)."""
    if isinstance(ref, Size):
        return ref
    s = Size()
    if ref != -1:
        s.value = int(ref)
    return s


class Matcher:
    """``TensorMatcher(shape).with_strides(...).with_dtype<...>().with_device(...).verify(t)`` for one op."""

    def __init__(self, op: str, shape: Sequence[SizeRef]):
        self.op = op
        self.shape = [_ref(r) for r in shape]
        self._strides: Optional[list] = None
        self._dtypes: Optional[tuple] = None
        self._device: Optional[Device] = None

    def strides(self, strides: Sequence[SizeRef]) -> "Matcher":
        if len(strides) != len(self.shape):
            raise ValueError("strides size must match shape size")
        self._strides = [_ref(r) for r in strides]
        return self

    def dtype(self, *dtypes: torch.dtype) -> "Matcher":
        self._dtypes = dtypes
        return self

    def device(self, device: Device) -> "Matcher":
        self._device = device
        return self

    def verify(self, t, name: str) -> "Matcher":
        """Check ``t`` (argument ``name``); raise ``RuntimeError`` on the first rule it breaks."""
        if not isinstance(t, torch.Tensor):
            self._fail(name, f"expected a tensor, got {type(t).__name__}")
        if t.dim() != len(self.shape):
            self._fail(name, f"Tensor dimension mismatch: expected {len(self.shape)} but got {t.dim()}")
        for i, ref in enumerate(self.shape):
            self._fail(name, ref.verify(t.shape[i], f"shape#{i}"))
        if self._strides is not None:
            for i, ref in enumerate(self._strides):
                if t.shape[i] != 1 or ref.value is None:  # a size-1 dim skips a bound stride
                    self._fail(name, ref.verify(t.stride(i), f"stride#{i}"))
        elif not t.is_contiguous():
            self._fail(name, f"Tensor is not contiguous as expected (shape {tuple(t.shape)}, strides {t.stride()})")
        if self._dtypes is not None and t.dtype not in self._dtypes:
            want = " or ".join(str(d).replace("torch.", "") for d in self._dtypes)
            self._fail(name, f"dtype mismatch: expected {want} but got {str(t.dtype).replace('torch.', '')}")
        if self._device is not None:
            self._fail(name, self._device.verify(t.device))
        return self

    def _fail(self, name: str, msg: Optional[str]) -> None:
        if msg is not None:
            raise RuntimeError(f"{self.op}: {name}: {msg}")


def check(op: str, ok: bool, msg: str) -> None:
    """``CHECK_HOST`` / ``TORCH_CHECK``: raise ``RuntimeError`` with ``msg`` unless ``ok``."""
    if not ok:
        raise RuntimeError(f"{op}: {msg}")
