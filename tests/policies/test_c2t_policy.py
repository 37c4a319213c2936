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


@pytest.mark.parametrize("spec", [{"policy": "c2t", "budget": 12, "topk": 4, "beta": 0.0, "max_depth": 1},
                                  {"policy": "c2t", "budget": 5, "topk": 4, "beta": 0.0, "max_depth": 5}])
def test_no_draft_call_once_max_depth_or_the_budget_is_reached(spec):
    """max_depth 1, or a budget of K + 1 that the root layer fills: the frontier is empty after layer 1 and the
    draft is never called again."""
    draft = PathDraft(20, seed=2, sharpness=0.8)
    roots = torch.tensor([1, 2])
    tree = grow_tree([spec] * 2, roots, draft.root(roots), draft.expand)
    assert tree.size.tolist() == [5, 5] and draft.calls == 0


def test_each_row_is_scored_by_its_own_classifier():
    """Two classifiers in one batch (the default and an all-zero one scoring 0.5): each row's tree is Alg. 1
    with its own classifier, and the two differ here."""
    from treespec_sglang.policies import C2TClassifier

    half = C2TClassifier(hidden=4).eval()
    with torch.no_grad():
        for prm in half.parameters():
            prm.zero_()
    draft = PathDraft(20, seed=5, sharpness=1.5)
    clfs = [None, half, None, half]
    specs = [{"policy": "c2t", "budget": 10, "topk": 3, "beta": 0.45, "classifier": c} for c in clfs]
    tree = grow_tree(specs, torch.tensor([6] * 4), draft.root(torch.tensor([6] * 4)), draft.expand)
    got = [set(p) for p in tree.paths()]
    for b, c in enumerate(clfs):
        ref = oracles.c2t(draft, 6, 10, 3, 0.45, 10, load_classifier(c))
        assert got[b] == {ref.path(i) for i in range(len(ref.tok))}
    assert got[0] != got[1]


def test_a_confidence_equal_to_beta_passes():
    """C_i >= beta: a classifier of all-zero weights scores exactly 0.5, so beta 0.5 keeps every top-K
    candidate (the tree fills its budget) and beta 0.6 keeps none."""
    from treespec_sglang.policies import C2TClassifier

    half = C2TClassifier(hidden=4).eval()
    with torch.no_grad():
        for prm in half.parameters():
            prm.zero_()
    draft = PathDraft(20, seed=3)
    specs = [{"policy": "c2t", "budget": 7, "topk": 3, "beta": b, "classifier": half} for b in (0.5, 0.6)]
    tree = grow_tree(specs, torch.tensor([4, 4]), draft.root(torch.tensor([4, 4])), draft.expand)
    ref = oracles.c2t(draft, 4, 7, 3, 0.5, 10, half)
    assert set(tree.paths()[0]) == {ref.path(i) for i in range(len(ref.tok))} and tree.size.tolist() == [7, 1]


def test_a_row_at_its_max_depth_has_an_empty_frontier():
    from treespec_sglang.policies import parse_spec
    from treespec_sglang.policies.c2t import C2TPolicy

    draft = PathDraft(20, seed=4, sharpness=0.8)
    pol = C2TPolicy([parse_spec({"policy": "c2t", "budget": 12, "topk": k, "beta": 0.0, "max_depth": d})
                     for d, k in ((1, 3), (3, 3), (3, 1))], torch.device("cpu"))
    fr = pol.start(torch.tensor([1, 2, 3]), draft.root(torch.tensor([1, 2, 3])))
    assert fr[0].tolist() == [-1] * 3 and (fr[1] >= 1).sum() == 3
    assert fr[2, 0] >= 1 and fr[2, 1:].tolist() == [-1, -1]  # topk 1 in a K-3 batch: -1 padding


def test_two_classifier_modules_in_one_batch_are_told_apart():
    """Two classifier *modules* (grouped by identity, not by name): each row keeps its own."""
    from treespec_sglang.policies import C2TClassifier

    half = C2TClassifier(hidden=4).eval()
    with torch.no_grad():
        for prm in half.parameters():
            prm.zero_()
    strict = C2TClassifier(hidden=4).eval()
    with torch.no_grad():
        for prm in strict.parameters():
            prm.zero_()
        strict.fc2.bias.fill_(-3.0)  # scores sigmoid(-3) < .45 everywhere: nothing passes
    draft = PathDraft(20, seed=5, sharpness=1.5)
    specs = [{"policy": "c2t", "budget": 10, "topk": 3, "beta": 0.45, "classifier": c} for c in (half, strict)]
    tree = grow_tree(specs, torch.tensor([6, 6]), draft.root(torch.tensor([6, 6])), draft.expand)
    assert tree.size.tolist() == [10, 1]


@pytest.mark.parametrize("vocab, budget, topk, max_depth", [(6, 30, 5, 4), (8, 40, 6, 3), (6, 60, 6, 6)])
def test_exact_value_ties_follow_alg1s_candidate_order(vocab, budget, topk, max_depth):
    assert budget >= 1 + topk * max_depth
    """Integer path values tie across parents; with 25+ candidates per layer (where an unstable sort reorders
    ties) stage 1 still keeps Alg. 1's top-K: ties to the earlier parent, then the better child. The budget
    (>= 1 + topk * max_depth) never cuts a layer, so stage 2 keeps every stage-1 candidate whatever the order
    of tied confidences (a batched classifier may round identical rows differently)."""
    from treespec_sglang.policies.classifier import C2TClassifier

    clf = C2TClassifier.default()
    draft = oracles.IntegerDraft(vocab)
    roots = torch.tensor([1])
    tree = grow_tree([{"policy": "c2t", "budget": budget, "topk": topk, "beta": 0.0, "max_depth": max_depth,
                       "classifier": clf}], roots, draft.root(roots), draft.expand)
    ref = oracles.c2t(draft, 1, budget, topk, 0.0, max_depth, clf)
    assert set(tree.paths()[0]) == {ref.path(i) for i in range(len(ref.tok))}
