"""The batch's token cap at its edges, each against hand-worked values: tie order (shallower, then lower
index) on trees long enough for an unstable sort to reorder ties, non-finite draft values, the cost curve's
length, and each input of ``best_total`` (cap, floor, weight, forced
nodes) moving the chosen token cap."""

import math

import pytest
import torch

from treespec_sglang.policies.token_cap import allocate_batch, best_total, node_values, select_best, split_batch_option
from treespec_sglang.tree import DraftTree


def tree_of(parents, probs):
    """One request's tree with these parents and path probabilities (root first, prob 1)."""
    t = DraftTree.from_lists([list(range(len(parents)))], [parents])
    lp = torch.tensor([probs], dtype=torch.float32).log()
    return type(t)(t.tokens, t.parents, t.depth, lp, t.size, t.depth_bound)


STAR = tree_of([-1, 0, 0, 0], [1.0, 0.8, 0.4, 0.2])  # a root and three children


def oracle_select(values, depth, optional, count):
    """The ``count`` best optional entries of the whole batch by a plain sort: value descending, then depth
    ascending, then flat index ascending."""
    flat = [(-values[b][i], depth[b][i], b * len(values[0]) + i, b, i)
            for b in range(len(values)) for i in range(len(values[0])) if optional[b][i]]
    keep = [[False] * len(values[0]) for _ in values]
    for *_, b, i in sorted(flat)[:max(count, 0)]:
        keep[b][i] = True
    return keep


@pytest.mark.parametrize("seed", range(4))
def test_select_best_breaks_ties_by_depth_then_index_on_long_rows(seed):
    """Few distinct values and depths over 2 x 24 entries: most picks are ties, ordered shallower first,
    then by index (an unstable sort reorders ties from 17 entries on)."""
    g = torch.Generator().manual_seed(seed)
    values = torch.tensor([0.25, 0.5])[torch.randint(0, 2, (2, 24), generator=g)]
    depth = torch.randint(1, 4, (2, 24), generator=g)
    optional = torch.rand(2, 24, generator=g) < 0.8
    for count in (1, 5, 13, 30):
        got = select_best(values, depth, optional, count)
        assert got.tolist() == oracle_select(values.tolist(), depth.tolist(), optional.tolist(), count), count


def test_equal_siblings_are_kept_in_index_order():
    """A root with 20 equally likely children: the token cap keeps the first ones."""
    t = tree_of([-1] + [0] * 20, [1.0] + [0.5] * 20)
    assert allocate_batch(t, 6).tolist() == [[True] * 6 + [False] * 15]


def test_equal_values_are_kept_shallowest_first_on_a_long_chain():
    """A chain of 20 nodes all of path probability .5 below the root: 5 tokens keep the first four."""
    t = tree_of([-1] + list(range(20)), [1.0] + [0.5] * 20)
    keep = allocate_batch(t, 5, cap=torch.tensor([21]))
    assert keep.tolist() == [[True] * 5 + [False] * 16]


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_non_finite_draft_value_is_worth_nothing(bad):
    """A NaN / +inf path log-prob counts as probability 0, and caps its subtree at 0 too."""
    t = DraftTree.from_lists([[0, 1, 2, 3]], [[-1, 0, 1, 0]])
    lp = torch.tensor([[0.0, bad, -1.0, math.log(0.3)]])
    t = type(t)(t.tokens, t.parents, t.depth, lp, t.size, t.depth_bound)
    v = node_values(t)
    assert v[0, 0] == math.inf and v[0, 1:].tolist() == pytest.approx([0.0, 0.0, 0.3])
    assert allocate_batch(t, 2).tolist() == [[True, False, False, True]]


def test_a_request_without_the_key_shares_the_token_cap():
    spec = {"policy": "talon", "budget": 8}
    assert split_batch_option(spec) == (spec, True)
    assert split_batch_option("talon") == ("talon", True)
    assert split_batch_option(dict(spec, token_cap=True)) == (spec, True)




# best_total on STAR (one root, children .8 / .4 / .2): T = 1 + the j best children, expected tokens
# 1 + their sum, rate = expected / cost[T]; the worked rates are in each case's comment.
@pytest.mark.parametrize("cost, want", [
    ([1.0, 1.0, 1.0], 2),  # T <= 2 (the curve's end): 1/1, 1.8/1 -> 2
    ([1.0, 1.0, 1.9], 1),  # 1/1 > 1.8/1.9 -> 1
    ([1.0, 1.0, 1.0, 1.0, 1.0], 4),  # everything fits: 2.4/1 -> 4
])
def test_best_total_stays_on_the_cost_curve(cost, want):
    assert int(best_total(STAR, torch.tensor(cost))) == want


def test_best_total_respects_the_cap():
    """Cap 2 (root + one child) on a flat curve: T = 2, not the 4 an uncapped tree would take."""
    assert int(best_total(STAR, torch.ones(8), cap=torch.tensor([2]))) == 2
    assert int(best_total(STAR, torch.ones(8))) == 4


def test_best_total_never_goes_below_the_floor():
    """Tokens past the first cost 100x (200x for the fourth): T = 1 alone, a floor of 3 forces root + .8 + .4
    and the .2 child is not worth 2.4 / 200 < 2.2 / 100."""
    cost = torch.tensor([1.0, 1.0, 100.0, 100.0, 200.0])
    assert int(best_total(STAR, cost)) == 1
    assert int(best_total(STAR, cost, floor=torch.tensor([3]))) == 3


def test_best_total_uses_the_weight():
    """Rates 1/1, 1.8/1.5 = 1.2, 2.2/2 = 1.1 -> T = 2; weighted x0.1: 1, 1.08/1.5, 1.12/2 -> T = 1."""
    cost = torch.tensor([1.0, 1.0, 1.5, 2.0, 100.0])
    assert int(best_total(STAR, cost)) == 2
    assert int(best_total(STAR, cost, weight=torch.tensor([0.1]))) == 1


@pytest.mark.parametrize("c3, want", [
    (2.0, 2),  # 1.8/1 > 2.2/2
    (1.15, 3),  # 1.8/1 < 2.2/1.15 = 1.91
])
def test_best_total_counts_the_forced_nodes_value(c3, want):
    """Floor 2 forces the .8 child (T >= 2, expected 1.8 there); the .4 child costs c3 at T = 3."""
    cost = torch.tensor([1.0, 1.0, 1.0, c3, 100.0])
    assert int(best_total(STAR, cost, floor=torch.tensor([2]))) == want
