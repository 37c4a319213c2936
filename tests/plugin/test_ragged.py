"""Ragged verify: the compaction plan against loops, and the compacted attention against the padded one."""

import pytest
import torch

from tests.helpers import random_batch
from treespec_sglang.plugin.cpu.attention import extend_attention_cpu
from treespec_sglang.plugin.ragged import plan_ragged, scatter_rows
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
def test_plan_matches_loops(bs, n, with_mask):
    g = torch.Generator().manual_seed(bs * 10 + n)
    keep = random_keep(g, bs, n)
    mask = torch.rand(bs * n * n, generator=g) < 0.5 if with_mask else None
    plan = plan_ragged(keep, mask)
    rows, lens, flat = [], [], []
    for b in range(bs):
        kept = [i for i in range(n) if keep[b, i]]
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
    HQ, HKV, D, N = 4, 2, 8, 7
    tree = random_batch(rng, [N, 1, 4, 6], vocab=9)  # full, root-only and partial trees
    bs = tree.bs
    keep = tree.valid
    dense = dense_mask(tree)  # [bs, N, N]; padding rows see themselves only
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
    ext = torch.full((bs,), N)
    extend_attention_cpu(q, k, v, padded, k_buf, v_buf, 1.0, 1.0, r2t, rpi, prefix + N, ext, torch.arange(bs) * N, N,
                         0.3, 0.0, False, 0, None, None, dense.reshape(-1), True)
    plan = plan_ragged(keep, dense.reshape(-1))
    ragged = torch.zeros(plan.total, HQ, D)
    extend_attention_cpu(q[plan.rows], k[plan.rows], v[plan.rows], ragged, k_buf, v_buf, 1.0, 1.0, r2t, rpi,
                         prefix + plan.lens, plan.lens, plan.starts, N, 0.3, 0.0, False, 0, None, None,
                         plan.tree_mask, True)
    torch.testing.assert_close(scatter_rows(ragged, plan, bs)[plan.rows], padded[plan.rows])
