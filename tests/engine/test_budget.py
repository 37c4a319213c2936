"""The reference engine's round plan under a batch verify budget: kept trees, ragged rows, opt-out, auto T."""

import random

import pytest
import torch

from tests.helpers import random_batch
from treespec_sglang.engine.budget import AutoBudget, plan_round
from treespec_sglang.engine.cost import CostCurve, RoundCost
from treespec_sglang.policies.batch_budget import allocate_batch


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("total", [4, 9, 30])
def test_plan_round_keeps_the_allocation_and_its_rows_are_the_kept_nodes(seed, total):
    tree = random_batch(random.Random(seed), [7, 3, 9, 5], vocab=30)
    tree = tree.__class__(**{**tree.__dict__, "logprob": torch.cumsum(-torch.rand(tree.tokens.shape), 1)})
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


def test_auto_budget_probes_scale_the_chosen_total():
    tree = random_batch(random.Random(3), [8, 8, 8, 8], vocab=30)
    flat = AutoBudget(torch.full((33,), 10.0))  # verifying more is free: every candidate
    assert int(plan_round(tree, flat)[0].size.sum()) == int(tree.size.sum())
    half = AutoBudget(torch.full((33,), 10.0), probe=0.5)
    assert int(plan_round(tree, half)[0].size.sum()) == round(0.5 * int(tree.size.sum()))
    with pytest.raises(ValueError, match="probe must be > 0"):
        AutoBudget(torch.ones(4), probe=0.0)
    with pytest.raises(ValueError, match=r"ms must be \[T_max \+ 1\]"):
        AutoBudget(torch.ones(1))
    with pytest.raises(ValueError, match=r"min_prob must be in \[0, 1\]"):
        AutoBudget(torch.ones(4), min_prob=1.5)


def test_round_cost_prior_comes_from_the_startup_curve():
    curve = CostCurve((16, 64), (40.0, 88.0), (4,), (2.0,))
    rc = RoundCost.from_curve(curve)
    assert rc.slope == pytest.approx(1.0) and rc.level == pytest.approx(48.0) and rc.step == pytest.approx(2.0)
