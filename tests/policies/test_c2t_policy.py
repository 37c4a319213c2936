"""C2T rows of different topk / budgets / max_depth in one batch, each against the plain Alg. 1."""

import pytest
import torch

from tests.helpers import PathDraft
from tests.policies import oracles
from treespec_sglang.policies import grow_tree
from treespec_sglang.policies.classifier import load_classifier

SPECS = [{"policy": "c2t", "budget": 12, "topk": 2, "beta": 0.05, "max_depth": 6},
         {"policy": "c2t", "budget": 12, "topk": 5, "beta": 0.05, "max_depth": 6},
         {"policy": "c2t", "budget": 4, "topk": 3, "beta": 0.0, "max_depth": 5},
         {"policy": "c2t", "budget": 15, "topk": 4, "beta": 0.1, "max_depth": 1},
         {"policy": "c2t", "budget": 1, "topk": 3, "beta": 0.0, "max_depth": 3}]


@pytest.mark.parametrize("seed", range(3))
def test_mixed_c2t_rows_in_one_batch_equal_alg1(seed):
    """A row with a smaller topk than the batch's K takes only its own top-k candidates; budgets 1 and 4,
    max_depth 1."""
    draft = PathDraft(20, seed=70 + seed, sharpness=0.8)
    roots = [1, 3, 5, 7, 9]
    tree = grow_tree(SPECS, torch.tensor(roots), draft.root(torch.tensor(roots)), draft.expand)
    tree.check()
    clf = load_classifier(None)
    for b, (s, r) in enumerate(zip(SPECS, roots)):
        ref = oracles.c2t(draft, r, s["budget"], s["topk"], s["beta"], s["max_depth"], clf)
        assert set(tree.paths()[b]) == {ref.path(i) for i in range(len(ref.tok))}, s
    assert int(tree.size[4]) == 1
