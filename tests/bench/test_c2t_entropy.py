"""``bench/c2t_entropy.py``: the engine's C2T scores with the entropy feature each mode names (over the top 1000,
or over the k children a pool keeps, checked against a plain entropy of the root's draft distribution), stays
lossless, and is restored after."""

import math

import pytest
import torch

import treespec_sglang.policies.c2t as c2t
from bench.c2t_entropy import on_curve, parent_entropy, run


def _first_layer(engine, prompt, mode, k):
    """(the root's distribution C2T started from ``[vocab]``, the entropy column of the features it scored in its
    first layer ``[K]``: the root's children) under ``mode``."""
    roots, seen = [], []
    start, scores = c2t.C2TPolicy.start, c2t.classifier_scores

    def spy_start(self, root_tokens, root_logprobs):
        roots.append(root_logprobs[0].double().clone())  # [vocab] log-probs of request 0
        return start(self, root_tokens, root_logprobs)

    def spy_scores(features, classifiers):
        seen.append(features[0, :, 1].clone())  # [K]: features (joint prob, entropy, depth)
        return scores(features, classifiers)

    c2t.C2TPolicy.start, c2t.classifier_scores = spy_start, spy_scores
    try:
        with parent_entropy(mode, k):
            engine.generate([prompt], max_new_tokens=4, policy={"policy": "c2t", "budget": 8, "topk": k, "beta": 0.0})
    finally:
        c2t.C2TPolicy.start, c2t.classifier_scores = start, scores
    return roots[0], seen[0]


def _plain_entropy(logprobs):
    """-sum p log p over ``logprobs`` (a Python list), term by term."""
    return -sum(math.exp(lp) * lp for lp in logprobs if lp > -math.inf)


@pytest.mark.parametrize("k", [2, 3])
def test_each_mode_scores_with_its_own_entropy(tiny_engine, k):
    got = {mode: _first_layer(tiny_engine, [5, 6, 7], mode, k) for mode in ("top1000", "children")}
    root = sorted(got["top1000"][0].tolist(), reverse=True)
    assert torch.equal(got["children"][0], got["top1000"][0])  # the same root either way
    for mode, (_, col) in got.items():  # one parent (the root) in layer 1: every candidate carries its entropy
        assert torch.allclose(col, col[0].expand_as(col)), mode
    assert float(got["children"][1][0]) == pytest.approx(_plain_entropy(root[:k]), rel=1e-4)
    assert float(got["top1000"][1][0]) == pytest.approx(_plain_entropy(root[:1000]), rel=1e-4)
    assert float(got["children"][1][0]) < float(got["top1000"][1][0])  # a partial sum of the same terms


def test_the_sweep_is_lossless_and_restores_the_engine(tiny_engine):
    prompts = [[5, 6, 7], [8, 9]]
    plain = [o.token_ids for o in tiny_engine.generate(prompts, max_new_tokens=6, policy=None)]
    rows = run(tiny_engine, prompts, [0.2, 0.6], budget=6, topk=2, max_new_tokens=6, batch_size=2)
    assert [(r["beta"], r["mode"]) for r in rows] == [(0.2, "top1000"), (0.2, "children"),
                                                      (0.6, "top1000"), (0.6, "children")]
    for r in rows:
        assert [o.token_ids for o in r["out"]] == plain
        assert r["rounds"] > 0 and 1 <= r["tau"] and 1 <= r["mean_tree"] <= 6
    assert c2t.entropy_topm.__name__ == "entropy_topm"


def test_an_unknown_mode_is_refused():
    with pytest.raises(ValueError, match="mode must be one of"):
        with parent_entropy("top10", 4):
            pass


def test_the_curve_is_read_between_its_points_only():
    pts = [(4.0, 2.0), (2.0, 1.5), (8.0, 2.2)]
    assert on_curve(pts, 3.0) == pytest.approx(1.75) and on_curve(pts, 6.0) == pytest.approx(2.1)
    assert on_curve(pts, 2.0) == 1.5 and on_curve(pts, 8.0) == pytest.approx(2.2)
    assert on_curve(pts, 1.9) is None and on_curve(pts, 8.1) is None
