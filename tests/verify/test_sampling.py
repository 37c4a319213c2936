"""Exactness of the sampling walk: the tokens a round emits are distributed as target sampling.

For a tree and target distributions p_u, the exact law of the emitted sequence is enumerated
(descend into a child while its token is drawn, stop at a non-child token). The empirical law
over n draws must be within the TV bound of Bretagnolle-Huber-Carol:
P(||p_hat - p||_1 >= eps) <= 2^K exp(-n eps^2 / 2), i.e. TV <= sqrt(2 (K ln 2 + ln(1/delta)) / n) / 2.
"""

import math
from collections import Counter

import pytest
import torch

from tests.laws import N_DRAWS, exact_law, tv, tv_bound
from treespec_sglang.tree import DraftTree
from treespec_sglang.verify import emitted_tokens, target_probs, verify_tree


def empirical_law(tree: DraftTree, logits: torch.Tensor, seed=0, **kw) -> dict:
    n = N_DRAWS
    big = DraftTree(*(getattr(tree, f).expand(n, -1) for f in ("tokens", "parents", "depth", "logprob")),
                    tree.size.expand(n), tree.depth_bound)
    r = verify_tree(big, logits.expand(n, -1, -1), generator=torch.Generator().manual_seed(seed), **kw)
    em = emitted_tokens(big, r)
    counts = Counter(tuple(x for x in row if x >= 0) for row in em.tolist())
    return {k: v / n for k, v in counts.items()}


def tree_of(tokens, parents):
    return DraftTree.from_lists([tokens], [parents])


def case_logits(name, n, V, g):
    if name == "flat":
        return torch.zeros(1, n, V)
    if name == "one_hot":
        lg = torch.full((1, n, V), -60.0)
        lg[0, torch.arange(n), torch.randint(0, V, (n,), generator=g)] = 60.0
        return lg
    return torch.randn(1, n, V, generator=g) * 1.5


# (name, tokens, parents, logits kind)
CASES = [
    ("flat_bushy", [0, 1, 2, 3, 1, 2, 0], [-1, 0, 0, 0, 1, 1, 2], "flat"),
    ("one_hot", [0, 1, 2, 3, 1, 2, 0], [-1, 0, 0, 0, 1, 1, 2], "one_hot"),
    ("mass_outside_children", [0, 4, 1, 2], [-1, 0, 0, 1], "random"),
    ("deep_chain", [0, 1, 2, 3, 4, 0, 1, 2, 3], [-1, 0, 1, 2, 3, 4, 5, 6, 7], "deep"),
    ("duplicate_siblings", [0, 1, 1, 2, 2], [-1, 0, 0, 1, 2], "random"),
]


@pytest.mark.parametrize("name,tokens,parents,kind", CASES)
@pytest.mark.parametrize("params", [dict(temperature=1.0), dict(temperature=0.7, top_k=3, top_p=0.85)])
def test_tree_sampling_is_exact(name, tokens, parents, kind, params):
    V = 5
    tree = tree_of(tokens, parents)
    g = torch.Generator().manual_seed(len(tokens))
    if kind == "deep":  # target favours the chain, so deep acceptance is frequent
        logits = torch.randn(1, len(tokens), V, generator=g) * 0.3
        for j in range(1, len(tokens)):
            logits[0, parents[j], tokens[j]] += 2.5
    else:
        logits = case_logits(kind, len(tokens), V, g)
    law = exact_law(tree, target_probs(logits, **params)[0])
    emp = empirical_law(tree, logits, **params)
    assert set(emp) <= set(law), "emitted a sequence the target gives zero probability"
    assert tv(emp, law) < tv_bound(len(law)), (tv(emp, law), tv_bound(len(law)))
    if kind == "deep":
        assert max(len(k) for k in emp) >= 6  # deep acceptances really happened


def test_the_check_has_power():
    """Verifying at the wrong temperature is detected: the TV check is not vacuous."""
    tree = tree_of([0, 1, 2, 3], [-1, 0, 0, 1])
    logits = torch.randn(1, 4, 5, generator=torch.Generator().manual_seed(1)) * 1.5
    law = exact_law(tree, target_probs(logits, temperature=1.0)[0])
    emp = empirical_law(tree, logits, temperature=1.3)
    assert tv(emp, law) > 3 * tv_bound(len(law))


def test_per_row_temperature_mixes_greedy_and_sampling():
    tree = DraftTree.from_lists([[0, 1, 2]] * 4, [[-1, 0, 1]] * 4)
    logits = torch.randn(4, 3, 6, generator=torch.Generator().manual_seed(2))
    T = torch.tensor([0.0, 1.0, 0.0, 1.0])
    r = verify_tree(tree, logits, temperature=T, generator=torch.Generator().manual_seed(0))
    g = verify_tree(tree, logits)
    for b in (0, 2):
        assert r.path[b].tolist() == g.path[b].tolist() and r.bonus[b] == g.bonus[b]


def reference_target_probs(logits, T, k, p):
    """Row by row with Python sorting: temperature, top-k (ties kept), top-p (min prefix >= p)."""
    out = []
    for row in logits.tolist():
        x = [v / T for v in row]
        if k > 0:
            kth = sorted(x, reverse=True)[min(k, len(x)) - 1]
            x = [v if v >= kth else -math.inf for v in x]
        m = max(x)
        e = [math.exp(v - m) if v > -math.inf else 0.0 for v in x]
        s = sum(e)
        pr = [v / s for v in e]
        order = sorted(range(len(pr)), key=lambda i: -pr[i])
        keep, acc = set(), 0.0
        for i in order:
            if acc >= p:
                break
            keep.add(i)
            acc += pr[i]
        pr = [v if i in keep else 0.0 for i, v in enumerate(pr)]
        s = sum(pr)
        out.append([v / s for v in pr])
    return torch.tensor(out)


@pytest.mark.parametrize("T,k,p", [(1.0, -1, 1.0), (0.5, 4, 1.0), (1.3, -1, 0.7), (0.8, 10, 0.9), (2.0, 1, 0.5)])
def test_target_probs_matches_reference(T, k, p):
    logits = torch.randn(6, 17, generator=torch.Generator().manual_seed(3)) * 2
    got = target_probs(logits, T, k, p)
    torch.testing.assert_close(got, reference_target_probs(logits, T, k, p), rtol=1e-5, atol=1e-6)


def test_target_probs_validates():
    with pytest.raises(ValueError, match=r"top_p must be a number in \[1e-09, 1.0\]"):
        target_probs(torch.zeros(1, 3), 1.0, -1, 1.5)
    with pytest.raises(ValueError, match=r"temperature must be a number"):
        target_probs(torch.zeros(1, 3), -1.0)
