"""Tree sizes of the rounds drafted but not yet recorded, read back without stalling the device (hook body;
imports nothing of sglang): a round's ``[bs]`` sizes are copied to pinned host memory behind an event at draft
time and recorded in the request stats (:func:`.stats.record_rounds`) once the copy is seen done."""

from __future__ import annotations

import collections
from typing import Deque, Dict

import torch

from .stats import record_rounds
from ..utils.syncs import read_host

__all__ = ["PendingSizes"]


def _on_host(t: torch.Tensor) -> bool:
    """Whether ``t`` is in host memory already (the CPU): its values are ready when its ops have returned."""
    return t.device.type == "cpu"


def _pinned(t: torch.Tensor) -> torch.Tensor:
    """An empty pinned host buffer of ``t``'s shape and dtype (an asynchronous device->host copy's target)."""
    return torch.empty(t.shape, dtype=t.dtype, pin_memory=True)


class PendingSizes:
    """Tree sizes of the rounds drafted but not yet recorded, read back without stalling the device.

    At draft time the ``[bs]`` sizes are copied to the host asynchronously (pinned memory, an event
    after the copy); :meth:`flush` records every round whose copy has finished, oldest first. It runs
    when SGLang resolves a round's accepted tokens (by then that round's draft is done on the stream) and
    before each draft. On the CPU the copy is the tensor itself and is ready at once. A recorded round's
    pinned buffer and event are used again by a later round of its batch size (allocating pinned memory and
    an event cost a CUDA host ~15 us a round).
    """

    KEEP = 4  # spare (pinned buffer, event) pairs kept per batch size

    def __init__(self):
        self.rounds: Deque[tuple] = collections.deque()  # (reqs, policies, host sizes [bs], event or None)
        self.spare: Dict[tuple, list] = {}  # (shape, dtype) -> [(pinned buffer, event)] of recorded rounds

    def push(self, reqs, policies, sizes) -> None:
        """One round's ``[bs]`` tree sizes for ``reqs`` (a tensor, or a host list of ints), recorded under
        ``policies`` (names; None: not ours)."""
        if type(sizes) is list or _on_host(sizes):
            self.rounds.append((reqs, policies, sizes, None))
            return
        spare = self.spare.get((sizes.shape, sizes.dtype))
        host, event = spare.pop() if spare else (_pinned(sizes), torch.cuda.Event())
        host.copy_(sizes, non_blocking=True)
        event.record()
        self.rounds.append((reqs, policies, host, event))

    def flush(self) -> None:
        while self.rounds and (self.rounds[0][3] is None or self.rounds[0][3].query()):
            reqs, policies, host, event = self.rounds.popleft()
            # a host list, or a finished host copy: no sync (read_host refuses a device tensor)
            record_rounds(reqs, policies, "treespec_tree_sizes", host if type(host) is list else read_host(host))
            if event is not None:
                spare = self.spare.setdefault((host.shape, host.dtype), [])
                if len(spare) < self.KEEP:
                    spare.append((host, event))
