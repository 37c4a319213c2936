"""Ragged verify: the compaction plan against loops, and the compacted attention against the padded one."""

import pytest
import torch

from tests.helpers import planned, random_batch
from treespec_sglang.plugin.cpu.attention import extend_attention_cpu
from treespec_sglang.plugin.ragged import compact_paged_verify_args, plan_ragged, scatter_rows
from treespec_sglang.tree import dense_mask


def random_keep(g, bs, n):
    keep = torch.rand(bs, n, generator=g) < 0.5
    keep[:, 0] = True
    keep[0] = True  # one full-size request
    if bs > 1:
        keep[1, 1:] = False  # one root-only request
    return keep


@pytest.mark.parametrize("bs,n", [(1, 1), (3, 5), (4, 8)])
@pytest.mark.parametrize("with_mask", [True, False])
@pytest.mark.parametrize("uniform", [False, True])
def test_plan_matches_loops(bs, n, with_mask, uniform):
    g = torch.Generator().manual_seed(bs * 10 + n)
    keep = random_keep(g, bs, n)
    mask = torch.rand(bs * n * n, generator=g) < 0.5 if with_mask else None
    plan = plan_ragged(keep, mask, uniform=uniform)
    rows, lens, flat = [], [], []
    width = max(sum(keep[b].tolist()) for b in range(bs))
    for b in range(bs):
        kept = [i for i in range(n) if keep[b, i]]
        if uniform:  # every request at the widest tree's size: its kept nodes, then fillers in index order
            kept += [i for i in range(n) if not keep[b, i]][: width - len(kept)]
        rows += [b * n + i for i in kept]
        lens.append(len(kept))
        if with_mask:
            flat += [bool(mask[b * n * n + i * n + j]) for i in kept for j in kept]
    assert plan.rows.tolist() == rows and plan.lens.tolist() == lens
    assert plan.starts.tolist() == [sum(lens[:b]) for b in range(bs)]
    assert (plan.tree_mask.tolist() if with_mask else plan.tree_mask) == (flat if with_mask else None)
    x = torch.randn(plan.total, 3)
    full = scatter_rows(x, plan, bs)
    assert torch.equal(full[plan.rows], x)
    filler = torch.ones(bs * n, dtype=torch.bool)
    filler[plan.rows] = False
    assert not full[filler].any()


def test_plan_rejects_a_non_bool_keep():
    with pytest.raises(ValueError, match="keep must be a \\[bs, N\\] bool"):
        plan_ragged(torch.ones(2, 3), None)


@pytest.mark.parametrize("seed", range(3))
def test_ragged_verify_attention_equals_the_padded_one_on_real_nodes(rng, seed):
    """Each request's tree padded to N with filler (self-only rows, as SGLang's padding): attention over
    the compacted kept nodes == attention over the padded batch, at every kept row."""
    HQ, HKV, D, N = 4, 2, 32, 7
    tree = random_batch(rng, [5, 1, 4, 3], vocab=9)  # root-only and partial trees: the widest has 5 < N nodes
    bs, w = tree.bs, tree.tokens.shape[1]
    keep = torch.zeros(bs, N, dtype=torch.bool)
    keep[:, :w] = tree.valid
    dense = torch.eye(N, dtype=torch.bool).repeat(bs, 1, 1)  # [bs, N, N]; padding rows see themselves only
    dense[:, :w, :w] |= dense_mask(tree)
    dense[:, :, 0] = True
    g = torch.Generator().manual_seed(seed)
    prefix = torch.tensor([3, 5, 1, 4])
    slots = 64
    k_buf, v_buf = torch.randn(slots, HKV, D, generator=g), torch.randn(slots, HKV, D, generator=g)
    r2t = torch.stack([torch.randperm(slots, generator=g)[:32] for _ in range(bs)]).int()
    rpi = torch.arange(bs)
    q = torch.randn(bs * N, HQ, D, generator=g)
    k, v = torch.randn(bs * N, HKV, D, generator=g), torch.randn(bs * N, HKV, D, generator=g)
    padded = torch.zeros(bs * N, HQ, D)
    ext = torch.full((bs,), N, dtype=torch.int32)  # SGLang's int32 extend lengths / starts (as req_to_token)
    extend_attention_cpu(q, k, v, padded, k_buf, v_buf, 1.0, 1.0, r2t, rpi, prefix + N, ext,
                         torch.arange(bs, dtype=torch.int32) * N, N, 0.3, 0.0, False, 0, None, None, dense.reshape(-1),
                         True)
    plan = plan_ragged(keep, dense.reshape(-1), uniform=True)  # a tree mask: one width for the batch
    width = int(plan.lens.max())
    assert plan.total == bs * width == bs * 5
    ragged = torch.zeros(plan.total, HQ, D)
    extend_attention_cpu(q[plan.rows], k[plan.rows], v[plan.rows], ragged, k_buf, v_buf, 1.0, 1.0, r2t, rpi,
                         prefix + plan.lens, plan.lens.int(), plan.starts.int(), width, 0.3, 0.0, False, 0, None, None,
                         plan.tree_mask, True)
    kept = keep.reshape(-1).nonzero()[:, 0]  # the fillers the width brought along are never read
    torch.testing.assert_close(scatter_rows(ragged, plan, bs)[kept], padded[kept])


# ----------------------------------------------------------------- FlashInfer (paged) verify arguments
def padded_paged_args(g, prefix, n, with_tail=True):
    """SGLang's padded verify arguments: KV slots (prefix then N nodes) per request and a FULL_MASK
    ``[N, P_b + N]`` block per request (prefix columns True, a random tree block with a true diagonal)."""
    kv_len = [p + n for p in prefix]
    kv_indptr = torch.tensor([0] + list(torch.cumsum(torch.tensor(kv_len), 0)), dtype=torch.int32)
    kv_indices = torch.randperm(1000, generator=g)[: int(kv_indptr[-1])].int()
    blocks = []
    for p in prefix:
        tri = (torch.rand(n, n, generator=g) < 0.5) | torch.eye(n, dtype=torch.bool)
        blocks.append(torch.cat([torch.ones(n, p, dtype=torch.bool), tri], 1).reshape(-1))
    mask = torch.cat(blocks + ([torch.ones(17, dtype=torch.bool)] if with_tail else []))  # SGLang's graph tail
    return kv_indices, kv_indptr, mask


@pytest.mark.parametrize("prefix", [[3], [0, 5, 2], [4, 1, 7, 2]])
@pytest.mark.parametrize("n", [1, 4, 6])
def test_paged_verify_args_compaction_matches_loops(prefix, n):
    g = torch.Generator().manual_seed(len(prefix) * 10 + n)
    kv_indices, kv_indptr, mask = padded_paged_args(g, prefix, n)
    keep = random_keep(g, len(prefix), n)
    got_kv, got_kv_indptr, got_qo, got_mask = compact_paged_verify_args(kv_indices, kv_indptr, mask, keep)
    want_kv, want_mask, kv_lens, qo_lens, off = [], [], [], [], 0
    for b, p in enumerate(prefix):
        kept = [i for i in range(n) if keep[b, i]]
        cols = list(range(p)) + [p + i for i in kept]
        row_kv = kv_indices[kv_indptr[b]:kv_indptr[b + 1]].tolist()
        want_kv += [row_kv[c] for c in cols]
        block = mask[off:off + n * (p + n)].reshape(n, p + n)
        off += n * (p + n)
        want_mask += [bool(block[r, c]) for r in kept for c in cols]
        kv_lens.append(len(cols))
        qo_lens.append(len(kept))
    assert got_kv.tolist() == want_kv and got_kv.dtype == torch.int32
    assert got_kv_indptr.tolist() == [sum(kv_lens[:b]) for b in range(len(prefix) + 1)]
    assert got_qo.tolist() == [sum(qo_lens[:b]) for b in range(len(prefix) + 1)]
    assert got_mask.tolist() == want_mask


@pytest.mark.parametrize("prefix, n", [([4, 0, 6], 5), ([9], 1), ([2, 7, 0, 3], 4)])
@pytest.mark.parametrize("host_prefix, reads", [(False, 1), (True, 0)])
def test_paged_verify_args_ignore_a_longer_kv_buffer_and_take_the_plans_sizes(prefix, n, host_prefix, reads):
    """SGLang may hand a longer ``kv_indices`` buffer than ``kv_indptr[-1]``: its tail is ignored; the plan's host
    sizes give the same arguments as reading ``keep`` here, with one host read (``kv_indptr``) in all, and none
    with the prefixes on the host too (SGLang's ``seq_lens_cpu``); a prefix list of the wrong length is refused."""
    from treespec_sglang.utils.syncs import count_ops

    g = torch.Generator().manual_seed(sum(prefix) + n)
    kv_indices, kv_indptr, mask = padded_paged_args(g, prefix, n)
    keep = random_keep(g, len(prefix), n)
    want = compact_paged_verify_args(kv_indices, kv_indptr, mask, keep)
    longer = torch.cat([kv_indices, torch.full((5,), 999, dtype=torch.int32)])
    host_lens = keep.sum(-1).tolist()
    on_host = tuple(prefix) if host_prefix else None
    with count_ops() as c:
        got = compact_paged_verify_args(longer, kv_indptr, mask, keep, host_lens, on_host)
    assert all(torch.equal(a, b) for a, b in zip(got, want)) and 999 not in got[0].tolist()
    assert c.reads == reads, c.names
    if host_prefix:
        with pytest.raises(ValueError, match=rf"^host_prefix has {len(prefix) + 1} lengths for a batch of "
                                             rf"{len(prefix)}$"):
            compact_paged_verify_args(kv_indices, kv_indptr, mask, keep, host_lens, on_host + (1,))


class LargestTensors(torch.utils._python_dispatch.TorchDispatchMode):
    """The largest output (elements) of any op, per dtype."""

    def __init__(self):
        super().__init__()
        self.most = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in (out if isinstance(out, (tuple, list)) else [out]):
            if isinstance(t, torch.Tensor):
                self.most[t.dtype] = max(self.most.get(t.dtype, 0), t.numel())
        return out


def test_paged_verify_args_hold_nothing_per_padded_mask_element():
    """A long prefix costs its mask bytes only: no index tensor is as large as the padded mask (the first version
    built several int64 tensors per padded mask element: ~50 bytes per element, GBs at long contexts)."""
    g = torch.Generator().manual_seed(3)
    prefix, n = [3000, 700, 1500], 16
    kv_indices, kv_indptr, mask = padded_paged_args(g, prefix, n, with_tail=False)
    kv_indices = torch.arange(int(kv_indptr[-1]), dtype=torch.int32)
    keep = random_keep(g, len(prefix), n)
    with LargestTensors() as seen:
        args = compact_paged_verify_args(kv_indices, kv_indptr, mask, keep)
    slots, elements = int(kv_indptr[-1]), mask.numel()
    assert elements > 10 * slots
    assert max(v for d, v in seen.most.items() if d != torch.bool) <= slots + 1, seen.most  # indices: per KV slot
    assert seen.most[torch.bool] <= args[3].numel() + 1  # bools: the output mask


def paged_attention(q, k_cache, v_cache, kv_indices, kv_indptr, qo_indptr, mask, scale):
    """Plain per-request loop over the paged layout: the oracle for both argument sets."""
    out, moff = torch.zeros_like(q), 0
    for b in range(len(kv_indptr) - 1):
        qs, kv = slice(int(qo_indptr[b]), int(qo_indptr[b + 1])), kv_indices[kv_indptr[b]:kv_indptr[b + 1]].long()
        m = mask[moff:moff + (qs.stop - qs.start) * len(kv)].reshape(qs.stop - qs.start, len(kv))
        moff += m.numel()
        s = torch.einsum("qhd,khd->hqk", q[qs], k_cache[kv]) * scale
        out[qs] = torch.einsum("hqk,khd->qhd", s.masked_fill(~m, float("-inf")).softmax(-1), v_cache[kv])
    return out


@pytest.mark.parametrize("seed", range(3))
def test_compacted_paged_attention_equals_the_padded_one_on_kept_rows(seed):
    g = torch.Generator().manual_seed(seed)
    prefix, n, H, D = [5, 0, 9, 3], 6, 2, 8
    kv_indices, kv_indptr, mask = padded_paged_args(g, prefix, n, with_tail=False)
    # the padded mask must be a real tree (kept nodes' ancestors kept): ancestors = lower-triangular chain here
    for b, p in enumerate(prefix):
        off = sum(n * (q + n) for q in prefix[:b])
        block = mask[off:off + n * (p + n)].view(n, p + n)
        block[:, p:] = torch.tril(torch.ones(n, n, dtype=torch.bool))
    keep = torch.zeros(len(prefix), n, dtype=torch.bool)
    for b, k in enumerate([n, 1, 3, 5]):  # chain prefixes: full, root only, partial
        keep[b, :k] = True
    k_cache, v_cache = torch.randn(1000, H, D, generator=g), torch.randn(1000, H, D, generator=g)
    q = torch.randn(len(prefix) * n, H, D, generator=g)
    qo = torch.arange(len(prefix) + 1, dtype=torch.int32) * n
    padded = paged_attention(q, k_cache, v_cache, kv_indices, kv_indptr, qo, mask, 0.3)
    plan = plan_ragged(keep, None, "flashinfer")
    args = compact_paged_verify_args(kv_indices, kv_indptr, mask, keep)
    ragged = paged_attention(q[plan.rows], k_cache, v_cache, args[0], args[1], args[2], args[3], 0.3)
    torch.testing.assert_close(ragged, padded[plan.rows])
    assert args[2][-1] == plan.total


def test_flashinfer_args_hook_and_eager_hook_act_only_during_a_flashinfer_ragged_verify():
    from treespec_sglang.plugin import ragged

    g = torch.Generator().manual_seed(0)
    padded = padded_paged_args(g, [2, 3], 4) + (None,)
    padded = (padded[0], padded[1], torch.arange(3, dtype=torch.int32) * 4, padded[2])
    original = lambda spec, **kw: padded  # noqa: E731
    keep = torch.tensor([[1, 1, 0, 0], [1, 0, 1, 1]], dtype=torch.bool)
    assert ragged.flashinfer_verify_args(original, None, req_pool_indices=None) is padded
    assert ragged.eager_while_ragged(lambda r, fb: True, None, None) is True
    for mode, compacts in (("cpu", False), ("flashinfer", True)):
        with planned(plan_ragged(keep, None, mode)):
            got = ragged.flashinfer_verify_args(original, None, req_pool_indices=None)
            assert ragged.eager_while_ragged(lambda r, fb: True, None, None) is False
        if compacts:
            want = compact_paged_verify_args(padded[0], padded[1], padded[3], keep)
            assert all(torch.equal(a, b) for a, b in zip(got, want)) and got[2].tolist() == [0, 2, 5]
        else:
            assert got is padded


@pytest.mark.parametrize("sizes, prefix", [([7, 1, 4, 6], [3, 5, 1, 4]), ([2, 2], [0, 9])])
def test_compacted_paged_args_are_our_flashinfer_layout(rng, sizes, prefix):
    """SGLang's padded verify arguments for trees padded to N, compacted, equal :func:`flashinfer_layout`
    of the trees themselves (the layout the GPU-marked test runs through FlashInfer against the oracle)."""
    from treespec_sglang.tree import flashinfer_layout

    tree = random_batch(rng, sizes, vocab=9)
    bs, n = tree.tokens.shape
    pl = torch.tensor(prefix)
    dense = dense_mask(tree)  # [bs, N, N]
    blocks = [torch.cat([torch.ones(n, p, dtype=torch.bool), dense[b]], 1).reshape(-1) for b, p in enumerate(prefix)]
    kv_indptr = torch.tensor([0] + torch.cumsum(pl + n, 0).tolist(), dtype=torch.int32)
    kv_indices = torch.arange(int(kv_indptr[-1]), dtype=torch.int32)
    got_kv, got_kv_indptr, got_qo, got_mask = compact_paged_verify_args(kv_indices, kv_indptr, torch.cat(blocks),
                                                                        tree.valid)
    lay = flashinfer_layout(tree, pl)
    assert torch.equal(got_qo, lay.qo_indptr) and torch.equal(got_kv_indptr, lay.kv_indptr)
    assert torch.equal(got_mask, lay.custom_mask.bool())
