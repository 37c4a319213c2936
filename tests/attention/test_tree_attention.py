"""vLLM-style check: for every branch of random trees, tree attention equals causal attention over
that branch alone; the ragged backends agree with the padded dense oracle."""

import pytest
import torch

from tests.helpers import random_batch
from treespec_sglang.attention import get_backend, tree_attention
from treespec_sglang.tree import prefix_tree_mask


def node_qkv(t, prefix_lens, H, Hk, D, seed=0):
    g = torch.Generator().manual_seed(seed)
    bs, n = t.tokens.shape
    P = int(prefix_lens.max())
    q = torch.randn(bs, H, n, D, generator=g)
    k = torch.randn(bs, Hk, P + n, D, generator=g)
    v = torch.randn(bs, Hk, P + n, D, generator=g)
    return q, k, v, P


@pytest.mark.parametrize("sizes,prefix,heads", [([6], [0], (2, 2)), ([9, 4, 12], [3, 7, 1], (4, 2)), ([1, 15], [5, 2], (3, 1))])
def test_every_branch_equals_causal_attention(rng, sizes, prefix, heads):
    t = random_batch(rng, sizes)
    pl = torch.tensor(prefix)
    H, Hk = heads
    q, k, v, P = node_qkv(t, pl, H, Hk, 8)
    out = tree_attention(q, k, v, prefix_tree_mask(t, pl, P))
    for b, s in enumerate(sizes):
        par = t.parents[b].tolist()
        for leaf in range(s):
            branch, i = [], leaf
            while i >= 0:
                branch.append(i)
                i = par[i]
            branch.reverse()
            # chain: the request's own prefix then the branch's nodes, plain causal mask
            cols = list(range(prefix[b])) + [P + i for i in branch]
            kk, vv = k[b:b + 1, :, cols], v[b:b + 1, :, cols]
            qq = q[b:b + 1, :, branch]
            L = len(cols)
            causal = torch.ones(L, L, dtype=torch.bool).tril()[prefix[b]:][None]
            ref = tree_attention(qq, kk, vv, causal)
            torch.testing.assert_close(out[b, :, branch], ref[0], rtol=1e-5, atol=1e-5)


def ragged_from_padded(t, pl, q, k, v, P):
    qs, ks, vs = [], [], []
    for b in range(t.bs):
        s, p = int(t.size[b]), int(pl[b])
        qs.append(q[b, :, :s].transpose(0, 1))
        idx = list(range(p)) + [P + i for i in range(s)]
        ks.append(k[b, :, idx].transpose(0, 1))
        vs.append(v[b, :, idx].transpose(0, 1))
    return torch.cat(qs), torch.cat(ks), torch.cat(vs)


def test_torch_ragged_backend_matches_padded_oracle(rng):
    sizes, prefix = [5, 11, 1, 8], [4, 0, 9, 2]
    t = random_batch(rng, sizes)
    pl = torch.tensor(prefix)
    q, k, v, P = node_qkv(t, pl, 4, 2, 16, seed=3)
    dense = tree_attention(q, k, v, prefix_tree_mask(t, pl, P))
    rq, rk, rv = ragged_from_padded(t, pl, q, k, v, P)
    be = get_backend("torch")
    be.plan(t, pl, 4, 2, 16)
    out = be.run(rq, rk, rv)
    ref = torch.cat([dense[b, :, :s].transpose(0, 1) for b, s in enumerate(sizes)])
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_unknown_backend_is_a_clear_error():
    with pytest.raises(ValueError, match="attention backend must be one of"):
        get_backend("xformers")


@pytest.mark.gpu
@pytest.mark.parametrize("paged", [False, True])
def test_flashinfer_matches_torch_oracle(rng, paged):
    pytest.importorskip("flashinfer")
    sizes, prefix = [60, 7, 33, 1, 18], [120, 15, 300, 2, 64]
    t = random_batch(rng, sizes, vocab=200, max_children=6)
    pl = torch.tensor(prefix)
    q, k, v, P = node_qkv(t, pl, 8, 2, 128, seed=5)
    rq, rk, rv = ragged_from_padded(t, pl, q, k, v, P)
    ref_be = get_backend("torch")
    ref_be.plan(t, pl, 8, 2, 128)
    ref = ref_be.run(rq, rk, rv)
    be = get_backend("flashinfer", device="cuda", paged=paged)
    be.plan(t.to("cuda"), pl.cuda(), 8, 2, 128)
    out = be.run(rq.half().cuda(), rk.half().cuda(), rv.half().cuda())
    torch.testing.assert_close(out.float().cpu(), ref, rtol=2e-2, atol=2e-2)
