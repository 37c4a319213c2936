"""The attention stand-ins against a per-request, per-token restatement (float64 loops, explicit softmax)."""

import math

import pytest
import torch

from treespec_sglang.plugin.cpu.attention import decode_attention_cpu, extend_attention_cpu

HQ, HKV, D = 6, 2, 32  # head size: the compiled ops take multiples of 32


def naive(q, keys, values, scale, logit_cap=0.0, sink=None):
    """q [Hq, D], keys/values [L, Hkv, D] (only the visible ones) -> [Hq, D]."""
    out = torch.zeros(HQ, D, dtype=torch.float64)
    for h in range(HQ):
        kh = h // (HQ // HKV)
        s = [float(q[h].double() @ keys[j, kh].double()) * scale for j in range(len(keys))]
        if logit_cap:
            s = [logit_cap * math.tanh(x / logit_cap) for x in s]
        m = max(s + ([float(sink[h])] if sink is not None else []))
        w = [math.exp(x - m) for x in s]
        z = sum(w) + (math.exp(float(sink[h]) - m) if sink is not None else 0.0)
        for j in range(len(keys)):
            out[h] += w[j] / z * values[j, kh].double()
    return out


def pool(g, slots=64, pool_rows=5, pool_len=32):
    k_buf = torch.randn(slots, HKV, D, generator=g)
    v_buf = torch.randn(slots, HKV, D, generator=g)
    req_to_token = torch.stack([torch.randperm(slots, generator=g)[:pool_len] for _ in range(pool_rows)]).int()
    return k_buf, v_buf, req_to_token


@pytest.mark.parametrize("seq_lens,window,logit_cap,sinks,scales,fp8", [
    ([5, 1, 12], 0, 0.0, False, (1.0, 1.0), False), ([7, 3], 4, 0.0, False, (1.0, 1.0), False),
    ([9, 2, 4], 0, 5.0, True, (1.0, 1.0), False), ([6, 3], 0, 1.0, False, (0.5, 2.0), False),
    ([4, 8], 1, 0.0, True, (1.0, 1.0), False), ([5, 7], 0, 0.0, False, (2.0, 0.5), True),
    ([6, 6], 0, 0.0, False, (1.0, 1.0), False)])  # as many keys as query heads: the grouped heads still grouped
def test_decode_attention(seq_lens, window, logit_cap, sinks, scales, fp8):
    """``fp8``: a float8 e4m3 cache, read in the query's type, its scales applied."""
    g = torch.Generator().manual_seed(len(seq_lens) + window)
    k_buf, v_buf, r2t = pool(g)
    if fp8:
        k_buf, v_buf = k_buf.to(torch.float8_e4m3fn), v_buf.to(torch.float8_e4m3fn)
    bs = len(seq_lens)
    rpi = torch.tensor([3, 0, 4][:bs])
    seq = torch.tensor(seq_lens)
    loc = r2t[rpi, seq - 1].long()  # the new token's slot (already in req_to_token, as in SGLang decode)
    q = torch.randn(bs, HQ, D, generator=g)
    key, value = torch.randn(bs, HKV, D, generator=g), torch.randn(bs, HKV, D, generator=g)
    sink = torch.randn(HQ, generator=g) if sinks else None
    out = torch.empty(bs, HQ, D)
    attn_logits = torch.zeros(bs, HQ, 4, D + 1)  # SGLang's [bs, Hq, kv splits, Dv + 1] float32 scratch
    decode_attention_cpu(q, k_buf, v_buf, *scales, out, key, value, loc, attn_logits, r2t, rpi, seq, 0.3, logit_cap,
                         False, window, None, sink)
    # the new K/V were stored first (in the cache's type)
    assert torch.equal(k_buf[loc], key.to(k_buf.dtype)) and torch.equal(v_buf[loc], value.to(v_buf.dtype))
    for b in range(bs):
        s = int(seq[b])
        lo = max(0, s - window) if window > 0 else 0
        slots = r2t[rpi[b], lo:s].long()
        keys, vals = k_buf[slots].double() * scales[0], v_buf[slots].double() * scales[1]
        want = naive(q[b], keys, vals, 0.3, logit_cap, sink)
        torch.testing.assert_close(out[b].double(), want, atol=1e-5, rtol=1e-5)


def tree_block(ext):
    """A random ancestor mask [ext, ext]: parent of i < i, row = ancestors-or-self."""
    par = [-1] + [torch.randint(0, i, (1,)).item() for i in range(1, ext)]
    m = torch.zeros(ext, ext, dtype=torch.bool)
    for i in range(ext):
        j = i
        while j >= 0:
            m[i, j] = True
            j = par[j]
    return m


@pytest.mark.parametrize("mode", ["causal", "tree", "full", "window", "narrow", "capped"])
@pytest.mark.parametrize("shape", [([6, 9], [3, 4]), ([4, 8, 2], [4, 5, 1]), ([5], [5]), ([3, 5], [2, 1])])
def test_extend_attention(mode, shape):
    torch.manual_seed(sum(shape[0]) + len(mode))
    g = torch.Generator().manual_seed(7)
    k_buf, v_buf, r2t = pool(g)
    seq_lens, ext_lens = shape
    if mode == "tree":
        ext_lens = [4] * len(seq_lens)  # verify: every request extends by N
        seq_lens = [max(s, 4) for s in seq_lens]
    bs = len(seq_lens)
    rpi = torch.tensor([1, 4, 2][:bs])
    seq, ext = torch.tensor(seq_lens), torch.tensor(ext_lens, dtype=torch.int32)  # SGLang's dtypes
    start = (torch.cumsum(ext, 0) - ext).int()
    T = int(ext.sum())
    q = torch.randn(T, HQ, D, generator=g)
    k_ext, v_ext = torch.randn(T, HKV, D, generator=g), torch.randn(T, HKV, D, generator=g)
    blocks = [tree_block(e) for e in ext_lens] if mode == "tree" else None
    tree_mask = torch.cat([b.reshape(-1) for b in blocks]) if blocks else None
    window = {"window": 3, "narrow": 1}.get(mode, 0)  # narrow: each query sees itself alone
    # capped: causal, tanh-capped logits, one sink logit per head, a float8 cache read scaled
    cap, sink, (ks, vs) = (5.0, torch.randn(HQ, generator=g), (2.0, 2.0)) if mode == "capped" else (0.0, None, (1.0, 1.0))
    if mode == "capped":
        k_buf, v_buf = k_buf.to(torch.float8_e4m3fn), v_buf.to(torch.float8_e4m3fn)
    out = torch.full((T, HQ, D), float("nan"))
    extend_attention_cpu(q, k_ext, v_ext, out, k_buf, v_buf, ks, vs, r2t, rpi, seq, ext, start, int(ext.max()),
                         0.25, cap, False, window, None, sink, tree_mask, mode != "full")
    for b in range(bs):
        e, s = ext_lens[b], seq_lens[b]
        pre = s - e
        pk, pv = k_buf[r2t[rpi[b], :pre].long()].double(), v_buf[r2t[rpi[b], :pre].long()].double()
        for i in range(e):
            row = int(start[b]) + i
            if mode == "tree":
                vis = [j for j in range(e) if blocks[b][i, j]]
            elif mode == "full":
                vis = list(range(e))
            else:
                vis = list(range(i + 1))
            keys = torch.cat([pk, k_ext[int(start[b]) + torch.tensor(vis, dtype=torch.long)].double()])
            vals = torch.cat([pv, v_ext[int(start[b]) + torch.tensor(vis, dtype=torch.long)].double()])
            if window:
                pos = list(range(pre)) + [pre + j for j in vis]
                keep = [n for n, p in enumerate(pos) if (pre + i) - p < window]
                keys, vals = keys[keep], vals[keep]
            want = naive(q[row], keys * ks, vals * vs, 0.25, cap, sink)
            torch.testing.assert_close(out[row].double(), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("fp8", [False, True])
def test_a_kv_shared_extend_reads_a_full_rows_last_slot(fp8):
    """Two requests extending by 1 and 3, the first at the pool row's last column: its padded queries' slots lie
    past the row (clamped, then discarded), its one real query reads column 31. ``fp8``: a float8 cache, whose
    extend part is read in the query's type as its prefix is."""
    g = torch.Generator().manual_seed(12)
    k_buf, v_buf, r2t = pool(g)
    if fp8:
        k_buf, v_buf = k_buf.to(torch.float8_e4m3fn), v_buf.to(torch.float8_e4m3fn)
    rpi, seq, ext = torch.tensor([1, 3]), torch.tensor([32, 6]), torch.tensor([1, 3], dtype=torch.int32)
    start = torch.tensor([0, 1], dtype=torch.int32)
    q = torch.randn(4, HQ, D, generator=g)
    a, b = torch.empty(4, HQ, D), torch.empty(4, HQ, D)
    slots = torch.cat([r2t[1, 31:32], r2t[3, 3:6]]).long()
    args = (k_buf, v_buf, 1.0, 1.0, r2t, rpi, seq, ext, start, 3, 0.2, 0.0, False, 0, None, None, None, True)
    extend_attention_cpu(q, None, None, a, *args)
    extend_attention_cpu(q, k_buf[slots].float(), v_buf[slots].float(), b, *args)
    assert torch.equal(a, b)


def test_extend_reads_the_cache_when_k_extend_is_none():
    g = torch.Generator().manual_seed(11)
    k_buf, v_buf, r2t = pool(g)
    rpi, seq, ext = torch.tensor([2]), torch.tensor([7]), torch.tensor([3], dtype=torch.int32)
    q = torch.randn(3, HQ, D, generator=g)
    a, b = torch.empty(3, HQ, D), torch.empty(3, HQ, D)
    slots = r2t[2, 4:7].long()
    args = (k_buf, v_buf, 1.0, 1.0, r2t, rpi, seq, ext, torch.tensor([0], dtype=torch.int32), 3, 0.2, 0.0, False, 0, None, None, None, True)
    extend_attention_cpu(q, None, None, a, *args)
    extend_attention_cpu(q, k_buf[slots], v_buf[slots], b, *args)
    assert torch.equal(a, b)
