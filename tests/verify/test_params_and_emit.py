"""Sampling parameters as scalars and tensors (checks, dtypes, defaults) and the tokens a round commits,
against plain Python."""

import pytest
import torch

from tests.verify.test_sampling import reference_target_probs
from treespec_sglang.tree import DraftTree
from treespec_sglang.verify import VerifyResult, emitted_tokens, target_probs
from treespec_sglang.verify.sampling import check_scalar


def test_check_scalar_returns_an_int_or_a_float_and_defaults_to_real():
    assert check_scalar("x", 0.5, 0.0, 1.0) == 0.5  # integer defaults to False: any real number
    got = check_scalar("top_k", 3, -10, 10, integer=True)
    assert got == 3 and type(got) is int
    got = check_scalar("t", 2, 0.0, 4.0)
    assert got == 2.0 and type(got) is float
    with pytest.raises(ValueError, match=r"top_k must be an integer in \[-10, 10\], got 2.5"):
        check_scalar("top_k", 2.5, -10, 10, integer=True)


def test_target_probs_defaults_to_greedy():
    logits = torch.randn(3, 2, 6, generator=torch.Generator().manual_seed(1))
    want = torch.nn.functional.one_hot(logits.argmax(-1), 6).float()
    assert torch.equal(target_probs(logits), want)


def test_disabled_top_k_and_top_p_leave_the_plain_softmax():
    """top_k 0 / -1 and top_p 1 are off: the result is softmax(logits / T) bit for bit (no renormalisation)."""
    logits = torch.randn(64, 33, generator=torch.Generator().manual_seed(3)) * 3
    want = torch.softmax(logits / 0.9, -1)
    for k in (0, -1):
        assert torch.equal(target_probs(logits, 0.9, k, 1.0), want)


def test_target_probs_refuses_a_fractional_top_k_and_a_misshaped_tensor():
    with pytest.raises(ValueError, match=r"top_k must be an integer"):
        target_probs(torch.zeros(2, 5), 1.0, top_k=2.5)
    with pytest.raises(ValueError, match=r"temperature must be a scalar or a \[2\] tensor, got shape \(3,\)"):
        target_probs(torch.zeros(2, 5), torch.ones(3))


def test_tensor_parameters_of_any_dtype_give_float32_probs():
    """Per-row tensors arrive as float64 / int32 (a batch's own dtypes): the result is the float32
    distribution of the scalar path, row by row."""
    logits = torch.randn(4, 9, generator=torch.Generator().manual_seed(2)) * 2
    T = torch.tensor([0.7, 1.0, 1.5, 1.2], dtype=torch.float64)
    k = torch.tensor([3, -1, 5, 0], dtype=torch.int32)  # -1 and 0: top-k off for that row
    p = torch.tensor([1.0, 0.8, 0.9, 1.0], dtype=torch.float64)
    got = target_probs(logits, T, k, p)
    assert got.dtype == torch.float32
    want = torch.cat([reference_target_probs(logits[b:b + 1], float(T[b]), int(k[b]), float(p[b])) for b in range(4)])
    torch.testing.assert_close(got, want.float(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("depth_bound", [None, 3])
def test_emitted_tokens_are_the_accepted_tokens_then_the_bonus_then_minus_one(depth_bound):
    """Request 0 accepts 2 of 3 levels, request 1 none, request 2 (root only) none; with ``depth_bound`` 3
    the root-only rows carry draft columns that are all -1."""
    t = DraftTree.from_lists([[9, 4, 5, 6], [8, 1, 2, 3], [7]], [[-1, 0, 1, 2], [-1, 0, 0, 0], [-1]])
    if depth_bound is not None:
        t = DraftTree(t.tokens, t.parents, t.depth, t.logprob, t.size, depth_bound)
    D = t.depth_bound
    paths = [[0, 1, 2], [0], [0]]
    path = torch.tensor([p + [-1] * (D + 1 - len(p)) for p in paths])
    r = VerifyResult(path, torch.tensor([2, 0, 0]), torch.tensor([11, 12, 13]))
    toks = t.tokens.tolist()
    want = []
    for b, p in enumerate(paths):
        row = [toks[b][i] for i in p[1:]] + [int(r.bonus[b])]
        want.append(row + [-1] * (D + 1 - len(row)))
    assert emitted_tokens(t, r).tolist() == want
    full = VerifyResult(torch.tensor([[0, 1, 2, 3] + [-1] * (D - 3)] * 3), torch.tensor([3, 3, 3]),
                        torch.tensor([11, 12, 13]))
    t1 = DraftTree.from_lists([[9, 4, 5, 6]] * 3, [[-1, 0, 1, 2]] * 3)
    t1 = DraftTree(t1.tokens, t1.parents, t1.depth, t1.logprob, t1.size, D)
    assert emitted_tokens(t1, full).tolist() == [[4, 5, 6, b] + [-1] * (D - 3) for b in (11, 12, 13)]


def test_emitted_tokens_of_root_only_trees_with_a_static_depth_bound():
    """A batch of root-only trees (one node each) under a static ``depth_bound`` 2: no draft token is read."""
    t = DraftTree.from_lists([[7], [5]], [[-1], [-1]])
    t = DraftTree(t.tokens, t.parents, t.depth, t.logprob, t.size, 2)
    r = VerifyResult(torch.tensor([[0, -1, -1]] * 2), torch.tensor([0, 0]), torch.tensor([3, 4]))
    assert emitted_tokens(t, r).tolist() == [[3, -1, -1], [4, -1, -1]]
