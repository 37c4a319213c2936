"""Per-round stats bookkeeping that needs no running SGLang."""

import torch

from treespec_sglang.plugin.stats import PendingSizes
from treespec_sglang.utils.syncs import count_ops


class Req:
    def __init__(self):
        self.customized_info = None


def test_pending_tree_sizes_are_recorded_in_round_order_once_their_copy_is_done():
    """Rounds are recorded oldest first and only once ready; a round still in flight holds back the
    later ones (stats keep round order); native rows record nothing."""
    pending = PendingSizes()
    a, b = Req(), Req()
    talon = "talon"  # the policy's name
    pending.push([a, b], [talon, None], torch.tensor([5, 8]))
    flag = {"done": False}
    pending.rounds.append(([a], [talon], torch.tensor([3]), lambda: flag["done"]))  # a copy in flight
    pending.push([a], [talon], torch.tensor([7]))
    pending.flush()
    assert a.customized_info["treespec_tree_sizes"] == [5] and b.customized_info is None
    flag["done"] = True
    pending.flush()
    assert a.customized_info["treespec_tree_sizes"] == [5, 3, 7] and not pending.rounds


def test_pushing_a_round_reads_nothing_from_the_device():
    pending = PendingSizes()
    with count_ops() as c:
        pending.push([Req()], ["salf"], torch.tensor([4]))
    assert c.reads == 0
