"""Count the operations that force a device->host synchronisation.

Works on any device, CPU included, by watching the ATen ops that must read tensor *values* on
the host: ``.item()`` / ``bool(t)`` / ``.tolist()`` (``_local_scalar_dense``), boolean-mask
indexing and ``nonzero`` (data-dependent output shapes), ``unique``, ``masked_select``,
``repeat_interleave`` without ``output_size``, a copy to the CPU from another device that waits for it (any
but an asynchronous one into pinned memory), and a blocking copy from the CPU to another device (the host waits
for the device's stream: ``torch.tensor(list, device="cuda")`` is one). Unlike ``torch.cuda.set_sync_debug_mode``
this runs on any device, in CI; the ``gpu`` test compares the two on CUDA.
"""

from __future__ import annotations

from collections import Counter
from contextlib import contextmanager

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["SyncCounter", "count_host_syncs", "OpCounter", "count_ops", "sync_of", "to_device", "read_host"]

_SYNC_OPS = {
    "aten::_local_scalar_dense", "aten::nonzero", "aten::masked_select",
    "aten::unique_consecutive", "aten::_unique2", "aten::_unique", "aten::unique_dim", "aten::equal",
    "aten::is_nonzero",
}  # (``nonzero_static`` has a fixed output shape and ``_assert_async`` asserts on the device: neither waits)


def sync_of(name: str, args: tuple, kwargs: dict):
    """The reason the ATen op ``name`` called with ``args`` / ``kwargs`` makes the host wait for a device (its
    name, or ``name`` with the reason in brackets), or None when it does not."""
    if name in _SYNC_OPS:
        return name
    if name in ("aten::index", "aten::index_put_", "aten::index_put", "aten::_index_put_impl_"):
        idx = args[1] if len(args) > 1 else kwargs.get("indices", ())
        if any(isinstance(t, torch.Tensor) and t.dtype == torch.bool for t in idx or ()):
            return name + "(bool mask)"
    elif name == "aten::repeat_interleave.Tensor" and kwargs.get("output_size") is None:
        return name
    elif name == "aten::lift_fresh":  # ``torch.tensor(data, device=...)``: its copy ran already, blocking
        if isinstance(args[0], torch.Tensor) and args[0].device.type != "cpu":
            return name + "(from cpu, blocking)"
    elif name in ("aten::_to_copy", "aten::copy_"):
        copy = name == "aten::copy_"
        src = args[1] if copy else args[0]
        if not isinstance(src, torch.Tensor):
            return None
        dst = args[0].device if copy else kwargs.get("device")
        if dst is None:
            return None
        src_host, dst_host = src.device.type == "cpu", torch.device(dst).type == "cpu"
        non_blocking = bool(args[2] if copy and len(args) > 2 else kwargs.get("non_blocking", False))
        if not src_host and dst_host:
            # ``.to("cpu", non_blocking=True)`` pins its output; ``copy_`` waits unless its destination is pinned
            if non_blocking and (not copy or args[0].is_pinned()):
                return None
            return name + "(to cpu)"
        if src_host and not dst_host and not non_blocking:
            return name + "(from cpu, blocking)"
    return None


def to_device(t: torch.Tensor, device) -> torch.Tensor:
    """``t`` (a CPU tensor) on ``device`` without making the host wait for the device: on CUDA through pinned
    memory, copied asynchronously in stream order (the caching host allocator keeps the pinned block until the copy
    has run); elsewhere ``t.to``.

    Raises
    ------
    RuntimeError
        While a CUDA graph is being captured: the copy would be recorded from a buffer freed after the capture (a
        blocking one cannot run there at all); a captured body builds its tables in an eager run first.
    """
    dev = torch.device(device)
    if dev.type != "cuda":
        return t.to(dev)
    if torch.cuda.is_current_stream_capturing():
        raise RuntimeError("to_device: a host->device copy inside a CUDA graph capture; build the tensor before "
                           "capturing (an eager run of the captured body)")
    return t.pin_memory().to(dev, non_blocking=True)


def read_host(t: torch.Tensor) -> list:  # t: [*] in host memory, its writes done -> nested lists of its values
    """The values of ``t`` as (nested) lists, where ``t`` is in host memory and its writes have finished: a CPU
    tensor, or a pinned buffer that an asynchronous device->host copy filled once that copy's event is seen done.
    Such a read does not wait for any device, so :func:`count_ops`, :func:`count_host_syncs` and the plugin's
    profiler do not count it as a host read (they count every other ``tolist``, which on a device tensor waits).

    Examples
    --------
    >>> with count_ops() as c:
    ...     values = read_host(torch.arange(3))
    >>> values, c.reads
    ([0, 1, 2], 0)

    Raises
    ------
    ValueError
        ``t`` is on another device (reading it would wait for that device): copy it to pinned memory first.
    """
    if t.device.type != "cpu":
        raise ValueError(f"read_host: t must be in host memory (device cpu), got device {t.device}: a device "
                         "tensor's values make the host wait; copy it to pinned memory and read it once the copy's "
                         "event is done")
    return torch._C.TensorBase.tolist(t)  # the C method: not the counters' wrapper of ``Tensor.tolist``


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
        why = sync_of(func._schema.name, args, kwargs)
        if why is not None:
            self.ops[why] += 1
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
    """Dispatch mode counting every ATen op (``ops``), the calls among them that make the host wait (``reads``:
    :func:`sync_of`, value reads above all) and host->device list copies (``copies``: a tensor built
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
