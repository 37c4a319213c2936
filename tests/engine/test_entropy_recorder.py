"""``EntropyRecorder`` (the C2T training data's parent entropies, C2T Eq. 7): each node's value is the entropy of
the distribution it was drawn from, the root's for depth-1 nodes and its parent's expansion for deeper ones, padding
frontier slots leaving every node's value as it was; checked against a plain restatement of the entropy."""

import pytest
import torch

from tests.helpers import plain_entropy
from treespec_sglang.engine.expander import EntropyRecorder
from treespec_sglang.tree import DraftTree


def test_each_node_gets_the_entropy_of_its_parents_distribution():
    gen = torch.Generator().manual_seed(0)
    vocab = 7
    root_lp = torch.log_softmax(torch.randn(2, vocab, generator=gen), -1)  # [bs, vocab]
    # request 0: root 0 -> 1, 2; 1 -> 3; 3 -> 4.  request 1: root 0 -> 1; 1 -> 2, 3; 4 padding
    tree = DraftTree.from_lists([[5, 1, 2, 3, 4], [6, 1, 2, 3]], [[-1, 0, 0, 1, 3], [-1, 0, 1, 1]])
    steps = [torch.tensor([[1, 2], [1, -1]]), torch.tensor([[3, -1], [-1, -1]])]  # [bs, width] per expansion
    outs = [torch.log_softmax(torch.randn(2, 2, vocab, generator=gen), -1) for _ in steps]  # [bs, width, vocab]
    calls = iter(outs)
    rec = EntropyRecorder(lambda t, frontier: next(calls), root_lp)
    for frontier in steps:
        rec(tree, frontier)
    drawn_from = {}  # (request, node) -> the log-probs its children were drawn from
    for b in range(2):
        drawn_from[b, 0] = root_lp[b]
        for frontier, out in zip(steps, outs):
            for w, u in enumerate(frontier[b].tolist()):
                if u >= 0:
                    drawn_from[b, u] = out[b, w]
    got = rec.parent_entropy(tree)  # [bs, n_nodes]
    for b, parents in enumerate(tree.parents.tolist()):
        for u in range(1, int(tree.size[b])):
            assert float(got[b, u]) == pytest.approx(plain_entropy(drawn_from[b, parents[u]]), rel=1e-5)


def test_without_an_expansion_every_node_reads_the_roots_entropy():
    root_lp = torch.log_softmax(torch.tensor([[0.0, 1.0, 2.0]]), -1)
    rec = EntropyRecorder(lambda t, f: None, root_lp)
    tree = DraftTree.from_lists([[5, 1, 2]], [[-1, 0, 0]])
    assert rec.parent_entropy(tree)[0, 1:].tolist() == pytest.approx([plain_entropy(root_lp[0])] * 2, rel=1e-6)
