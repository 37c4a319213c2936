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
