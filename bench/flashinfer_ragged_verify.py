"""GPU: FlashInfer verify attention over heterogeneous trees, ragged (each request at its own tree size,
the arguments :func:`treespec_sglang.plugin.ragged.compact_paged_verify_args` builds from SGLang's padded
ones) vs padded (every request at N, what SGLang runs without ragged verify), same batch, same run.

Checks each ragged configuration against the per-request torch oracle first (bf16 tolerance), then times
``plan`` + ``run`` of one attention layer with CUDA events (median of ``--iters``).

    python bench/flashinfer_ragged_verify.py --bs 1,16,64 --n 64 --sizes 8,16,32,64 --prefixes 512,4096
"""

import argparse
import json
import statistics

import torch

from treespec_sglang.plugin.ragged import compact_paged_verify_args

WORKSPACE = 256 * 1024 * 1024


def random_trees(g, bs, n, size):
    """``[bs, N]`` keep (closed under ancestors, ``size`` nodes each) and ``[bs, N, N]`` ancestor masks."""
    anc = torch.zeros(bs, n, n, dtype=torch.bool)
    keep = torch.zeros(bs, n, dtype=torch.bool)
    for b in range(bs):
        parent = [-1] + [int(torch.randint(0, i, (1,), generator=g)) for i in range(1, n)]
        for i in range(n):
            anc[b, i, i] = True
            if parent[i] >= 0:
                anc[b, i] |= anc[b, parent[i]]
        keep[b, :size] = True  # parents precede children: any index prefix is a connected tree
    return keep, anc


def padded_args(prefix, anc, device):
    bs, n, _ = anc.shape
    kv_len = prefix + n
    kv_indptr = torch.zeros(bs + 1, dtype=torch.int32)
    kv_indptr[1:] = torch.cumsum(kv_len, 0)
    kv_indices = torch.randperm(int(kv_indptr[-1])).int()
    mask = torch.cat([torch.cat([torch.ones(n, int(p), dtype=torch.bool), anc[b]], 1).reshape(-1)
                      for b, p in enumerate(prefix)])
    return kv_indices.to(device), kv_indptr.to(device), mask.to(device)


def oracle(q, k_cache, v_cache, kv_indices, kv_indptr, qo_indptr, mask, scale):
    out, moff = torch.zeros_like(q, dtype=torch.float32), 0
    for b in range(len(kv_indptr) - 1):
        qs = slice(int(qo_indptr[b]), int(qo_indptr[b + 1]))
        kv = kv_indices[kv_indptr[b]:kv_indptr[b + 1]].long()
        m = mask[moff:moff + (qs.stop - qs.start) * len(kv)].reshape(qs.stop - qs.start, len(kv))
        moff += m.numel()
        kb, vb = k_cache[kv].float(), v_cache[kv].float()
        rep = q.shape[1] // kb.shape[1]
        kb, vb = kb.repeat_interleave(rep, 1), vb.repeat_interleave(rep, 1)
        s = torch.einsum("qhd,khd->hqk", q[qs].float(), kb) * scale
        out[qs] = torch.einsum("hqk,khd->qhd", s.masked_fill(~m, float("-inf")).softmax(-1), vb)
    return out


def flashinfer_attention(wrapper, q, k_cache, v_cache, kv_indices, kv_indptr, qo_indptr, mask, heads, kv_heads, d):
    import flashinfer  # noqa: F401

    last = torch.ones(len(kv_indptr) - 1, dtype=torch.int32, device=q.device)
    wrapper.plan(qo_indptr, kv_indptr, kv_indices, last, heads, kv_heads, d, 1, custom_mask=mask, causal=False,
                 q_data_type=q.dtype, kv_data_type=k_cache.dtype)
    return wrapper.run(q, (k_cache[:, None], v_cache[:, None]))


def timed(fn, iters):
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def main():
    import flashinfer

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bs", default="1,16,64")
    ap.add_argument("--n", type=int, default=64)
    ap.add_argument("--sizes", default="8,16,32,64", help="tree size of every request (ragged), comma list")
    ap.add_argument("--prefixes", default="512,4096")
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    dev, dt = "cuda", torch.bfloat16
    g = torch.Generator().manual_seed(0)
    ws = torch.empty(WORKSPACE, dtype=torch.uint8, device=dev)
    wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD")
    scale = a.head_dim ** -0.5
    rows = []
    print("| bs | prefix | tree size | N | padded ms | ragged ms | speedup | max err vs oracle |")
    print("|---|---|---|---|---|---|---|---|")
    for bs in [int(x) for x in a.bs.split(",")]:
        for p in [int(x) for x in a.prefixes.split(",")]:
            for size in [int(x) for x in a.sizes.split(",")]:
                keep, anc = random_trees(g, bs, a.n, size)
                prefix = torch.full((bs,), p)
                kv_indices, kv_indptr, mask = padded_args(prefix, anc, dev)
                total = int(kv_indptr[-1])
                k_cache = torch.randn(total, a.kv_heads, a.head_dim, device=dev, dtype=dt)
                v_cache = torch.randn_like(k_cache)
                q = torch.randn(bs * a.n, a.heads, a.head_dim, device=dev, dtype=dt)
                qo = torch.arange(bs + 1, dtype=torch.int32, device=dev) * a.n
                keep = keep.to(dev)
                rows_kept = keep.reshape(-1).nonzero().squeeze(1)
                rkv, rkv_indptr, rqo, rmask = compact_paged_verify_args(kv_indices, kv_indptr, mask, keep)
                rq = q[rows_kept]
                out = flashinfer_attention(wrapper, rq, k_cache, v_cache, rkv, rkv_indptr, rqo, rmask,
                                           a.heads, a.kv_heads, a.head_dim)
                err = None
                if bs * p <= 16 * 4096:  # the loop oracle on the smaller configurations
                    ref = oracle(rq, k_cache, v_cache, rkv, rkv_indptr, rqo, rmask, scale)
                    err = float((out.float() - ref).abs().max())
                    assert err < 5e-2, f"ragged FlashInfer differs from the oracle by {err}"
                t_pad = timed(lambda: flashinfer_attention(wrapper, q, k_cache, v_cache, kv_indices, kv_indptr, qo,
                                                           mask, a.heads, a.kv_heads, a.head_dim), a.iters)
                t_rag = timed(lambda: flashinfer_attention(wrapper, rq, k_cache, v_cache, rkv, rkv_indptr, rqo,
                                                           rmask, a.heads, a.kv_heads, a.head_dim), a.iters)
                rows.append(dict(bs=bs, prefix=p, size=size, n=a.n, padded_ms=t_pad, ragged_ms=t_rag, max_err=err))
                print(f"| {bs} | {p} | {size} | {a.n} | {t_pad:.3f} | {t_rag:.3f} | {t_pad / t_rag:.2f}x | "
                      f"{'-' if err is None else f'{err:.1e}'} |", flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
