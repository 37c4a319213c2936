"""Layout edges against plain Python: prefix masks with uneven prefixes, little-endian segment packing
(empty segments, multiples of 8 bits, no bits at all), FlashInfer's int32 index dtypes, the padded retrive
index, ragged grids' default fill and ``DraftTree.to``."""

import random

import pytest
import torch

from tests.helpers import random_batch
from treespec_sglang.tree import (DraftTree, dense_mask, flashinfer_layout, pack_segments_little, prefix_tree_mask,
                                  sglang_retrive, to_grid)


def test_prefix_mask_sees_exactly_each_requests_prefix(rng):
    tree = random_batch(rng, [3, 1, 4])
    lens = [0, 2, 5]
    got = prefix_tree_mask(tree, torch.tensor(lens), 5)
    dense = dense_mask(tree).tolist()
    for b in range(3):
        for i in range(tree.n_nodes):
            assert got[b, i].tolist() == [j < lens[b] for j in range(5)] + dense[b][i]


def pack_loop(segments):
    """Each segment's bits into bytes, bit k of byte j = bit 8 j + k, zero-padded to a whole byte."""
    out, ptr = [], [0]
    for seg in segments:
        nbytes = (len(seg) + 7) // 8
        for j in range(nbytes):
            out.append(sum(1 << k for k in range(8) if 8 * j + k < len(seg) and seg[8 * j + k]))
        ptr.append(ptr[-1] + nbytes)
    return out, ptr


@pytest.mark.parametrize("lens", [[3, 9], [8, 0, 16], [0], [7, 8, 1, 24, 5], [0, 0]])
def test_pack_segments_little_matches_a_loop(lens):
    r = random.Random(sum(lens))
    segments = [[r.random() < 0.5 for _ in range(n)] for n in lens]
    bits = torch.tensor([b for s in segments for b in s], dtype=torch.bool)
    indptr = torch.tensor([0] + [sum(lens[:i + 1]) for i in range(len(lens))])
    want, want_ptr = pack_loop(segments)
    packed, ptr = pack_segments_little(bits, indptr, len(want))
    assert packed.dtype == torch.uint8 and packed.tolist() == want and ptr.tolist() == want_ptr


@pytest.mark.parametrize("sizes, prefix", [([2, 1], [1, 0]), ([4, 2], [4, 2]), ([8], [0])])  # 2 x 4 = 8 bits
def test_flashinfer_layout_indices_are_int32_and_bytes_follow_the_blocks(rng, sizes, prefix):
    tree = random_batch(rng, sizes)
    lay = flashinfer_layout(tree, torch.tensor(prefix))
    for name in ("qo_indptr", "kv_indptr", "mask_indptr", "packed_indptr"):
        assert getattr(lay, name).dtype == torch.int32, name
    blocks = [s * (s + p) for s, p in zip(sizes, prefix)]
    assert lay.packed_indptr.tolist() == [sum((b + 7) // 8 for b in blocks[:i]) for i in range(len(blocks) + 1)]
    assert lay.packed_mask.shape == (sum((b + 7) // 8 for b in blocks),)


def test_sglang_retrive_index_is_padded_unless_asked_ragged():
    tree = DraftTree.from_lists([[1, 2, 3], [4]], [[-1, 0, 0], [-1]])
    assert sglang_retrive(tree).retrive_index.tolist() == [[0, 1, 2], [3, -1, -1]]
    assert sglang_retrive(tree, ragged=True).retrive_index.tolist() == [[0, 1, 2], [3, -1, -1]]
    tree = DraftTree.from_lists([[4], [1, 2, 3]], [[-1], [-1, 0, 0]])
    assert sglang_retrive(tree).retrive_index.tolist() == [[0, -1, -1], [3, 4, 5]]
    assert sglang_retrive(tree, ragged=True).retrive_index.tolist() == [[0, -1, -1], [1, 2, 3]]


def test_to_grid_fills_with_zero_by_default():
    grid = to_grid(torch.tensor([[5.0], [6.0]]), torch.tensor([1, 2]), 2, 2)
    assert grid.tolist() == [[[0.0], [5.0]], [[6.0], [0.0]]]


def test_draft_tree_to_moves_every_field_and_keeps_the_depth_bound():
    t = DraftTree.from_lists([[1, 2]], [[-1, 0]])
    t = DraftTree(t.tokens, t.parents, t.depth, t.logprob, t.size, 5)
    m = t.to("meta")
    assert m.depth_bound == 5
    assert all(x.device.type == "meta" for x in (m.tokens, m.parents, m.depth, m.logprob, m.size))
