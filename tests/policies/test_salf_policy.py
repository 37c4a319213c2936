"""SALF edge parameters against the plain heap-based Alg. 2 (``tests/policies/oracles.py``)."""

import pytest
import torch

from tests.helpers import PathDraft
from tests.policies import oracles
from treespec_sglang.policies import grow_tree

EDGES = [  # budget 1 (the root alone), 2 (one child), max_depth 1 (the root's children only), 2, B 1
    {"policy": "salf", "budget": 1, "th": 0.1},
    {"policy": "salf", "budget": 2, "batch": 1, "th": 0.1},
    {"policy": "salf", "budget": 6, "batch": 2, "th": 0.05, "max_depth": 1},
    {"policy": "salf", "budget": 8, "batch": 3, "th": 0.05, "max_depth": 2},
    {"policy": "salf", "budget": 7, "batch": 1, "th": 0.02},
    {"policy": "salf", "budget": 9, "batch": 4, "th": 0.0, "max_depth": 3},
]


@pytest.mark.parametrize("seed", range(3))
def test_salf_edge_parameters_in_one_batch_equal_alg2(seed):
    draft = PathDraft(12, seed=30 + seed, sharpness=1.0 + seed)
    roots = [1, 3, 5, 7, 9, 11]
    tree = grow_tree(EDGES, torch.tensor(roots), draft.root(torch.tensor(roots)), draft.expand)
    tree.check()
    for b, (s, r) in enumerate(zip(EDGES, roots)):
        want = oracles.salf(draft, r, s["budget"], s.get("batch", min(10, s["budget"])), s["th"], s.get("max_depth"))
        assert set(tree.paths()[b]) == want, s
    # max_depth 1, B 2: the root's children are popped two at a time while their gain holds, none expanded (the
    # first pop's childless nodes stopped the search at 3: D counted only nodes it could expand)
    assert tree.size.tolist()[:3] == [1, 2, 6]


@pytest.mark.parametrize("seed", range(4))
def test_a_budget_of_three_can_take_two_children_of_one_node(seed):
    """N 3 alone in its batch: every node pushes its top N - 1 = 2 children, both of which the tree may need
    (root + two siblings), against Alg. 2."""
    draft = PathDraft(10, seed=60 + seed, sharpness=0.3)
    roots = [2, 4]
    spec = {"policy": "salf", "budget": 3, "batch": 1, "th": 0.01}
    tree = grow_tree([spec] * 2, torch.tensor(roots), draft.root(torch.tensor(roots)), draft.expand)
    for b, r in enumerate(roots):
        assert set(tree.paths()[b]) == oracles.salf(draft, r, 3, 1, 0.01)



class PeakedRoot(PathDraft):
    """The root's children .9, .03, .025, .02, .015, .01; every other distribution uniform over 6."""

    def logprobs(self, path):
        return (torch.tensor([0.9, 0.03, 0.025, 0.02, 0.015, 0.01]) if len(path) == 1
                else torch.full((6,), 1 / 6)).log()


@pytest.mark.parametrize("th", [0.0, 0.01])
def test_nodes_at_max_depth_enter_the_tree_and_the_search_goes_on(th):
    """Budget 4, B 1, max_depth 1: the exact top 4 at depth <= 1 is the root and its three best children (Def. B.1,
    Thm. 2-3 at th = 0). Each pop is a childless max-depth node; the search stopped at the first of them (2 nodes)."""
    draft = PeakedRoot(6)
    spec = {"policy": "salf", "budget": 4, "batch": 1, "th": th, "max_depth": 1}
    tree = grow_tree([spec], torch.tensor([0]), draft.root(torch.tensor([0])), draft.expand)
    assert set(tree.paths()[0]) == {(0,), (0, 0), (0, 1), (0, 2)} == oracles.salf(draft, 0, 4, 1, th, 1)


def test_no_max_depth_is_no_depth_bound():
    """``max_depth`` None: a chain as deep as the budget allows (it was 64 deep at most)."""
    draft = PathDraft(4, seed=0, sharpness=40.0)  # near one-hot: the best path is a chain
    tree = grow_tree([{"policy": "salf", "budget": 80, "batch": 1, "th": 0.0}], torch.tensor([1]),
                     draft.root(torch.tensor([1])), draft.expand)
    assert int(tree.depth.max()) > 64 and set(tree.paths()[0]) == oracles.salf(draft, 1, 80, 1, 0.0)


class TwoStepDraft(PathDraft):
    """Vocab 3: the root's children .45 / .40 / .15, the best child's own best child .95 (so .4275 beats the
    second child .40), every other distribution .5 / .3 / .2."""

    def logprobs(self, path):
        p = {(1,): [0.45, 0.40, 0.15], (1, 0): [0.95, 0.03, 0.02]}.get(tuple(path), [0.5, 0.3, 0.2])
        return torch.tensor(p).log()


def test_a_full_g_stops_on_the_gain_of_the_nodes_above_its_nth_best():
    """N 3, B 2, th .5: the first pop takes .45 and .40, G is full and its N-th best is .40, so D = {.45}
    whose gain .45 < th stops the search: the tree is the root and the two children (by hand and Alg. 2),
    although expanding .40 too would have found .4275. A budget-9 row in the same batch (N 9 for the batch)
    keeps its own N-th best."""
    draft = TwoStepDraft(3)
    specs = [{"policy": "salf", "budget": 3, "batch": 2, "th": 0.5}, {"policy": "salf", "budget": 9, "batch": 2,
                                                                       "th": 0.5}]
    tree = grow_tree(specs, torch.tensor([1, 1]), draft.root(torch.tensor([1, 1])), draft.expand)
    assert set(tree.paths()[0]) == {(1,), (1, 0), (1, 1)} == oracles.salf(draft, 1, 3, 2, 0.5)
    assert set(tree.paths()[1]) == oracles.salf(draft, 1, 9, 2, 0.5)


class FixedDraft(PathDraft):
    """Vocab 3, every distribution .5 / .3 / .2 (log .5 and back is exactly .5 in float32)."""

    def logprobs(self, path):
        return torch.tensor([0.5, 0.3, 0.2]).log()


def test_a_gain_equal_to_th_continues_the_search():
    """Line 13 stops on gain < th: popping .5 with th .5 expands it, then .3 (gain .3) stops. By hand: the
    root, .5 and .3."""
    draft = FixedDraft(3)
    tree = grow_tree([{"policy": "salf", "budget": 5, "batch": 1, "th": 0.5}], torch.tensor([1]),
                     draft.root(torch.tensor([1])), draft.expand)
    assert set(tree.paths()[0]) == {(1,), (1, 0), (1, 1)}


def test_the_frontier_is_minus_one_padded_and_empty_once_done_and_the_tree_keeps_its_depth_bound():
    from treespec_sglang.policies import parse_spec
    from treespec_sglang.policies.salf import SalfPolicy

    draft = PathDraft(12, seed=5, sharpness=1.5)
    specs = [{"policy": "salf", "budget": 3, "batch": 2, "th": 0.9, "max_depth": 3}, {"policy": "salf", "budget": 12,
                                                                                        "batch": 4,
                                                                       "th": 0.05, "max_depth": 4}]
    pol = SalfPolicy([parse_spec(s) for s in specs], torch.device("cpu"))
    roots = torch.tensor([1, 2])
    fr = pol.start(roots, draft.root(roots))
    partial = 0
    for _ in range(pol.max_steps):
        assert ((fr >= 1) | (fr == -1)).all()
        if not (fr >= 0).any():
            break
        partial += int(((fr >= 0).any(-1) & (fr == -1).any(-1)).any())
        fr = pol.step(draft.expand(pol.tree, fr))
    assert fr[0].tolist() == [-1] * fr.shape[1] and partial > 0
    assert pol.finish().depth_bound == pol.depth_bound == 4  # min(the rows' largest max_depth, N - 1)


@pytest.mark.parametrize("vocab, budget, batch", [(4, 20, 4), (4, 40, 5), (5, 64, 10), (6, 50, 1)])
def test_exact_value_ties_follow_alg2s_queue_order(vocab, budget, batch):
    """Integer path values tie across parents and depths; with queues of 17+ entries (where an unstable sort
    reorders ties) the tree still equals the heap-based Alg. 2's, whose ties go to the older entry, then to
    the earlier parent and the better child."""
    draft = oracles.IntegerDraft(vocab)
    roots = torch.tensor([1])
    tree = grow_tree([{"policy": "salf", "budget": budget, "batch": batch, "th": 0.0}], roots, draft.root(roots),
                     draft.expand)
    assert set(tree.paths()[0]) == oracles.salf(draft, 1, budget, batch, 0.0)
