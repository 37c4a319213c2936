import dataclasses

import pytest
import torch

from tests.helpers import random_batch
from treespec_sglang.tree import DraftTree
from treespec_sglang.verify import emitted_tokens, verify_tree


def greedy_walk_oracle(tokens, parents, size, logits):
    """Follow argmax through the tree (first matching child), then the bonus argmax."""
    cur, path = 0, [0]
    while True:
        a = int(logits[cur].argmax())
        kids = [j for j in range(1, size) if parents[j] == cur and tokens[j] == a]
        if not kids:
            return path, a
        cur = kids[0]
        path.append(cur)


@pytest.mark.parametrize("seed", range(5))
def test_greedy_matches_walk_oracle(rng, seed):
    V = 6  # small vocab so matches are common
    sizes = [1, 7, 15, 4, 20]
    t = random_batch(rng, sizes, vocab=V, max_children=3)
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(len(sizes), t.n_nodes, V, generator=g)
    # make argmax follow the tree often: boost the first child's token at each node
    for b in range(len(sizes)):
        for j in range(1, sizes[b]):
            if torch.rand(1, generator=g) < 0.7:
                logits[b, t.parents[b, j], t.tokens[b, j]] += 4
    r = verify_tree(t, logits)
    emitted = emitted_tokens(t, r)
    for b, s in enumerate(sizes):
        path, bonus = greedy_walk_oracle(t.tokens[b].tolist(), t.parents[b].tolist(), s, logits[b])
        assert r.path[b, :len(path)].tolist() == path
        assert (r.path[b, len(path):] == -1).all()
        assert int(r.num_accepted[b]) == len(path) - 1
        assert int(r.bonus[b]) == bonus
        assert emitted[b, :len(path)].tolist() == [int(t.tokens[b, j]) for j in path[1:]] + [bonus]
    assert r.num_accepted.max() >= 2  # the case exercises deep acceptance


def test_greedy_chain_equals_plain_greedy_decoding():
    """A chain drafted by the target itself is fully accepted; the bonus is the next greedy token."""
    V, L = 11, 6
    g = torch.Generator().manual_seed(0)
    table = torch.randn(V, V, generator=g)  # logits of the next token given the current one
    seq = [3]
    for _ in range(L + 1):
        seq.append(int(table[seq[-1]].argmax()))
    t = DraftTree.from_lists([seq[:L + 1]], [[-1] + list(range(L))])
    r = verify_tree(t, table[torch.tensor(seq[:L + 1])][None])
    assert int(r.num_accepted[0]) == L and int(r.bonus[0]) == seq[L + 1]


def test_duplicate_sibling_tokens_are_harmless():
    t = DraftTree.from_lists([[0, 2, 2, 1]], [[-1, 0, 0, 2]])
    logits = torch.full((1, 4, 4), -5.0)
    logits[0, 0, 2] = 5.0
    logits[0, 1, 3] = 5.0
    r = verify_tree(t, logits)
    assert r.path[0].tolist()[:2] == [0, 1]  # the first copy is followed
    assert int(r.bonus[0]) == 3


def test_rejects_misshaped_logits():
    t = DraftTree.from_lists([[0, 2]], [[-1, 0]])
    with pytest.raises(ValueError, match=r"target_logits must be \[bs, n_nodes, vocab\] = \[1, 2, vocab\]"):
        verify_tree(t, torch.zeros(1, 3, 5))


def test_root_only_trees_are_plain_decoding():
    t = DraftTree.from_lists([[4], [2]], [[-1], [-1]])
    logits = torch.randn(2, 1, 7, generator=torch.Generator().manual_seed(0))
    r = verify_tree(t, logits)
    assert r.num_accepted.tolist() == [0, 0]
    assert emitted_tokens(t, r).tolist() == [[int(logits[0, 0].argmax())], [int(logits[1, 0].argmax())]]


@pytest.mark.parametrize("poison", ["nan", "posinf", "all_neginf"])
def test_verify_refuses_unusable_target_logits(poison):
    t = DraftTree.from_lists([[9, 1, 2]], [[-1, 0, 0]])
    logits = torch.randn(1, 3, 5)
    if poison == "nan":
        logits[0, 2, 3] = float("nan")
    elif poison == "posinf":
        logits[0, 2, 3] = float("inf")
    else:
        logits[0, 2] = float("-inf")
    with pytest.raises(ValueError, match="target_logits of request 0, node 2 hold NaN"):
        verify_tree(t, logits)
    ok = logits.clone()
    ok[0, 2] = torch.tensor([0.0, float("-inf"), 1.0, float("-inf"), 2.0])  # masked tokens are fine
    assert verify_tree(t, ok).bonus.shape == (1,)
    # a padding row (past a request's tree) is never read: whatever it holds, the batch verifies
    padded = DraftTree.from_lists([[9, 1, 2], [9]], [[-1, 0, 0], [-1]])
    rows = torch.randn(2, 3, 5)
    rows[1, 1:] = logits[0, 2]
    assert verify_tree(padded, rows, temperature=1.0).bonus.shape == (2,)
    rows[1, 0] = logits[0, 2]
    with pytest.raises(ValueError, match="target_logits of request 1, node 0 hold NaN"):
        verify_tree(padded, rows)


@pytest.mark.parametrize("seed", range(6))
def test_greedy_fast_path_equals_the_one_hot_walk(rng, seed):
    """verify_tree's T=0 path (argmax only) == walk_tree on one-hot rows, with repeated sibling tokens
    (only the first counts), padding, and argmax ties broken the same way."""
    from treespec_sglang.verify.tree import walk_greedy, walk_tree

    V = 4
    t = random_batch(rng, [1, 6, 13, 9], vocab=V, max_children=4)
    g = torch.Generator().manual_seed(seed)
    tok = t.tokens.clone()
    rep = (torch.rand(tok[:, 2:].shape, generator=g) < 0.3) & (t.parents[:, 2:] >= 0) & (t.parents[:, 1:-1] >= 0)
    tok[:, 2:] = torch.where(rep, tok[:, 1:-1], tok[:, 2:])  # repeated tokens, often between siblings
    t = dataclasses.replace(t, tokens=tok)
    logits = torch.randint(0, 3, (4, t.n_nodes, V), generator=g).float()  # many exact ties
    fast = walk_greedy(t, logits.argmax(-1))
    one_hot = torch.nn.functional.one_hot(logits.argmax(-1), V).float()
    ref = walk_tree(t, one_hot, torch.rand(4, t.depth_bound + 1, generator=g))
    assert torch.equal(fast.path, ref.path) and torch.equal(fast.bonus, ref.bonus)
    assert torch.equal(fast.num_accepted, ref.num_accepted)
    via_api = verify_tree(t, logits)
    assert torch.equal(via_api.path, ref.path) and torch.equal(via_api.bonus, ref.bonus)
