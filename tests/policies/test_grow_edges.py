"""grow_tree at its edges: each input error as its full message, the log-probability check's tolerance
boundary, the draft-pruning threshold compared as stored (float32, inclusive), and expand's frontier
contract (-1 and only -1 marks "no node", in a mixed batch and for pruned nodes)."""

import math
import re

import pytest
import torch

from tests.helpers import PathDraft
from treespec_sglang.policies import grow_tree

CHAIN2 = {"policy": "chain", "length": 2}


def full(message):
    return f"^{re.escape(message)}$"


def flat_expand(row):
    """An expand whose every node's children have the log-probs ``row`` ([vocab])."""
    return lambda tree, frontier: row.expand(*frontier.shape, row.shape[-1])


def test_root_logprobs_of_another_batch_size_are_refused():
    lp = torch.log_softmax(torch.zeros(3, 50), -1)
    with pytest.raises(ValueError, match=full("root_logprobs must be float [2, vocab], got torch.float32 (3, 50)")):
        grow_tree([CHAIN2] * 2, torch.tensor([1, 2]), lp, flat_expand(lp[0]))


def test_integer_root_logprobs_are_refused():
    with pytest.raises(ValueError, match=full("root_logprobs must be float [2, vocab], got torch.int64 (2, 5)")):
        grow_tree([CHAIN2] * 2, torch.tensor([1, 2]), torch.zeros(2, 5, dtype=torch.int64), None)


def test_an_empty_batch_is_refused():
    with pytest.raises(ValueError, match=full("specs must hold at least one request (got an empty batch)")):
        grow_tree([], torch.zeros(0, dtype=torch.int64), torch.zeros(0, 5), None)


def test_pruning_with_sync_free_is_refused():
    lp = torch.log_softmax(torch.zeros(1, 5), -1)
    with pytest.raises(ValueError, match=full("min_logprob (draft pruning) reads the live count every step: not "
                                              "with sync_free")):
        grow_tree([CHAIN2], torch.tensor([1]), lp, flat_expand(lp[0]), min_logprob=torch.tensor([-1.0]),
                  sync_free=True)


def rows_at_logsumexp(target, n=200000):
    """Candidate float32 rows [m, x] (m < 0, x < 0: valid log-probs, mass above 1) whose logsumexp lands on
    ``target`` (float32) exactly: m steps across 2e-6, x is solved for, then nudged a few float32 steps."""
    t = torch.tensor(target, dtype=torch.float32)
    m = (-1e-4 - torch.arange(n, dtype=torch.float64) * 1e-11).float()
    x0 = (m.double() + torch.log(torch.expm1(target - m.double()))).float()
    out = []
    for d in range(-4, 5):
        x = x0
        for _ in range(abs(d)):
            x = torch.nextafter(x, torch.full_like(x, float(d)))
        rows = torch.stack([m, x], -1)
        out += rows[torch.logsumexp(rows, -1) == t].tolist()
    return out


def test_the_log_probability_check_accepts_a_logsumexp_of_exactly_0_001():
    """The tolerance is inclusive: a row whose float32 logsumexp is exactly 1e-3 passes (checked on the very
    tensor passed in), one a step above is refused with the row and the value named."""
    t = torch.tensor(1e-3, dtype=torch.float32)
    base = torch.tensor([math.log(0.5), float("-inf"), float("-inf"), float("-inf")])
    lp = None
    for m, x in rows_at_logsumexp(1e-3):
        cand = torch.stack([base, torch.tensor([m, x, float("-inf"), float("-inf")])])
        if torch.logsumexp(cand, -1)[1] == t:
            lp = cand
            break
    assert lp is not None, "no row with a float32 logsumexp of exactly 1e-3 found"
    expand = flat_expand(torch.log_softmax(torch.zeros(4), -1))
    assert grow_tree([CHAIN2] * 2, torch.tensor([1, 2]), lp, expand).size.tolist() == [3, 3]
    lp[1, 1] = torch.nextafter(lp[1, 1], torch.tensor(0.0))  # a hair more mass
    lp[1, 0] = 0.0  # and the top entry at 0: logsumexp about 1.1e-3
    with pytest.raises(ValueError, match=full("root_logprobs row 1 is not a log-probability distribution "
                                              "(logsumexp 0.0011, must be <= 0; pass log_softmax(logits), "
                                              "not logits)")):
        grow_tree([CHAIN2] * 2, torch.tensor([1, 2]), lp, expand)


@pytest.mark.parametrize("threshold", ["same float32", "float64 within rounding"])
def test_a_node_at_the_threshold_is_expanded(threshold):
    """A chain's first node has path log-prob L (float32): a threshold equal to L, or given in float64 a hair
    above L but rounding to it in float32 (the dtype path log-probs are stored in), keeps it expanded."""
    lp = torch.log_softmax(torch.tensor([[2.0, 0.5, -1.0, 0.0]]), -1)  # [1, 4] float32
    L = lp[0, 0]
    thr = L.reshape(1) if threshold == "same float32" else torch.tensor([float(L) + 1e-12], dtype=torch.float64)
    assert thr.dtype == torch.float32 or float(thr[0]) > float(L)
    tree = grow_tree([CHAIN2], torch.tensor([1]), lp, flat_expand(lp[0]), min_logprob=thr)
    assert tree.size.tolist() == [3]
    above = torch.tensor([float(torch.nextafter(L, torch.tensor(1.0)))])  # one float32 step above L: pruned
    assert grow_tree([CHAIN2], torch.tensor([1]), lp, flat_expand(lp[0]), min_logprob=above).size.tolist() == [2]


def recording(draft, seen):
    def expand(tree, frontier):
        seen.append(frontier.clone())
        return draft.expand(tree, frontier)
    return expand


def test_a_mixed_batch_pads_the_narrow_frontiers_with_minus_one():
    """A chain (width 1) beside EAGLE-2 (width 3): expand sees node indices or -1, never another negative."""
    draft = PathDraft(24, seed=4)
    roots = torch.tensor([3, 4])
    seen = []
    grow_tree([{"policy": "chain", "length": 3}, {"policy": "eagle2", "budget": 10, "topk": 3, "depth": 3}], roots,
              draft.root(roots), recording(draft, seen))
    assert seen and all(f.shape[1] == 3 for f in seen)
    assert all(f[0, 1:].tolist() == [-1, -1] for f in seen)
    assert all(((f >= 1) | (f == -1)).all() for f in seen)


def test_a_pruned_node_reaches_expand_as_minus_one():
    """EAGLE-2 topk 3: the threshold prunes some of the root's children (not all): expand sees -1 there."""
    draft = PathDraft(24, seed=4)
    roots = torch.tensor([3])
    root_lp = draft.root(roots)
    second = root_lp[0].topk(2).values[1]  # the 2nd best child's log-prob: keep two of the three
    seen = []
    grow_tree([{"policy": "eagle2", "budget": 10, "topk": 3, "depth": 3}], roots, root_lp, recording(draft, seen),
              min_logprob=second.reshape(1))
    first = seen[0][0].tolist()
    assert sorted(x >= 0 for x in first) == [False, True, True] and min(first) == -1
    assert all(((f >= 1) | (f == -1)).all() for f in seen)


def plain_eagle2(draft, root, budget, topk, depth):
    """EAGLE-2 (§4.1-4.2) in plain Python: each level's top-k candidates by path value are the next frontier (a node's
    top-k children each), the pool's top budget - 1 (ties to the earlier pool entry) the tree."""
    pool, frontier = [], [((root,), 0.0)]
    for _ in range(depth):
        cands = []
        for path, v in frontier:
            lp = draft.logprobs(path).tolist()
            kids = sorted(range(len(lp)), key=lambda w: (-lp[w], w))[:topk]
            cands += [(path + (w,), v + lp[w]) for w in kids]
        pool += cands
        frontier = sorted(cands, key=lambda c: -c[1])[:topk]  # stable: ties keep the pool order
    order = sorted(range(len(pool)), key=lambda i: (-pool[i][1], i))[:budget - 1]
    return {(root,)} | {pool[i][0] for i in order}


@pytest.mark.parametrize("topk", [3, 5])
def test_eagle2_with_a_topk_past_the_vocabulary_is_its_plain_tree(topk):
    """A 2-token vocabulary: a frontier of 2 has 4 children, fewer than topk 5 (the step built a topk-wide
    selection over them and failed)."""
    draft = PathDraft(2, seed=5)
    roots = torch.tensor([0, 1])
    tree = grow_tree([{"policy": "eagle2", "budget": 12, "topk": topk, "depth": 3}] * 2, roots, draft.root(roots),
                     draft.expand)
    for b in range(2):
        assert set(tree.paths()[b]) == plain_eagle2(draft, b, 12, topk, 3)
