"""Count the operations that force a device->host synchronisation.

Works on any device, CPU included, by watching the ATen ops that must read tensor *values* on
the host: ``.item()`` / ``bool(t)`` / ``.tolist()`` (``_local_scalar_dense``), boolean-mask
indexing and ``nonzero`` (data-dependent output shapes), ``unique``, ``masked_select``,
``repeat_interleave`` without ``output_size``, and copies to the CPU from another device.
On CUDA, ``torch.cuda.set_sync_debug_mode`` gives the same answer; this also runs in CI.
"""

from __future__ import annotations

from collections import Counter
from contextlib import contextmanager

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["SyncCounter", "count_host_syncs", "OpCounter", "count_ops"]

_SYNC_OPS = {
    "aten::_local_scalar_dense", "aten::nonzero", "aten::nonzero_static", "aten::masked_select",
    "aten::unique_consecutive", "aten::_unique2", "aten::_unique", "aten::unique_dim", "aten::equal",
    "aten::is_nonzero", "aten::_assert_async",
}


class SyncCounter(TorchDispatchMode):
    """Dispatch mode recording sync-forcing ops in ``self.ops`` (a Counter of op names)."""

    def __init__(self):
        super().__init__()
        self.ops: Counter = Counter()

    @property
    def count(self) -> int:
        return sum(self.ops.values())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func._schema.name
        if name in _SYNC_OPS:
            self.ops[name] += 1
        elif name in ("aten::index", "aten::index_put_", "aten::index_put", "aten::_index_put_impl_"):
            idx = args[1] if len(args) > 1 else kwargs.get("indices", ())
            if any(isinstance(t, torch.Tensor) and t.dtype == torch.bool for t in idx or ()):
                self.ops[name + "(bool mask)"] += 1
        elif name == "aten::repeat_interleave.Tensor" and kwargs.get("output_size") is None:
            self.ops[name] += 1
        elif name in ("aten::_to_copy", "aten::copy_"):
            src = args[1] if name == "aten::copy_" else args[0]
            dst_dev = kwargs.get("device") if name == "aten::_to_copy" else args[0].device
            if isinstance(src, torch.Tensor) and src.device.type != "cpu" and dst_dev is not None \
                    and torch.device(dst_dev).type == "cpu":
                self.ops[name + "(to cpu)"] += 1
        return func(*args, **kwargs)


@contextmanager
def count_host_syncs():
    """Context manager yielding a :class:`SyncCounter`.

    Examples
    --------
    >>> x = torch.arange(4)
    >>> with count_host_syncs() as c:
    ...     _ = x.sum().item()
    >>> c.count
    1
    """
    mode = SyncCounter()

    def on_read(name):
        mode.ops[f"Tensor.{name}"] += 1

    with _host_reads_seen(on_read), mode:
        yield mode


@contextmanager
def _host_reads_seen(on_read):
    """Call ``on_read(name)`` on every ``Tensor.tolist`` / ``Tensor.numpy``: they bypass the dispatcher."""
    orig = {name: getattr(torch.Tensor, name) for name in ("tolist", "numpy")}

    def wrap(name):
        def f(self, *a, **k):
            on_read(name)
            return orig[name](self, *a, **k)
        return f

    try:
        for name in orig:
            setattr(torch.Tensor, name, wrap(name))
        yield
    finally:
        for name, fn in orig.items():
            setattr(torch.Tensor, name, fn)


class OpCounter(TorchDispatchMode):
    """Dispatch mode counting every ATen op (``ops``), the host reads among them (``reads``: the
    sync-forcing ops of :class:`SyncCounter`) and host->device list copies (``copies``: a tensor built
    from Python data, ``aten::lift_fresh``, or a copy from the CPU to another device).

    Examples
    --------
    >>> x = torch.arange(4)
    >>> with count_ops() as c:
    ...     _ = (x + torch.tensor([1, 2, 3, 4])).sum().item()
    >>> c.ops, c.reads, c.copies
    (4, 1, 1)
    """

    def __init__(self):
        super().__init__()
        self.ops = 0
        self.reads = 0
        self.copies = 0
        self.names: Counter = Counter()
        self._sync = SyncCounter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func._schema.name
        self.ops += 1
        self.names[name] += 1
        before = self._sync.count
        out = self._sync.__torch_dispatch__(func, types, args, kwargs)  # classifies, then runs the op
        self.reads += self._sync.count - before
        if name == "aten::lift_fresh":
            self.copies += 1
        elif name in ("aten::_to_copy", "aten::copy_"):
            src = args[1] if name == "aten::copy_" else args[0]
            dst = kwargs.get("device") if name == "aten::_to_copy" else args[0].device
            if isinstance(src, torch.Tensor) and src.device.type == "cpu" and dst is not None \
                    and torch.device(dst).type != "cpu":
                self.copies += 1
        return out


@contextmanager
def count_ops():
    """Context manager yielding an :class:`OpCounter`; ``.tolist()`` / ``.numpy()`` count as host reads."""
    mode = OpCounter()

    def on_read(name):
        mode.reads += 1

    with _host_reads_seen(on_read), mode:
        yield mode
