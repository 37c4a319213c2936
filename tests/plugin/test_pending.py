"""``plugin.pending``: the tree sizes of rounds drafted but not yet recorded, recorded in round order once their
host copy is done, through kept pinned buffers and events on a device, never reading the device."""

from types import SimpleNamespace

import pytest
import torch

from treespec_sglang.plugin import pending as P
from treespec_sglang.plugin.pending import PendingSizes
from treespec_sglang.utils.syncs import count_ops


def req():
    """A request of a round, as far as its stats read it (no stream: a non-streamed request)."""
    return SimpleNamespace(customized_info=None)


class Event:
    """A CUDA event stand-in: recording it starts a copy, which is done when the test says."""

    made = []

    def __init__(self):
        self.done, self.recorded = False, 0
        Event.made.append(self)

    def record(self):
        self.done, self.recorded = False, self.recorded + 1

    def query(self):
        return self.done


def test_pending_tree_sizes_are_recorded_in_round_order_once_their_copy_is_done():
    """Rounds are recorded oldest first and only once ready; a round still in flight holds back the
    later ones (stats keep round order); native rows record nothing."""
    pending = PendingSizes()
    a, b = req(), req()
    talon = "talon"  # the policy's name
    pending.push([a, b], [talon, None], torch.tensor([5, 8]))
    copy = Event()
    pending.rounds.append(([a], [talon], torch.tensor([3]), copy))  # a copy in flight
    pending.push([a], [talon], torch.tensor([7]))
    pending.flush()
    assert a.customized_info["treespec_tree_sizes"] == [5] and b.customized_info is None
    copy.done = True
    pending.flush()
    assert a.customized_info["treespec_tree_sizes"] == [5, 3, 7] and not pending.rounds


def test_a_device_rounds_buffer_and_event_serve_a_later_round_of_its_size(monkeypatch):
    """The device branch (stood in on the CPU: a plain buffer for the pinned one, :class:`Event`): a round in
    flight keeps its buffer; a recorded round's buffer and event take a later round of the same size, up to
    ``KEEP`` spares per size; another size gets its own."""
    made = []
    monkeypatch.setattr(P, "_on_host", lambda t: False)
    monkeypatch.setattr(P, "_pinned", lambda t: made.append(torch.full_like(t, -1)) or made[-1])
    monkeypatch.setattr(torch.cuda, "Event", Event)
    Event.made = []
    pending, a, b = PendingSizes(), req(), req()
    pending.push([a], ["talon"], torch.tensor([5]))
    pending.push([a], ["talon"], torch.tensor([6]))  # the first copy still in flight: a buffer of its own
    assert len(made) == len(Event.made) == 2
    pending.flush()
    assert a.customized_info is None
    Event.made[0].done = True
    pending.flush()
    assert a.customized_info["treespec_tree_sizes"] == [5]
    pending.push([a], ["talon"], torch.tensor([7]))  # the recorded round's pair again
    assert len(made) == 2 and Event.made[0].recorded == 2 and pending.rounds[-1][2] is made[0]
    pending.push([a, b], ["talon", "salf"], torch.tensor([1, 2]))  # another size: a pair of its own
    assert len(made) == 3
    for e in Event.made:
        e.done = True
    pending.flush()
    assert a.customized_info["treespec_tree_sizes"] == [5, 6, 7, 1] and b.customized_info["treespec_tree_sizes"] == [2]
    for _ in range(PendingSizes.KEEP + 2):  # every one in flight at once, then all done
        pending.push([a], ["talon"], torch.tensor([4]))
    for e in Event.made:
        e.done = True
    pending.flush()
    assert len(pending.spare[(torch.Size([1]), torch.int64)]) == PendingSizes.KEEP
    assert a.customized_info["treespec_tree_sizes"][4:] == [4] * (PendingSizes.KEEP + 2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_device_sizes_arrive_through_reused_pinned_buffers():
    pending, a = PendingSizes(), req()
    for v in (3, 9):
        pending.push([a], ["talon"], torch.tensor([v], device="cuda"))
        torch.cuda.synchronize()
        pending.flush()
    (host, _), = pending.spare[(torch.Size([1]), torch.int64)]
    assert host.is_pinned() and a.customized_info["treespec_tree_sizes"] == [3, 9]


@pytest.mark.parametrize("device_branch", [False, True])
def test_recording_a_finished_round_reads_nothing_back(monkeypatch, device_branch):
    """The sizes a finished round recorded are in host memory (the tensor on the CPU, the pinned copy on a
    device: stood in here by a plain buffer): flushing them counts no host read."""
    if device_branch:
        monkeypatch.setattr(P, "_on_host", lambda t: False)
        monkeypatch.setattr(P, "_pinned", lambda t: torch.empty_like(t))
        monkeypatch.setattr(torch.cuda, "Event", Event)
        monkeypatch.setattr(Event, "made", [])
    pending, a = PendingSizes(), req()
    pending.push([a], ["salf"], torch.tensor([6]))
    for e in Event.made:
        e.done = True
    with count_ops() as c:
        pending.flush()
    assert a.customized_info["treespec_tree_sizes"] == [6] and c.reads == 0


def test_pushing_a_round_reads_nothing_from_the_device():
    pending = PendingSizes()
    with count_ops() as c:
        pending.push([req()], ["salf"], torch.tensor([4]))
    assert c.reads == 0
