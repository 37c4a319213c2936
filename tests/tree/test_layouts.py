import numpy as np
import pytest
import torch

from tests.helpers import random_batch
from treespec_sglang.tree import (dense_mask, flashinfer_layout, pack_segments_little, positions,
                                  prefix_tree_mask, sglang_retrive)


def ancestors(parents, i):
    out = {i}
    while parents[i] >= 0:
        i = parents[i]
        out.add(i)
    return out


@pytest.mark.parametrize("sizes", [[1], [5], [7, 1, 12], [3, 16, 9, 2]])
def test_dense_mask_is_ancestor_or_self(rng, sizes):
    t = random_batch(rng, sizes)
    m = dense_mask(t)
    n = t.n_nodes
    for b, size in enumerate(sizes):
        par = t.parents[b].tolist()
        for i in range(n):
            expect = ancestors(par, i) if i < size else {i}
            assert {j for j in range(n) if m[b, i, j]} == expect


def test_positions_are_prefix_plus_depth(rng):
    t = random_batch(rng, [6, 3])
    pos = positions(t, torch.tensor([10, 0]))
    assert pos[0].tolist() == [10 + d for d in t.depth[0].tolist()]
    assert pos[1, :3].tolist() == t.depth[1, :3].tolist()


@pytest.mark.parametrize("sizes,prefix", [([1], [0]), ([4, 1, 9], [3, 0, 17]), ([13, 13, 2, 6], [1, 8, 5, 0])])
def test_flashinfer_flat_mask_unpacks_to_dense(rng, sizes, prefix):
    t = random_batch(rng, sizes)
    pl = torch.tensor(prefix)
    lay = flashinfer_layout(t, pl)
    dense = dense_mask(t)
    assert lay.qo_indptr.tolist() == np.cumsum([0] + sizes).tolist()
    assert lay.kv_indptr.tolist() == np.cumsum([0] + [p + s for p, s in zip(prefix, sizes)]).tolist()
    for b, (s, p) in enumerate(zip(sizes, prefix)):
        block = lay.custom_mask[lay.mask_indptr[b]:lay.mask_indptr[b + 1]].view(s, p + s)
        assert block[:, :p].all()
        assert torch.equal(block[:, p:], dense[b, :s, :s])
        # packed: numpy little-endian packbits of this segment, byte-padded
        seg = block.flatten().numpy()
        ref = np.packbits(seg, bitorder="little")
        got = lay.packed_mask[lay.packed_indptr[b]:lay.packed_indptr[b + 1]].numpy()
        assert np.array_equal(got, ref)
    # the padded mask oracle agrees too
    pm = prefix_tree_mask(t, pl, max(prefix))
    for b, (s, p) in enumerate(zip(sizes, prefix)):
        block = lay.custom_mask[lay.mask_indptr[b]:lay.mask_indptr[b + 1]].view(s, p + s)
        assert torch.equal(pm[b, :s, :p], block[:, :p])
        assert torch.equal(pm[b, :s, max(prefix):max(prefix) + s], block[:, p:])


def test_pack_segments_worked_example():
    bits = torch.tensor([1, 0, 1] + [1] * 9, dtype=torch.bool)
    packed, ind = pack_segments_little(bits, torch.tensor([0, 3, 12]), 3)
    assert packed.tolist() == [5, 255, 1]
    assert ind.tolist() == [0, 1, 3]


def sglang_kernel_restatement(parents, n):
    """build_tree_efficient's host logic: nodes last to first, each pushed as its parent's first child."""
    next_token, next_sib = [-1] * n, [-1] * n
    for i in range(len(parents) - 1, 0, -1):
        p = parents[i]
        if next_token[p] == -1:
            next_token[p] = i
        else:
            next_sib[i] = next_token[p]
            next_token[p] = i
    return next_token, next_sib


@pytest.mark.parametrize("ragged", [False, True])
def test_retrive_arrays_match_sglang_kernel(rng, ragged):
    sizes = [9, 1, 14, 5]
    t = random_batch(rng, sizes)
    r = sglang_retrive(t, ragged=ragged)
    offset = 0
    for b, s in enumerate(sizes):
        nt, ns = sglang_kernel_restatement(t.parents[b, :s].tolist(), s)
        assert r.retrive_next_token[b, :s].tolist() == nt
        assert r.retrive_next_sibling[b, :s].tolist() == ns
        base = offset if ragged else b * t.n_nodes
        assert r.retrive_index[b, :s].tolist() == [base + i for i in range(s)]
        assert (r.retrive_index[b, s:] == -1).all()
        offset += s


@pytest.mark.parametrize("topk,depth,n,seq_lens", [(3, 3, 8, [5, 0, 12]), (4, 4, 16, [1, 30]), (2, 5, 9, [7])])
def test_sglang_verify_arrays_equal_the_build_tree_kernel(topk, depth, n, seq_lens):
    """Our EAGLE-2 trees through sglang_verify_arrays == SGLang's select/organize + the CUDA kernel
    (line-by-line restatement) fed the same draft."""
    from tests.helpers import PathDraft
    from tests.policies import oracles
    from treespec_sglang.policies import grow_tree
    from treespec_sglang.tree import sglang_verify_arrays

    draft = PathDraft(30, seed=topk * depth, sharpness=1.5)
    roots = torch.arange(len(seq_lens)) + 2
    spec = {"policy": "eagle2", "budget": n, "topk": topk, "depth": depth}
    tree = grow_tree([spec] * len(seq_lens), roots, draft.root(roots), draft.expand)
    got = sglang_verify_arrays(tree, torch.tensor(seq_lens))
    pools = [oracles.sglang_draft_pool(draft, int(r), topk, depth, n) for r in roots]
    parent_list = [p[0][0].tolist() for p in pools]
    selected = [p[1][0].tolist() for p in pools]
    mask, pos, ri, rnt, rns = oracles.sglang_build_tree_kernel(parent_list, selected, seq_lens, topk, depth, n)
    assert got.tree_mask.tolist() == mask
    assert got.positions.tolist() == pos
    assert got.retrive_index.flatten().tolist() == ri
    assert got.retrive_next_token.flatten().tolist() == rnt
    assert got.retrive_next_sibling.flatten().tolist() == rns
    assert got.draft_tokens.tolist() == [t for r, p in zip(roots, pools) for t in [int(r)] + p[2][0].tolist()]


def test_sglang_verify_arrays_unlink_padding_nodes(rng):
    t = random_batch(rng, [5, 2])  # padded to 5 nodes: request 1 has 3 unlinked slots
    from treespec_sglang.tree import sglang_verify_arrays

    a = sglang_verify_arrays(t, torch.tensor([4, 3]))
    reach = set()
    stack = [0]
    while stack:  # walk request 1's first-child / next-sibling chains from the root
        u = stack.pop()
        reach.add(u)
        for v in (int(a.retrive_next_token[1, u]), int(a.retrive_next_sibling[1, u]) if u else -1):
            if v >= 0:
                stack.append(v)
    assert reach == {0, 1}
    assert a.tree_mask.numel() == 5 * (4 + 5) + 5 * (3 + 5)
