"""Online per-depth calibration: it learns a known over-confidence, the corrected curve tracks the empirical
acceptance, updates make no host sync, and the accepted-node mask matches a loop."""

import random

import pytest
import torch

from tests.helpers import calibration_weights, random_batch
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


def random_verify(rng, g, sizes, max_children=3):
    """A verified batch with path-monotone log-probs and an accepted path per request (root -> a random
    node): (tree, path ``[bs, depth_bound + 1]`` -1 padded)."""
    tree = random_batch(rng, sizes, vocab=9, max_children=max_children)
    bs, n = tree.tokens.shape
    lp = torch.full((bs, n), float("-inf"))
    for b, size in enumerate(sizes):
        lp[b, 0] = 0.0
        for i in range(1, size):
            lp[b, i] = lp[b, int(tree.parents[b, i])] + (torch.rand((), generator=g) * 0.9 + 0.1).log()
    tree = type(tree)(tree.tokens, tree.parents, tree.depth, lp, tree.size, tree.depth_bound)
    path = torch.full((bs, tree.depth_bound + 1), -1)
    for b, size in enumerate(sizes):
        chain, i = [], rng.randrange(size)
        while i >= 0:
            chain.append(i)
            i = int(tree.parents[b, i])
        path[b, :len(chain)] = torch.tensor(chain[::-1])
    return tree, path


@pytest.mark.parametrize("max_depth", [1, 2, 3, 6])
def test_weight_is_the_learned_ratio_of_each_nodes_depth(max_depth):
    """After a few verifies, every node's weight is (accepted + prior) / (predicted + prior) of its own
    depth (deeper than max_depth: max_depth's; the root: 1), with the counts kept by a plain loop: predicted
    sums the path probabilities of the verified non-root nodes of a depth, accepted counts those on the path."""
    rng, g = random.Random(max_depth), torch.Generator().manual_seed(max_depth)
    cal = DepthCalibration(max_depth=max_depth)
    predicted, accepted = [0.0] * (max_depth + 1), [0.0] * (max_depth + 1)
    for k in range(6):  # bushy trees and chains (deep nodes)
        tree, path = random_verify(rng, g, [rng.randint(1, 9) for _ in range(4)], max_children=1 + 2 * (k % 2))
        cal.update(tree, path)
        for b in range(tree.bs):
            on_path = set(path[b].tolist())
            for i in range(1, int(tree.size[b])):
                d = min(int(tree.depth[b, i]), max_depth)
                predicted[d] += float(tree.logprob[b, i].double().exp())
                accepted[d] += float(i in on_path)
    assert cal.predicted.tolist() == pytest.approx(predicted, rel=1e-6)
    assert cal.accepted.tolist() == accepted
    tree, _ = random_verify(rng, g, [9, 4, 1, 7], max_children=1)  # chains: depths 0..8
    assert int(tree.depth.max()) > max_depth  # the shared deepest bucket is exercised
    want = calibration_weights(tree, accepted, predicted, cal.prior, max_depth)  # [bs][n_nodes]
    got = cal.weight(tree)  # [bs, n_nodes]
    assert len({round(w, 6) for row in want for w in row}) == max_depth + 1  # every bucket its own ratio
    for b in range(tree.bs):
        for i in range(int(tree.size[b])):
            assert float(got[b, i]) == pytest.approx(want[b][i], rel=1e-5), (b, i, int(tree.depth[b, i]))
