"""TALON edge parameters against the plain Alg. 2 (``tests/policies/oracles.py``)."""

import pytest
import torch

from tests.helpers import PathDraft
from tests.policies import oracles
from treespec_sglang.policies import grow_tree


@pytest.mark.parametrize("mu,K,N", [(1.0, 3, 9), (1.0, 1, 5), (0.0, 2, 7), (0.5, 4, 2), (0.2, 1, 1)])
def test_talon_edge_parameters_equal_alg2(mu, K, N):
    """mu 1 (only each layer's anchor passes its own gate: a chain below the top-K root), mu 0 (no gate),
    K 1, and budgets 1-2 (the root alone / one child)."""
    draft = PathDraft(25, seed=int(mu * 10) + K + N, sharpness=1.5)
    roots = [2, 9]
    tree = grow_tree([{"policy": "talon", "budget": N, "topk": K, "mu": mu}] * 2, torch.tensor(roots),
                     draft.root(torch.tensor(roots)), draft.expand)
    tree.check()
    for b, r in enumerate(roots):
        ref = oracles.talon(draft, r, N, K, mu)
        assert set(tree.paths()[b]) == {ref.path(i) for i in range(len(ref.tok))}
        assert int(tree.size[b]) == len(ref.tok)


def test_a_budget_filled_by_the_root_layer_drafts_nothing_more():
    """N = K + 1: layer 1 fills the budget, so the frontier is empty and the draft is never called again."""
    draft = PathDraft(25, seed=3, sharpness=1.0)
    roots = torch.tensor([1, 2])
    tree = grow_tree([{"policy": "talon", "budget": 5, "topk": 4, "mu": 0.001}] * 2, roots, draft.root(roots),
                     draft.expand)
    assert tree.size.tolist() == [5, 5] and draft.calls == 0


def test_mixed_budgets_in_one_batch_keep_their_own_budget():
    """Budgets 3 and 9 with K 4 in one batch: the small row's root layer stops at 2 children (its budget), not
    at the batch's K or capacity."""
    draft = PathDraft(25, seed=6, sharpness=1.2)
    roots = [5, 6]
    specs = [{"policy": "talon", "budget": n, "topk": 4, "mu": 0.05} for n in (3, 9)]
    tree = grow_tree(specs, torch.tensor(roots), draft.root(torch.tensor(roots)), draft.expand)
    for b, (s, r) in enumerate(zip(specs, roots)):
        ref = oracles.talon(draft, r, s["budget"], 4, 0.05)
        assert set(tree.paths()[b]) == {ref.path(i) for i in range(len(ref.tok))}
    assert int(tree.size[0]) == 3


def test_the_frontier_is_minus_one_padded_and_empty_once_the_budget_is_full():
    from treespec_sglang.policies import parse_spec
    from treespec_sglang.policies.talon import TalonPolicy

    draft = PathDraft(25, seed=8, sharpness=1.0)
    pol = TalonPolicy([parse_spec({"policy": "talon", "budget": n, "topk": 3, "mu": 0.5}) for n in (4, 30)],
                      torch.device("cpu"))
    roots = torch.tensor([1, 2])
    fr = pol.start(roots, draft.root(roots))
    assert fr[0].tolist() == [-1, -1, -1]  # budget 4 = root + its 3 children: full
    steps = 0
    while (fr >= 0).any():
        fr = pol.step(draft.expand(pol.tree, fr))
        assert ((fr >= 1) | (fr == -1)).all() and fr[0].tolist() == [-1] * fr.shape[1]
        steps += (fr[1] >= 0).any() and (fr[1] == -1).any()  # a partly filled layer: padding to check
    assert steps > 0
