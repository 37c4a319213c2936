import pytest
import torch

from treespec_sglang.tree import DraftTree, TreeBuffer, compact, kept_rows, pack_left


def test_from_lists_depth_and_padding():
    t = DraftTree.from_lists([[5, 7, 8, 9], [3]], [[-1, 0, 0, 1], [-1]])
    t.check()
    assert t.depth.tolist() == [[0, 1, 1, 2], [0, -1, -1, -1]]
    assert t.size.tolist() == [4, 1]
    assert t.tokens[1].tolist() == [3, -1, -1, -1]


@pytest.mark.parametrize("field,value,msg", [
    ("parents", [[-1, 0, 3, 1]], "parents must precede"),
    ("depth", [[0, 1, 2, 2]], "depth != parent depth"),
    ("tokens", [[5, -4, 8, 9]], "negative token"),
])
def test_check_catches_broken_trees(field, value, msg):
    t = DraftTree.from_lists([[5, 7, 8, 9]], [[-1, 0, 0, 1]])
    kw = dict(tokens=t.tokens, parents=t.parents, depth=t.depth, logprob=t.logprob, size=t.size)
    kw[field] = torch.tensor(value)
    with pytest.raises(ValueError, match=msg):
        DraftTree(**kw).check()


def test_constructor_rejects_bad_dtypes():
    t = DraftTree.from_lists([[5, 7]], [[-1, 0]])
    with pytest.raises(ValueError, match="logprob must be float32"):
        DraftTree(t.tokens, t.parents, t.depth, t.logprob.double(), t.size)
    with pytest.raises(ValueError, match="tokens must be"):
        DraftTree(t.tokens[0], t.parents, t.depth, t.logprob, t.size)


@pytest.mark.parametrize("seed", range(4))
def test_kept_rows_equal_the_boolean_mask_oracle(seed):
    keep = torch.rand(5, 7, generator=torch.Generator().manual_seed(seed)) < 0.4
    want = keep.reshape(-1).nonzero().squeeze(1)  # the oracle (a boolean-mask read)
    assert torch.equal(kept_rows(keep, int(keep.sum())), want)


def test_pack_left():
    keep = torch.tensor([[False, True, True], [True, False, False]])
    vals = torch.tensor([[4, 5, 6], [7, 8, 9]])
    assert pack_left(keep, vals, 2, -1).tolist() == [[5, 6], [7, -1]]
    assert pack_left(keep, vals, 4, -1).tolist() == [[5, 6, -1, -1], [7, -1, -1, -1]]


def test_buffer_append_and_overflow():
    buf = TreeBuffer(torch.tensor([1, 2]), capacity=4)
    idx = buf.append(torch.tensor([[10, 11, 12], [20, 21, 22]]), torch.zeros(2, 3, dtype=torch.long),
                     torch.tensor([[-0.1, -0.2, -0.3], [-0.1, -0.2, -0.3]]),
                     torch.tensor([[True, False, True], [True, True, True]]))
    assert idx.tolist() == [[1, -1, 2], [1, 2, 3]]
    idx2 = buf.append(torch.tensor([[13, 14], [23, 24]]), torch.tensor([[1, 2], [3, 3]]),
                      torch.tensor([[-1.0, -1.0], [-1.0, -1.0]]), torch.ones(2, 2, dtype=torch.bool))
    assert idx2.tolist() == [[3, -1], [-1, -1]]  # capacity 4 reached
    t = buf.view(depth_bound=3)
    t.check()
    assert t.size.tolist() == [4, 4]
    assert t.tokens.tolist() == [[1, 10, 12, 13], [2, 20, 21, 22]]
    assert t.depth.tolist() == [[0, 1, 1, 2], [0, 1, 1, 1]]


def test_compact_renumbers_parents():
    t = DraftTree.from_lists([[9, 1, 2, 3, 4]], [[-1, 0, 0, 1, 2]])
    c = compact(t, torch.tensor([[True, False, True, False, True]]), 4)
    c.check()
    assert c.tokens.tolist() == [[9, 2, 4, -1]]
    assert c.parents.tolist() == [[-1, 0, 1, -1]]
    assert c.paths() == [[(9,), (9, 2), (9, 2, 4)]]


@pytest.mark.parametrize("dtype, fill", [(torch.int32, -1), (torch.float64, float("-inf")), (torch.bool, False)])
def test_pack_left_keeps_the_values_dtype(dtype, fill):
    keep = torch.tensor([[False, True, True], [True, False, False]])
    vals = torch.tensor([[4, 5, 6], [7, 8, 9]]).to(dtype)
    got = pack_left(keep, vals, 2, fill)
    assert got.dtype == dtype
    want = [[vals[0, 1].item(), vals[0, 2].item()], [vals[1, 0].item(), fill]]
    assert got.tolist() == want
