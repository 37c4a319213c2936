"""``utils.syncs``: which ATen calls make the host wait for a device. The classification (:func:`sync_of`) is
checked on the CPU with meta tensors standing for device tensors (never run) and a pinned stand-in; the ``gpu``
test runs real CUDA calls and checks the counter against ``torch.cuda.set_sync_debug_mode``."""

import re

import pytest
import torch

from treespec_sglang.utils.syncs import count_host_syncs, count_ops, read_host, sync_of, to_device


class Pinned:
    """A CPU destination that reports itself pinned (pinning needs a GPU)."""

    device = torch.device("cpu")

    def __init__(self, pinned: bool):
        self.pinned = pinned

    def is_pinned(self):
        return self.pinned


DEV, HOST = torch.empty(2, device="meta"), torch.empty(2)


@pytest.mark.parametrize("name,args,kwargs,why", [
    # device -> host: waits, unless an asynchronous copy lands in pinned memory
    ("aten::_to_copy", (DEV,), {"device": torch.device("cpu")}, "aten::_to_copy(to cpu)"),
    ("aten::_to_copy", (DEV,), {"device": "cpu", "non_blocking": True}, None),  # .to() pins its output
    ("aten::copy_", (Pinned(True), DEV), {}, "aten::copy_(to cpu)"),
    ("aten::copy_", (Pinned(True), DEV, True), {}, None),
    ("aten::copy_", (Pinned(False), DEV, True), {}, "aten::copy_(to cpu)"),  # pageable: the host waits
    ("aten::copy_", (Pinned(True), DEV), {"non_blocking": True}, None),
    # host -> device: a blocking copy waits for the device's stream
    ("aten::_to_copy", (HOST,), {"device": torch.device("meta")}, "aten::_to_copy(from cpu, blocking)"),
    ("aten::_to_copy", (HOST,), {"device": "meta", "non_blocking": True}, None),
    ("aten::copy_", (DEV, HOST), {}, "aten::copy_(from cpu, blocking)"),
    ("aten::copy_", (DEV, HOST, True), {}, None),
    ("aten::lift_fresh", (DEV,), {}, "aten::lift_fresh(from cpu, blocking)"),  # torch.tensor(list, device=)
    ("aten::lift_fresh", (HOST,), {}, None),
    # neither side on the host, or no device given
    ("aten::copy_", (DEV, DEV), {}, None),
    ("aten::copy_", (HOST, HOST), {}, None),
    ("aten::_to_copy", (DEV,), {"dtype": torch.float16}, None),
    # value reads and data-dependent shapes
    ("aten::_local_scalar_dense", (DEV,), {}, "aten::_local_scalar_dense"),
    ("aten::nonzero", (DEV,), {}, "aten::nonzero"),
    ("aten::nonzero_static", (DEV,), {"size": 4}, None),
    ("aten::_assert_async", (DEV,), {}, None),
    ("aten::index", (DEV, [torch.empty(2, dtype=torch.bool, device="meta")]), {}, "aten::index(bool mask)"),
    ("aten::index", (DEV, [torch.empty(2, dtype=torch.long, device="meta")]), {}, None),
    ("aten::repeat_interleave.Tensor", (DEV,), {}, "aten::repeat_interleave.Tensor"),
    ("aten::repeat_interleave.Tensor", (DEV,), {"output_size": 4}, None),
    ("aten::add", (DEV, DEV), {}, None),
])
def test_which_calls_wait_for_the_device(name, args, kwargs, why):
    assert sync_of(name, args, kwargs) == why


def test_the_counters_see_reads_on_the_cpu():
    x = torch.arange(6)
    with count_host_syncs() as c:
        _ = x.sum().item(), x[x > 2], x.tolist(), x + 1
    assert c.ops == {"aten::_local_scalar_dense": 1, "aten::index(bool mask)": 1, "Tensor.tolist": 1}
    with count_ops() as o:
        _ = x + torch.tensor([1, 2, 3, 4, 5, 6])
    assert (o.reads, o.copies) == (0, 1)


def test_a_ready_host_buffer_is_read_without_counting_a_host_read():
    """``read_host`` gives a host tensor's values and neither counter counts it; ``tolist`` on the same tensor,
    the control, counts one read in each."""
    x = torch.arange(6, dtype=torch.int32).view(2, 3)
    with count_ops() as o, count_host_syncs() as c:
        got = read_host(x)
    assert got == [[0, 1, 2], [3, 4, 5]] and (o.reads, o.ops, c.count) == (0, 0, 0)
    with count_ops() as o, count_host_syncs() as c:
        _ = x.tolist()
    assert (o.reads, c.count) == (1, 1)


def test_a_device_tensor_is_refused_by_the_host_read():
    x = torch.empty(3, device="meta")
    with pytest.raises(ValueError, match=re.escape(
            "read_host: t must be in host memory (device cpu), got device meta: a device tensor's values make the "
            "host wait; copy it to pinned memory and read it once the copy's event is done")):
        read_host(x)


@pytest.mark.gpu
def test_the_counter_agrees_with_cudas_sync_debug_mode():
    """Each call, alone: the counter says it waits exactly when CUDA's sync debug mode raises for it."""
    dev = torch.device("cuda")
    x = torch.arange(8, device=dev)
    pinned = torch.empty(8, dtype=torch.int64).pin_memory()
    calls = {
        "item": lambda: x.sum().item(),
        "bool mask": lambda: x[x > 3],
        "to cpu": lambda: x.cpu(),
        "to cpu, non_blocking": lambda: x.to("cpu", non_blocking=True),
        "copy into pinned, non_blocking": lambda: pinned.copy_(x, non_blocking=True),
        "list to device": lambda: torch.tensor([1, 2, 3], device=dev),
        "pinned to device, non_blocking": lambda: pinned.to(dev, non_blocking=True),
        "nonzero_static": lambda: torch.nonzero_static(x, size=4),
        "device op": lambda: x * 2,
        "read_host of a pinned buffer": lambda: read_host(pinned),
    }
    for what, call in calls.items():
        torch.cuda.synchronize()
        with count_host_syncs() as c:
            call()
        torch.cuda.synchronize()
        prev = torch.cuda.get_sync_debug_mode()
        torch.cuda.set_sync_debug_mode("error")
        try:
            call()
            raised = False
        except RuntimeError:
            raised = True
        finally:
            torch.cuda.set_sync_debug_mode(prev)
        assert (c.count > 0) == raised, (what, dict(c.ops), raised)


def test_to_device_copies_through_pinned_memory_on_cuda_only(monkeypatch):
    """The branches of ``to_device``, each device kind stood in: CUDA pins and copies asynchronously; a capture in
    progress is refused (no copy recorded); any other device copies plainly (the CPU's result is the value)."""
    t = torch.arange(5)
    assert to_device(t, "cpu").tolist() == [0, 1, 2, 3, 4]
    calls = []
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self: calls.append("pin") or self)
    monkeypatch.setattr(torch.Tensor, "to", lambda self, dev, non_blocking=False: calls.append(
        (str(dev), non_blocking)) or self)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    to_device(t, "cuda:1")
    assert calls == ["pin", ("cuda:1", True)]
    calls.clear()
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    with pytest.raises(RuntimeError, match="inside a CUDA graph capture"):
        to_device(t, "cuda")
    assert calls == []
    to_device(t, "meta")
    assert calls == [("meta", False)]


@pytest.mark.gpu
def test_to_device_makes_no_sync_on_cuda():
    t = torch.arange(1000, dtype=torch.float32)
    prev = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        got = to_device(t, "cuda")
    finally:
        torch.cuda.set_sync_debug_mode(prev)
    assert got.device.type == "cuda" and torch.equal(got.cpu(), t)
