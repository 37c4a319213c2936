"""Online per-depth calibration: it learns a known over-confidence, the corrected curve tracks the empirical
acceptance, updates make no host sync, and the accepted-node mask matches a loop."""

import pytest
import torch

from treespec_sglang.policies.calibration import DepthCalibration, accepted_nodes
from treespec_sglang.tree import DraftTree
from treespec_sglang.utils import count_host_syncs


def chains(g, bs, depth):
    """bs chains root -> 1 -> ... -> depth with random per-step draft probabilities."""
    n = depth + 1
    step = torch.rand(bs, depth, generator=g) * 0.8 + 0.2
    lp = torch.cat([torch.zeros(bs, 1), torch.cumsum(step.log(), 1)], 1)
    parents = torch.arange(-1, depth).expand(bs, n).clone()
    t = DraftTree(torch.ones(bs, n, dtype=torch.long), parents, torch.arange(n).expand(bs, n).clone(), lp,
                  torch.full((bs,), n), depth)
    return t, step


def simulate(g, tree, step, c):
    """The target accepts step d with probability c * draft step probability: P(node at depth d) = c^d P(v)."""
    ok = torch.rand(step.shape, generator=g) < c * step
    k = torch.cumprod(ok.long(), 1).sum(1)  # accepted length
    ar = torch.arange(step.shape[1] + 1)
    return torch.where(ar[None, :] <= k[:, None], ar[None, :], -1)


def test_learns_a_known_overconfidence():
    g = torch.Generator().manual_seed(0)
    cal = DepthCalibration(max_depth=4)
    assert torch.equal(cal.ratios(), torch.ones(5))
    for _ in range(60):
        tree, step = chains(g, 256, 3)
        cal.update(tree, simulate(g, tree, step, 0.5))
    r = cal.ratios()
    assert r[1] == pytest.approx(0.5, abs=0.04) and r[2] == pytest.approx(0.25, abs=0.04)
    assert r[3] == pytest.approx(0.125, abs=0.04) and r[4] == 1.0  # depth 4 never seen: the prior keeps 1
    # after learning, the corrected prediction tracks the empirical acceptance; the raw one over-predicts
    cal2 = DepthCalibration(max_depth=4)
    cal2.predicted, cal2.accepted = cal.predicted.clone(), cal.accepted.clone()
    for _ in range(20):
        tree, step = chains(g, 256, 3)
        cal2.update(tree, simulate(g, tree, step, 0.5))
    curve = cal2.curve()
    rows = [i for i, n in enumerate(curve["nodes"]) if n > 200]
    raw_err = sum(abs(curve["predicted"][i] - curve["accepted"][i]) for i in rows)
    cor_err = sum(abs(curve["corrected"][i] - curve["accepted"][i]) for i in rows)
    assert cor_err < 0.5 * raw_err, (raw_err, cor_err)


def test_a_calibrated_draft_keeps_ratios_near_one():
    g = torch.Generator().manual_seed(1)
    cal = DepthCalibration(max_depth=3)
    for _ in range(60):
        tree, step = chains(g, 256, 3)
        cal.update(tree, simulate(g, tree, step, 1.0))
    assert torch.allclose(cal.ratios()[1:4], torch.ones(3), atol=0.05)


def test_accepted_nodes_and_no_sync():
    t = DraftTree.from_lists([[5, 1, 2, 3], [7, 4]], [[-1, 0, 0, 2], [-1, 0]])
    path = torch.tensor([[0, 2, 3], [0, -1, -1]])
    assert accepted_nodes(t, path).tolist() == [[True, False, True, True], [True, False, False, False]]
    cal = DepthCalibration(max_depth=4)
    cal.update(t, path)  # moves the state to the device once
    with count_host_syncs() as c:
        cal.update(t, path)
        cal.weight(t)
    assert c.count == 0, c.ops
    with pytest.raises(ValueError, match="max_depth must be an integer >= 1"):
        DepthCalibration(max_depth=0)
