"""The reference engine's round plan under the batch's token cap: kept trees, ragged rows, opt-out, auto T,
and the calibration's weights reaching the allocation (against a brute force over closed subsets of values
restated from their definition)."""

import math
import random

import pytest
import torch

from tests.helpers import best_allocation, calibration_weights, kept_indices, oracle_node_values, random_batch
from treespec_sglang.engine.token_cap import AutoTokenCap, plan_round
from treespec_sglang.policies.token_cap import allocate_batch
from treespec_sglang.policies.calibration import DepthCalibration
from treespec_sglang.tree import DraftTree


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("total", [4, 9, 30])
def test_plan_round_keeps_the_allocation_and_its_rows_are_the_kept_nodes(seed, total):
    tree = random_batch(random.Random(seed), [7, 3, 9, 5], vocab=30)
    g = torch.Generator().manual_seed(seed)
    tree = tree.__class__(**{**tree.__dict__, "logprob": torch.cumsum(-torch.rand(tree.tokens.shape, generator=g), 1)})
    keep = allocate_batch(tree, total)
    out, rows = plan_round(tree, total)
    sizes = keep.sum(1)
    assert out.n_nodes == int(sizes.max()) and torch.equal(out.size, sizes)
    oracle = [b * out.n_nodes + i for b in range(tree.bs) for i in range(int(sizes[b]))]  # request-major
    assert rows.tolist() == oracle
    for b in range(tree.bs):  # the kept tokens, in their original order
        assert out.tokens[b, :int(sizes[b])].tolist() == tree.tokens[b][keep[b]].tolist()


def test_an_opted_out_request_keeps_its_whole_tree():
    tree = random_batch(random.Random(7), [6, 6, 6], vocab=30)
    out, _ = plan_round(tree, 4, shares=[True, False, True])
    assert out.size.tolist()[1] == 6 and out.size.tolist()[0] == 1 and out.size.tolist()[2] == 1


def test_auto_token_cap_probes_scale_the_chosen_total():
    tree = random_batch(random.Random(3), [8, 8, 8, 8], vocab=30)
    flat = AutoTokenCap(torch.full((33,), 10.0))  # verifying more is free: every candidate
    assert int(plan_round(tree, flat)[0].size.sum()) == int(tree.size.sum())
    half = AutoTokenCap(torch.full((33,), 10.0), probe=0.5)
    assert int(plan_round(tree, half)[0].size.sum()) == round(0.5 * int(tree.size.sum()))
    for short in ([10.0, 10.0], [9.0, 10.0, 10.0]):  # a line shorter than the batch's nodes goes on flat past its end
        n_all = int(tree.size.sum())
        got = plan_round(tree, AutoTokenCap(torch.tensor(short)))
        want = plan_round(tree, AutoTokenCap(torch.tensor(short + [short[-1]] * (4 * 8 + 1 - len(short)))))
        assert int(got[0].size.sum()) == n_all and torch.equal(got[0].tokens, want[0].tokens)
        assert torch.equal(got[1], want[1])
    with pytest.raises(ValueError, match="probe must be > 0"):
        AutoTokenCap(torch.ones(4), probe=0.0)
    with pytest.raises(ValueError, match=r"ms must be \[T_max \+ 1\]"):
        AutoTokenCap(torch.ones(1))
    with pytest.raises(ValueError, match=r"min_prob must be in \[0, 1\]"):
        AutoTokenCap(torch.ones(4), min_prob=1.5)


def frozen_calibration(accepted, predicted, max_depth):
    """A DepthCalibration holding the given per-depth counts (``[max_depth + 1]`` lists)."""
    cal = DepthCalibration(max_depth=max_depth)
    cal.accepted = torch.tensor(accepted, dtype=torch.float64)
    cal.predicted = torch.tensor(predicted, dtype=torch.float64)
    return cal


def path_logprobs(tree, g):
    """The tree with random path log-probs: each node its parent's + log U(0.05, 1)."""
    bs, n = tree.tokens.shape
    lp = torch.full((bs, n), float("-inf"))
    for b in range(bs):
        lp[b, 0] = 0.0
        for i in range(1, int(tree.size[b])):
            lp[b, i] = lp[b, int(tree.parents[b, i])] + (torch.rand((), generator=g) * 0.95 + 0.05).log()
    return type(tree)(tree.tokens, tree.parents, tree.depth, lp, tree.size, tree.depth_bound)


def test_plan_round_keeps_the_calibrated_best_nodes_on_a_known_tree():
    """Chain .9 -> .85 -> .8 beside .5 and .45 (root children), T = 3: uncalibrated, the chain's first two
    nodes; with depth 1 x2 ((2 + 2) / (0 + 2)), depth 2 x0.05 ((0 + 2) / (38 + 2)) and depth 3 x4, the .9
    node and its .5 sibling (values 1.8, 1.0, .9 at depth 1 against .0425 at depth 2)."""
    t = DraftTree.from_lists([[9, 1, 2, 3, 4, 5]], [[-1, 0, 1, 2, 0, 0]])
    t = type(t)(t.tokens, t.parents, t.depth, torch.tensor([[1.0, 0.9, 0.85, 0.8, 0.5, 0.45]]).log(), t.size,
                t.depth_bound)
    assert plan_round(t, 3)[0].tokens.tolist() == [[9, 1, 2]]
    cal = frozen_calibration([0.0, 2.0, 0.0, 6.0], [0.0, 0.0, 38.0, 0.0], max_depth=3)
    assert plan_round(t, 3, cal)[0].tokens.tolist() == [[9, 1, 4]]


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("total", [5, 8, 12])
def test_plan_round_keeps_the_best_nodes_under_the_calibration(seed, total):
    """plan_round with a per-depth calibration keeps, per request, an ancestor-closed set whose calibrated
    value (path probability x its depth's ratio, capped by the parent: a plain loop) is the brute-force
    optimum over closed subsets under T; the calibration changes which nodes that is in some cases."""
    rng, g = random.Random(seed), torch.Generator().manual_seed(seed)
    tree = path_logprobs(random_batch(rng, [rng.randint(1, 8) for _ in range(3)], vocab=9, max_children=2), g)
    max_depth = 3
    # ratios per depth far from 1 and from each other: depth 1 x1.5, depth 2 x0.1, depth >= 3 x3
    accepted, predicted = [0.0, 1.0, 0.0, 4.0], [0.0, 0.0, 18.0, 0.0]
    cal = frozen_calibration(accepted, predicted, max_depth)
    weights = calibration_weights(tree, accepted, predicted, cal.prior, max_depth)  # [bs][n_nodes]
    values = oracle_node_values(tree, weights)
    out, rows = plan_round(tree, total, cal)
    kept = kept_indices(tree, out)  # [bs] source nodes kept
    assert sum(len(k) for k in kept) <= max(total, tree.bs) and rows.shape == (sum(len(k) for k in kept),)
    assert all(k[0] == 0 for k in kept)  # every root
    best, _ = best_allocation(tree, values, max(total, tree.bs))
    got = sum(values[b][i] for b, k in enumerate(kept) for i in k[1:])
    assert got == pytest.approx(best, abs=1e-6)



@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("calibrated", [False, True])
def test_auto_token_cap_maximises_tokens_per_ms_under_opt_outs_and_the_calibration(seed, calibrated):
    """T chosen by an AutoTokenCap with an opted-out request and a calibration: the kept trees' expected tokens
    (one per root + the kept nodes' values) per ms of ``ms[T]`` is the best over every T of the brute-force
    allocation under it, the opted-out tree whole (against the definitions: values from a plain loop)."""
    rng, g = random.Random(seed), torch.Generator().manual_seed(seed)
    tree = path_logprobs(random_batch(rng, [6, 6, 6], vocab=9, max_children=2), g)
    accepted, predicted = [0.0, 1.0, 0.0, 4.0], [0.0, 0.0, 18.0, 0.0]
    cal = frozen_calibration(accepted, predicted, 3) if calibrated else None
    values = oracle_node_values(tree, calibration_weights(tree, accepted, predicted, cal.prior, 3) if cal else None)
    shares = [True, False, True]
    floor = [1, int(tree.size[1]), 1]
    ms = torch.arange(19, dtype=torch.float32) * 0.5 + 4.0  # 4 ms a round + 0.5 ms a token

    def rate(t):
        best = best_allocation(tree, values, t, floor=floor)
        return -math.inf if best is None else (tree.bs + best[0]) / float(ms[t])

    out, _ = plan_round(tree, AutoTokenCap(ms), cal, shares)
    kept = kept_indices(tree, out)
    got = (tree.bs + sum(values[b][i] for b, k in enumerate(kept) for i in k[1:])) / float(ms[int(out.size.sum())])
    assert len(kept[1]) == int(tree.size[1])  # the opted-out tree whole
    assert got == pytest.approx(max(rate(t) for t in range(tree.bs, int(tree.size.sum()) + 1)), abs=1e-6)


def test_a_probe_factor_scales_the_chosen_total():
    """Every probe factor scales T, 2.0 included (a steep line chooses the roots alone: 4 -> 8)."""
    tree = random_batch(random.Random(3), [8, 8, 8, 8], vocab=30)
    steep = torch.arange(33, dtype=torch.float32)  # no fixed cost: the 4 roots alone earn the most per ms
    assert int(plan_round(tree, AutoTokenCap(steep))[0].size.sum()) == 4
    for probe, want in ((2.0, 8), (1.5, 6)):
        assert int(plan_round(tree, AutoTokenCap(steep, probe=probe))[0].size.sum()) == want


def test_the_token_cap_plan_scales_a_fixed_cap_and_feeds_an_auto_one_its_rounds():
    """A fixed T shrinks with the running requests (ceil(T * running / bs)); "auto" asks its round-cost line for
    each round's AutoTokenCap and reports every finished round to it; None is no cap."""
    from treespec_sglang.engine.token_cap import AutoTokenCap, TokenCapPlan

    fixed = TokenCapPlan(10, bs=4, max_nodes=8)
    assert [fixed.cap(r) for r in (4, 3, 1)] == [10, 8, 3]
    assert TokenCapPlan(None, bs=4, max_nodes=8).cap(2) is None
    with pytest.raises(ValueError, match=r'^token_cap="auto" needs a round-cost line \(cost=\)$'):
        TokenCapPlan("auto", bs=4, max_nodes=8)

    class Line:  # a RoundCost stand-in that records what the plan asks and reports
        seen = []

        def costs(self, t_max):
            self.seen.append(("costs", t_max))
            return torch.arange(t_max + 1, dtype=torch.float32)

        def probe(self):
            return 1.25

        def marginal_value(self):
            return 0.4

        def observe(self, verified, ms, running, committed, steps):
            self.seen.append(("observe", verified, ms, running, committed, steps))

    auto = TokenCapPlan("auto", bs=4, max_nodes=8, cost=Line(), prune=0.5)
    cap = auto.cap(3)
    assert isinstance(cap, AutoTokenCap) and cap.probe == 1.25 and cap.min_prob == pytest.approx(0.2)
    assert cap.ms.shape == (25,)  # 3 running x 8 nodes + 1
    auto.observe(17, 42.0, 3, 9, 4)
    assert Line.seen == [("costs", 24), ("observe", 17, 42.0, 3, 9, 4)]
    unpruned = TokenCapPlan("auto", bs=4, max_nodes=8, cost=Line())  # prune's default: the draft is not pruned
    assert unpruned.cap(3).min_prob == 0.0
