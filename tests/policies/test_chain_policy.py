"""Chain drafting per request: the greedy path of each row's own length, batched with other lengths."""

import torch

from tests.helpers import PathDraft
from treespec_sglang.policies import grow_tree, parse_spec
from treespec_sglang.policies.chain import ChainPolicy


def greedy(draft, root, length):
    path = (root,)
    for _ in range(length):
        path = path + (int(draft.logprobs(path).argmax()),)
    return path


def test_each_row_is_the_greedy_path_of_its_own_length():
    """Lengths 0, 1, 2 and 5 in one batch (a length-1 chain drafts exactly one token), against plain argmax."""
    draft = PathDraft(30, seed=7)
    lengths, roots = [0, 1, 2, 5], [4, 6, 8, 10]
    tree = grow_tree([{"policy": "chain", "length": n} for n in lengths], torch.tensor(roots),
                     draft.root(torch.tensor(roots)), draft.expand)
    tree.check()
    assert tree.size.tolist() == [n + 1 for n in lengths]
    for b, (n, r) in enumerate(zip(lengths, roots)):
        assert tree.paths()[b][-1] == greedy(draft, r, n)


def test_the_policy_tree_is_max_length_plus_one_wide():
    """finish() returns ``[bs, max_nodes]``: the longest chain plus its root, no spare column."""
    draft = PathDraft(20, seed=1)
    pol = ChainPolicy([parse_spec({"policy": "chain", "length": n}) for n in (3, 1)], torch.device("cpu"))
    roots = torch.tensor([2, 5])
    fr = pol.start(roots, draft.root(roots))
    for _ in range(pol.max_steps):
        if not (fr >= 0).any():
            break
        fr = pol.step(draft.expand(pol.tree, fr))
    tree = pol.finish()
    assert tree.tokens.shape == (2, 4) and tree.size.tolist() == [4, 2]
    assert pol.max_steps == 2 and pol.depth_bound == 3


def test_a_score_equal_to_beta_does_not_stop_the_chain():
    """The early stop is C_i < beta: a classifier of all-zero weights scores exactly 0.5, so beta 0.5 never
    stops a chain (and beta 0.6 stops it before its first token)."""
    from treespec_sglang.policies import C2TClassifier

    half = C2TClassifier(hidden=4).eval()
    with torch.no_grad():
        for prm in half.parameters():
            prm.zero_()
    draft = PathDraft(30, seed=9)
    roots = [3, 3]
    specs = [{"policy": "chain", "length": 4, "beta": b, "classifier": half} for b in (0.5, 0.6)]
    tree = grow_tree(specs, torch.tensor(roots), draft.root(torch.tensor(roots)), draft.expand)
    assert tree.size.tolist() == [5, 1]
    assert tree.paths()[0][-1] == greedy(draft, 3, 4)


def test_a_finished_chain_reports_minus_one_in_its_frontier():
    """The frontier contract (-1 = nothing to expand): a length-0 row from the start, a length-1 row after
    its one token, and every row once the longest chain is done."""
    draft = PathDraft(20, seed=4)
    pol = ChainPolicy([parse_spec({"policy": "chain", "length": n}) for n in (0, 1, 3)], torch.device("cpu"))
    roots = torch.tensor([1, 2, 3])
    fr = pol.start(roots, draft.root(roots))
    assert fr[:2, 0].tolist() == [-1, -1] and int(fr[2, 0]) >= 1
    seen = []
    for _ in range(pol.max_steps):
        fr = pol.step(draft.expand(pol.tree, fr))
        seen.append(fr[:, 0].tolist())
    assert [s[:2] for s in seen] == [[-1, -1], [-1, -1]] and seen[-1][2] == -1
