"""GPU: FlashInfer's paged prefill kernel run with the ragged verify arguments (SGLang's padded ones
compacted by :func:`compact_paged_verify_args`) on heterogeneous trees equals the per-request torch oracle
(bf16 tolerance). Skipped without CUDA + flashinfer."""

import pytest
import torch

from treespec_sglang.plugin.ragged import compact_paged_verify_args

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("bs, sizes, prefixes", [
    (1, [8], [512]),
    (4, [64, 1, 17, 40], [4096, 600, 512, 2048]),
    (16, [8, 64] * 8, [512, 4096] * 8),
])
def test_ragged_flashinfer_verify_equals_the_oracle(bs, sizes, prefixes):
    pytest.importorskip("flashinfer")
    import flashinfer

    from bench.flashinfer_ragged_verify import WORKSPACE, flashinfer_attention, oracle, padded_args, random_trees

    g = torch.Generator().manual_seed(bs)
    n, heads, kv_heads, d = 64, 8, 2, 128
    keep = torch.zeros(bs, n, dtype=torch.bool)
    anc = torch.zeros(bs, n, n, dtype=torch.bool)
    for b, s in enumerate(sizes):
        k1, a1 = random_trees(g, 1, n, s)
        keep[b], anc[b] = k1[0], a1[0]
    kv_indices, kv_indptr, mask = padded_args(torch.tensor(prefixes), anc, "cuda")
    total = int(kv_indptr[-1])
    k_cache = torch.randn(total, kv_heads, d, device="cuda", dtype=torch.bfloat16)
    v_cache = torch.randn_like(k_cache)
    q = torch.randn(bs * n, heads, d, device="cuda", dtype=torch.bfloat16)
    rkv, rkv_indptr, rqo, rmask = compact_paged_verify_args(kv_indices, kv_indptr, mask, keep.cuda())
    assert int(rqo[-1]) == sum(sizes)
    rq = q[keep.cuda().reshape(-1)]
    wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(torch.empty(WORKSPACE, dtype=torch.uint8,
                                                                         device="cuda"), "NHD")
    out = flashinfer_attention(wrapper, rq, k_cache, v_cache, rkv, rkv_indptr, rqo, rmask, heads, kv_heads, d)
    ref = oracle(rq, k_cache, v_cache, rkv, rkv_indptr, rqo, rmask, d ** -0.5)
    torch.testing.assert_close(out.float(), ref, rtol=2e-2, atol=2e-2)
