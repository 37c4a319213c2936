"""GPU: FlashInfer's paged prefill kernel run with the ragged verify arguments (SGLang's padded ones
compacted by :func:`compact_paged_verify_args`) on heterogeneous trees equals a per-request torch oracle
that starts from the padded, uncompacted arguments (bf16 tolerance): a compaction bug is caught, not
shared by the kernel and its oracle. Skipped without CUDA + flashinfer."""

import pytest
import torch

from treespec_sglang.plugin.ragged import compact_paged_verify_args

pytestmark = pytest.mark.gpu


def closed_keep(g, anc, size):
    """``[N]`` bool: a random ancestor-closed set of ``size`` nodes (root included, not an index prefix) of
    the tree whose ``[N, N]`` ancestors-or-self mask is ``anc`` (a node's parent: its last proper ancestor)."""
    n = anc.shape[0]
    parent = [-1] + [max(j for j in range(i) if anc[i, j]) for i in range(1, n)]
    keep = [True] + [False] * (n - 1)
    for _ in range(size - 1):
        frontier = [i for i in range(n) if not keep[i] and keep[parent[i]]]
        keep[frontier[int(torch.randint(len(frontier), (1,), generator=g))]] = True
    return torch.tensor(keep)


def ragged_case(bs, sizes, prefixes, device, n=64, heads=8, kv_heads=2, d=128, dtype=torch.bfloat16):
    """One batch of trees padded to N (SGLang's verify arguments) with a random kept subtree per request:
    (keep ``[bs, N]``, kv_indices, kv_indptr, mask (padded), k_cache / v_cache ``[slots, kv_heads, d]``,
    q ``[bs * N, heads, d]``)."""
    from bench.flashinfer_ragged_verify import padded_args, random_trees

    g = torch.Generator().manual_seed(bs)
    keep = torch.zeros(bs, n, dtype=torch.bool)
    anc = torch.zeros(bs, n, n, dtype=torch.bool)
    for b, s in enumerate(sizes):
        _, a1 = random_trees(g, 1, n, s)
        anc[b] = a1[0]
        keep[b] = closed_keep(g, anc[b], s)
    kv_indices, kv_indptr, mask = padded_args(torch.tensor(prefixes), anc, device)
    total = int(kv_indptr[-1])
    k_cache = torch.randn(total, kv_heads, d, generator=g).to(device, dtype)
    v_cache = torch.randn(total, kv_heads, d, generator=g).to(device, dtype)
    q = torch.randn(bs * n, heads, d, generator=g).to(device, dtype)
    return keep.to(device), kv_indices, kv_indptr, mask, k_cache, v_cache, q


def padded_oracle(q, k_cache, v_cache, kv_indices, kv_indptr, mask, keep, scale):
    """Per request (request-major, kept nodes in index order): attention of its kept nodes' query rows
    ``b * N + i`` over its prefix slots and its kept nodes' slots, masked by those rows and columns of the
    request's padded ``[N, P_b + N]`` block. ``[sum_b n_b, heads, d]`` float32."""
    bs, n = keep.shape
    out, off = [], 0
    for b in range(bs):
        lo, hi = int(kv_indptr[b]), int(kv_indptr[b + 1])
        prefix = hi - lo - n
        block = mask[off:off + n * (hi - lo)].reshape(n, hi - lo)  # [N, P_b + N]
        off += n * (hi - lo)
        kept = [i for i in range(n) if keep[b, i]]
        cols = list(range(prefix)) + [prefix + j for j in kept]
        slots = kv_indices[lo:hi].long()[cols]
        kb, vb = k_cache[slots].float(), v_cache[slots].float()  # [cols, kv_heads, d]
        rep = q.shape[1] // kb.shape[1]
        kb, vb = kb.repeat_interleave(rep, 1), vb.repeat_interleave(rep, 1)
        qb = q[[b * n + i for i in kept]].float()  # [n_b, heads, d]
        s = torch.einsum("qhd,khd->hqk", qb, kb) * scale  # [heads, n_b, cols]
        s = s.masked_fill(~block[kept][:, cols][None], float("-inf"))
        out.append(torch.einsum("hqk,khd->qhd", s.softmax(-1), vb))
    return torch.cat(out)


@pytest.mark.parametrize("bs, sizes, prefixes", [
    (1, [8], [512]),
    (4, [64, 1, 17, 40], [4096, 600, 512, 2048]),
    (16, [8, 64] * 8, [512, 4096] * 8),
])
def test_ragged_flashinfer_verify_equals_the_oracle(bs, sizes, prefixes):
    pytest.importorskip("flashinfer")
    import flashinfer

    from bench.flashinfer_ragged_verify import WORKSPACE, flashinfer_attention

    heads, kv_heads, d = 8, 2, 128
    keep, kv_indices, kv_indptr, mask, k_cache, v_cache, q = ragged_case(bs, sizes, prefixes, "cuda", heads=heads,
                                                                         kv_heads=kv_heads, d=d)
    rkv, rkv_indptr, rqo, rmask = compact_paged_verify_args(kv_indices, kv_indptr, mask, keep)
    assert int(rqo[-1]) == sum(sizes)
    rq = q[keep.reshape(-1)]
    wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(torch.empty(WORKSPACE, dtype=torch.uint8,
                                                                         device="cuda"), "NHD")
    out = flashinfer_attention(wrapper, rq, k_cache, v_cache, rkv, rkv_indptr, rqo, rmask, heads, kv_heads, d)
    ref = padded_oracle(q, k_cache, v_cache, kv_indices, kv_indptr, mask, keep, d ** -0.5)
    torch.testing.assert_close(out.float(), ref, rtol=2e-2, atol=2e-2)
