"""Each batched policy against its plain-Python restatement, several requests per batch."""

import math

import pytest
import torch

from tests.helpers import PathDraft, plain_confidence, plain_entropy
from tests.policies import oracles
from treespec_sglang.policies import C2TClassifier, grow_tree


def run(specs, draft, roots):
    roots = torch.tensor(roots)
    tree = grow_tree(specs, roots, draft.root(roots), draft.expand)
    tree.check()
    return tree


def tree_lists(tree, b):
    s = int(tree.size[b])
    return tree.tokens[b, :s].tolist(), tree.parents[b, :s].tolist()


@pytest.mark.parametrize("vocab,topk,depth,budget", [(50, 4, 3, 12), (40, 3, 5, 20), (64, 5, 4, 40), (30, 2, 6, 11), (20, 3, 1, 4)])
def test_eagle2_equals_sglang_organize_draft_results(vocab, topk, depth, budget):
    draft = PathDraft(vocab, seed=vocab + depth, sharpness=1.5)
    roots = [3, 7, 11]
    spec = {"policy": "eagle2", "budget": budget, "topk": topk, "depth": depth}
    tree = run([spec] * len(roots), draft, roots)
    for b, r in enumerate(roots):
        assert tree_lists(tree, b) == oracles.sglang_eagle2(draft, r, topk, depth, budget)
    assert draft.calls == depth - 1  # S - 1 draft forwards after the root


def test_eagle2_mixed_topk_rows_match_their_own_sglang_run():
    draft = PathDraft(40, seed=5, sharpness=1.5)
    specs = [{"policy": "eagle2", "budget": 15, "topk": 4, "depth": 4},
             {"policy": "eagle2", "budget": 9, "topk": 2, "depth": 5},
             {"policy": "eagle2", "budget": 6, "topk": 3, "depth": 2}]
    tree = run(specs, draft, [1, 2, 3])
    for b, (s, r) in enumerate(zip(specs, [1, 2, 3])):
        assert tree_lists(tree, b) == oracles.sglang_eagle2(draft, r, s["topk"], s["depth"], s["budget"])


@pytest.mark.parametrize("vocab,N,K,mu,sharp", [(30, 12, 4, 0.03, 2.0), (25, 20, 10, 0.1, 1.0), (40, 30, 5, 0.0, 2.5),
                                                (20, 8, 3, 0.5, 3.0), (50, 60, 10, 0.03, 4.0)])
def test_talon_equals_alg2(vocab, N, K, mu, sharp):
    draft = PathDraft(vocab, seed=N, sharpness=sharp)
    roots = [0, 4]
    tree = run([{"policy": "talon", "budget": N, "topk": K, "mu": mu}] * 2, draft, roots)
    for b, r in enumerate(roots):
        ref = oracles.talon(draft, r, N, K, mu)
        assert set(tree.paths()[b]) == {ref.path(i) for i in range(len(ref.tok))}


@pytest.mark.parametrize("vocab,N,B,seed", [(3, 8, 2, 0), (3, 8, 3, 1), (4, 6, 1, 2), (4, 7, 4, 3), (5, 6, 2, 4), (3, 9, 2, 5)])
def test_salf_th0_is_the_brute_force_top_n(vocab, N, B, seed):
    draft = PathDraft(vocab, seed=seed, sharpness=1.5 + seed % 3)
    roots = [1, 2]
    tree = run([{"policy": "salf", "budget": N, "batch": B, "th": 0.0}] * 2, draft, roots)
    for b, r in enumerate(roots):
        assert set(tree.paths()[b]) == oracles.brute_force_top_n(draft, r, N)


@pytest.mark.parametrize("vocab,N,B,th,max_depth,sharp", [(30, 20, 4, 0.6, None, 2.0), (30, 20, 4, 0.3, 3, 4.0),
                                                         (50, 60, 10, 0.6, None, 4.0), (20, 15, 3, 0.9, 2, 2.0),
                                                         (50, 60, 10, 0.05, None, 3.0)])
def test_salf_equals_alg2(vocab, N, B, th, max_depth, sharp):
    draft = PathDraft(vocab, seed=N + B, sharpness=sharp)
    roots = [5, 6, 7]
    spec = {"policy": "salf", "budget": N, "batch": B, "th": th, "max_depth": max_depth}
    tree = run([spec] * 3, draft, roots)
    for b, r in enumerate(roots):
        assert set(tree.paths()[b]) == oracles.salf(draft, r, N, B, th, max_depth)


def fitted_like_classifier():
    """A quickly fitted classifier: accept when P > 0.02 and depth <= 3 (a few Adam steps)."""
    g = torch.Generator().manual_seed(0)
    x = torch.stack([torch.rand(4000, generator=g) ** 3, torch.rand(4000, generator=g) * 4,
                     torch.randint(1, 7, (4000,), generator=g).float()], -1)
    y = ((x[:, 0] > 0.02) & (x[:, 2] <= 3)).float()
    torch.manual_seed(0)
    clf = C2TClassifier(hidden=12)
    opt = torch.optim.Adam(clf.parameters(), lr=3e-2)
    for _ in range(300):
        opt.zero_grad()
        torch.nn.functional.binary_cross_entropy(clf(x), y).backward()
        opt.step()
    return clf.eval()


@pytest.mark.parametrize("clf_kind", ["default", "random"])
@pytest.mark.parametrize("vocab,N,K,beta,max_depth", [(30, 20, 4, 0.5, 10), (40, 60, 10, 0.3, 4), (25, 8, 5, 0.6, 10)])
def test_c2t_equals_alg1(clf_kind, vocab, N, K, beta, max_depth):
    clf = C2TClassifier.default() if clf_kind == "default" else fitted_like_classifier()
    draft = PathDraft(vocab, seed=K, sharpness=2.5)
    roots = [2, 9]
    spec = {"policy": "c2t", "budget": N, "topk": K, "beta": beta, "max_depth": max_depth, "classifier": clf}
    tree = run([spec] * 2, draft, roots)
    for b, r in enumerate(roots):
        ref = oracles.c2t(draft, r, N, K, beta, max_depth, clf)
        assert set(tree.paths()[b]) == {ref.path(i) for i in range(len(ref.tok))}


def test_c2t_classifier_from_file(tmp_path):
    clf = fitted_like_classifier()
    clf.save(tmp_path / "clf.pt")
    draft = PathDraft(30, seed=1, sharpness=2.5)
    a = run([{"policy": "c2t", "budget": 20, "classifier": str(tmp_path / "clf.pt")}], draft, [4])
    b = run([{"policy": "c2t", "budget": 20, "classifier": clf}], draft, [4])
    assert a.paths() == b.paths()
    with pytest.raises(ValueError, match="does not exist"):
        run([{"policy": "c2t", "classifier": str(tmp_path / "missing.pt")}], draft, [4])


def test_chain_is_the_greedy_path():
    draft = PathDraft(30, seed=2)
    tree = run([{"policy": "chain", "length": 5}, {"policy": "chain", "length": 0}], draft, [1, 2])
    path = (1,)
    for _ in range(5):
        path = path + (int(draft.logprobs(path).argmax()),)
    assert tree.paths()[0][-1] == path
    assert tree.size.tolist() == [6, 1]


def test_chain_c2t_early_stop_matches_scores():
    from treespec_sglang.policies.classifier import load_classifier

    draft = PathDraft(30, seed=3, sharpness=1.2)
    clf = load_classifier(None)  # the package default (what a spec without "classifier" uses)
    beta = 0.5
    tree = run([{"policy": "chain", "length": 8, "beta": beta}, {"policy": "chain", "length": 8}], draft, [5, 5])
    path, lp_sum, expect = (5,), 0.0, 0
    for d in range(1, 9):
        lp = draft.logprobs(path)
        t = int(lp.argmax())
        lp_sum += float(lp[t])
        score = plain_confidence(clf, math.exp(lp_sum), plain_entropy(lp), d)
        if score < beta:
            break
        path, expect = path + (t,), expect + 1
    assert int(tree.size[0]) == expect + 1
    assert tree.paths()[0][-1] == path
    assert int(tree.size[1]) == 9  # no beta: full length
    assert expect < 8, "the test case should actually stop early"
