"""``bench/select_host_cost.py``: what it stubs is what it says it stubs (host only), and ``--launch`` runs the
selection graph's body and the unlink kernel for real (an earlier version timed an empty graph)."""

import argparse
from unittest import mock

import pytest

pytest.importorskip("triton")
from bench import select_host_cost  # noqa: E402
from treespec_sglang.plugin import select_graph, unlink_kernel  # noqa: E402


@pytest.mark.parametrize("launch", [False, True])
def test_graph_mode_runs_the_graph_body_and_the_unlink_only_with_launch(launch):
    a = argparse.Namespace(topk=2, steps=3, N=6, repeats=2, device="cpu", launch=launch, unlink=True)
    bodies, unlinks = [], []
    real_body, real_unlink = select_graph.SelectionGraph._body, unlink_kernel.launch_unlink
    with mock.patch.object(select_graph.SelectionGraph, "_body", lambda self: bodies.append(1) or real_body(self)), \
            mock.patch.object(unlink_kernel, "launch_unlink", lambda *x: unlinks.append(1) or real_unlink(*x)), \
            mock.patch.object(select_graph, "GRAPHS", {}):
        us, ops, reads, copies = select_host_cost.measure("graph", 3, a, True)
    assert (reads, copies) == (0, 0) and us > 0
    # steady rounds: the warm-up, the counted round and the timed repeats (plus the graph's own eager first body)
    assert (len(bodies) > 0) == launch and (len(unlinks) == 2 + a.repeats) == launch
