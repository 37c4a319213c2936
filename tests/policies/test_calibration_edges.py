"""Per-depth calibration at its edges, against hand-worked values: the prior's range and message, the
calibration curve's bins (first, middle, last) and means, a non-finite draft value, and the neutral weight of
padding entries."""

import re

import pytest
import torch

from treespec_sglang.policies.calibration import DepthCalibration
from treespec_sglang.tree import DraftTree


def tree_of(parents_rows, probs_rows):
    """A padded batch with these parents and path probabilities (root first, prob 1; nan allowed)."""
    t = DraftTree.from_lists([list(range(len(p))) for p in parents_rows], parents_rows)
    lp = torch.full(t.tokens.shape, float("-inf"))
    for b, probs in enumerate(probs_rows):
        lp[b, :len(probs)] = torch.tensor(probs, dtype=torch.float64).log().float()
    return type(t)(t.tokens, t.parents, t.depth, lp, t.size, t.depth_bound)


@pytest.mark.parametrize("prior", [0.0, -1.0])
def test_a_prior_not_above_zero_is_refused(prior):
    with pytest.raises(ValueError, match=f"^{re.escape(f'prior must be > 0, got {prior!r}')}$"):
        DepthCalibration(prior=prior)


def test_a_small_positive_prior_is_accepted():
    cal = DepthCalibration(max_depth=2, prior=0.5)
    tree = tree_of([[-1, 0]], [[1.0, 0.5]])
    cal.update(tree, torch.tensor([[0, 1]]))
    assert cal.ratios().tolist() == pytest.approx([1.0, (1 + 0.5) / (0.5 + 0.5), 1.0])


def test_the_curve_bins_nodes_by_their_path_probability():
    """Verified nodes .05 (bin 0), .55 and its child .52 (bin 5), .95 (bin 9, accepted); 10 bins.
    The first verify uses weight 1, so corrected equals predicted."""
    tree = tree_of([[-1, 0, 0, 0, 2]], [[1.0, 0.05, 0.55, 0.95, 0.52]])
    cal = DepthCalibration(max_depth=4)
    cal.update(tree, torch.tensor([[0, 3, -1]]))
    c = cal.curve()
    assert c["bin_lo"] == pytest.approx([i / 10 for i in range(10)])
    assert c["nodes"] == [1, 0, 0, 0, 0, 2, 0, 0, 0, 1]
    want = [0.05, 0, 0, 0, 0, (0.55 + 0.52) / 2, 0, 0, 0, 0.95]
    assert c["predicted"] == pytest.approx(want, rel=1e-6)
    assert c["corrected"] == pytest.approx(want, rel=1e-6)
    assert c["accepted"] == [0, 0, 0, 0, 0, 0, 0, 0, 0, 1.0]


def test_a_nan_draft_value_predicts_nothing():
    """A verified node with a NaN path log-prob adds 0 to its depth's prediction (and its curve bin 0)."""
    tree = tree_of([[-1, 0, 0]], [[1.0, float("nan"), 0.25]])
    cal = DepthCalibration(max_depth=2, prior=2.0)
    cal.update(tree, torch.tensor([[0, 1]]))
    assert cal.predicted.tolist() == pytest.approx([0.0, 0.25, 0.0])
    assert cal.ratios()[1].item() == pytest.approx((1 + 2) / (0.25 + 2))
    assert cal.curve()["predicted"][0] == 0.0


def test_padding_gets_the_neutral_weight():
    """After learning depth-2 ratios away from 1, a padded row's padding entries weigh 1 (the root's)."""
    cal = DepthCalibration(max_depth=2, prior=1.0)
    deep = tree_of([[-1, 0, 1]], [[1.0, 0.9, 0.8]])
    cal.update(deep, torch.tensor([[0, -1, -1]]))  # nothing accepted: ratios 1 / 1.9 and 1 / 1.8
    r = [1.0, 1 / 1.9, 1 / 1.8]
    padded = tree_of([[-1, 0, 1], [-1]], [[1.0, 0.9, 0.8], [1.0]])
    w = cal.weight(padded).tolist()
    assert w[0] == pytest.approx(r, rel=1e-6)
    assert w[1] == [1.0, 1.0, 1.0]
