"""Ragged FlashInfer verify: attention run with the ragged verify arguments (SGLang's padded ones compacted by
:func:`compact_paged_verify_args`, the queries compacted by the plan's rows and the output scattered back to
SGLang's ``[bs, N]`` grid) equals a per-request torch oracle that starts from the uncompacted grid (the padded
arguments and queries, filler rows included): a compaction bug is caught, not shared by the kernel and its
oracle. The torch attention runs everywhere (float32, CPU); FlashInfer's paged prefill kernel needs CUDA and
``flashinfer`` (bf16 tolerance) and is skipped without them.
"""

import pytest
import torch

from treespec_sglang.plugin.ragged import compact_paged_verify_args, plan_ragged, scatter_rows


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
    """From the uncompacted grid: per request and per padded verify slot i of ``[bs, N]``, the attention of
    query row ``b * N + i`` over its prefix slots and its kept nodes' slots, masked by row i of the request's
    padded ``[N, P_b + N]`` block at those columns; filler slots (not kept) stay zero.
    ``[bs, N, heads, d]`` float32."""
    bs, n = keep.shape
    out, off = torch.zeros(bs, n, q.shape[1], q.shape[2]), 0
    for b in range(bs):
        lo, hi = int(kv_indptr[b]), int(kv_indptr[b + 1])
        prefix = hi - lo - n
        block = mask[off:off + n * (hi - lo)].reshape(n, hi - lo).cpu()  # [N, P_b + N]
        off += n * (hi - lo)
        cols = list(range(prefix)) + [prefix + j for j in range(n) if keep[b, j]]
        slots = kv_indices[lo:hi].long()[cols]
        kb, vb = k_cache[slots].float().cpu(), v_cache[slots].float().cpu()  # [cols, kv_heads, d]
        rep = q.shape[1] // kb.shape[1]
        kb, vb = kb.repeat_interleave(rep, 1), vb.repeat_interleave(rep, 1)
        for i in range(n):
            if not keep[b, i]:
                continue
            s = torch.einsum("hd,khd->hk", q[b * n + i].float().cpu(), kb) * scale  # [heads, cols]
            s = s.masked_fill(~block[i, cols][None], float("-inf"))
            out[b, i] = torch.einsum("hk,khd->hd", s.softmax(-1), vb)
    return out


def torch_attention(q, k_cache, v_cache, kv_indices, kv_indptr, qo_indptr, mask, heads, kv_heads, d):
    """The ragged arguments run by plain torch (float32), FlashInfer's layout: request b's query rows
    ``qo_indptr[b]:qo_indptr[b + 1]``, its KV slots ``kv_indices[kv_indptr[b]:kv_indptr[b + 1]]`` and its
    ``[qo_len, kv_len]`` mask block row-major."""
    from bench.flashinfer_ragged_verify import oracle

    return oracle(q, k_cache, v_cache, kv_indices, kv_indptr, qo_indptr, mask, d ** -0.5)


def flashinfer_run(q, k_cache, v_cache, kv_indices, kv_indptr, qo_indptr, mask, heads, kv_heads, d):
    import flashinfer

    from bench.flashinfer_ragged_verify import WORKSPACE, flashinfer_attention

    wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(torch.empty(WORKSPACE, dtype=torch.uint8,
                                                                         device=q.device), "NHD")
    return flashinfer_attention(wrapper, q, k_cache, v_cache, kv_indices, kv_indptr, qo_indptr, mask, heads,
                                kv_heads, d)


def flashinfer_device():
    pytest.importorskip("flashinfer")
    if not torch.cuda.is_available():
        pytest.skip("FlashInfer's kernels need CUDA")
    return "cuda"


BACKENDS = {  # name -> (device getter, run, dtype, head dim, tolerance)
    "torch": (lambda: "cpu", torch_attention, torch.float32, 32, 1e-5),
    "flashinfer": (flashinfer_device, flashinfer_run, torch.bfloat16, 128, 2e-2),
}


CASES = [  # bs, tree sizes, prefix lengths, N
    (1, [8], [512], 64),
    (4, [64, 1, 17, 40], [4096, 600, 512, 2048], 64),
    (3, [5, 1, 9], [7, 0, 30], 9),
    (16, [8, 64] * 8, [512, 4096] * 8, 64),  # GPU only (about 20 s of torch loops on 2 CPU cores)
]


@pytest.mark.parametrize("host_prefix", [False, True])  # the plugin's path: the prefixes from seq_lens_cpu
@pytest.mark.parametrize("backend, bs, sizes, prefixes, n", [("torch",) + c for c in CASES[:3]] + [
    pytest.param("flashinfer", *c, marks=pytest.mark.gpu) for c in CASES])
def test_ragged_verify_equals_the_oracle_on_the_padded_grid(backend, bs, sizes, prefixes, n, host_prefix):
    get_device, run, dtype, d, tol = BACKENDS[backend]
    device = get_device()
    heads, kv_heads = 8, 2
    keep, kv_indices, kv_indptr, mask, k_cache, v_cache, q = ragged_case(bs, sizes, prefixes, device, n=n,
                                                                         heads=heads, kv_heads=kv_heads, d=d,
                                                                         dtype=dtype)
    plan = plan_ragged(keep, None, "flashinfer")  # the plugin's plan: the query rows the forward runs
    rkv, rkv_indptr, rqo, rmask = compact_paged_verify_args(kv_indices, kv_indptr, mask, keep,
                                                            host_prefix=prefixes if host_prefix else None)
    out = run(q[plan.rows], k_cache, v_cache, rkv, rkv_indptr, rqo, rmask, heads, kv_heads, d)
    grid = scatter_rows(out.float(), plan, bs).cpu()  # back on SGLang's [bs * N] rows, filler zero
    ref = padded_oracle(q, k_cache, v_cache, kv_indices, kv_indptr, mask, keep.cpu(), d ** -0.5)
    assert int(rqo[-1]) == sum(sizes)
    torch.testing.assert_close(grid.view(bs, n, heads, d), ref, rtol=tol, atol=tol)
