"""What the plugin hands SGLang: every tensor contiguous, of SGLang's dtype and shape, and taken by the strict
stand-in of the kernel that reads it (:mod:`treespec_sglang.plugin.cpu.matcher`, the checks of SGLang's JIT
``tree.cuh``). A batch whose requests all carry a policy once handed SGLang's tree kernel a strided
``top_scores_index`` (a column slice of a sort) and crashed every such round on a GPU."""

import pytest
import torch

from tests.helpers import PathDraft
from tests.policies import oracles
from treespec_sglang.plugin.cpu.kernels import build_tree_kernel_efficient_cpu
from treespec_sglang.plugin.draft_select import select_after_draft, stash_pool
from treespec_sglang.plugin.hooks import DraftStep
from treespec_sglang.plugin.pool import select_from_pool, unlink_filler
from treespec_sglang.plugin.ragged import compact_paged_verify_args, plan_ragged, scatter_rows
from treespec_sglang.policies import parse_spec

K, S, N = 4, 3, 8
EVERY = [{"policy": "eagle2", "budget": 6}, {"policy": "talon", "budget": 8, "mu": 0.03},
         {"policy": "salf", "budget": 8, "th": 0.1}, {"policy": "salf", "budget": 5, "th": 0.0},
         {"policy": "c2t", "budget": 8, "beta": 0.5}, {"policy": "chain", "length": 3}, {"policy": "none"}]
BATCHES = {
    "every policy, no native row": EVERY,
    "every policy and native rows": EVERY + [None, None],
    **{f"{s['policy']} alone": [s] * 3 for s in EVERY},
}


def contiguous_of(t: torch.Tensor, dtype, shape) -> bool:
    return t.is_contiguous() and t.dtype == dtype and tuple(t.shape) == tuple(shape)


def selection(specs, seed=0):
    """This round's selection as the draft hook makes it: (parent_list, top, tokens, keep)."""
    bs = len(specs)
    sl, tl, pl = oracles.sglang_pool_lists(PathDraft(30, seed=seed, sharpness=1.5), list(range(bs)), K, S)[:3]
    stash_pool(sl, tl, pl)
    parent_list, native_top, native_tokens, _ = select_from_pool(sl, tl, pl, N, K, [None] * bs)
    step = DraftStep([parse_spec(s) if s else None for s in specs], K)
    top, tokens, _ = select_after_draft(step, None, native_top, native_tokens, N, S)
    return parent_list, top, tokens, step.keep


def sglang_tree(parent_list, top, bs, mode=1):
    """SGLang's verify-tree buffers, filled by the strict stand-in of its tree kernel."""
    seq = torch.full((bs,), 11, dtype=torch.int64)
    mask = torch.zeros(bs * N * N if mode == 1 else int(seq.sum()) * N + bs * N * N, dtype=torch.bool)
    positions = torch.zeros(bs * N, dtype=torch.int64)
    links = [torch.full((bs, N), -1, dtype=torch.int64) for _ in range(3)]
    build_tree_kernel_efficient_cpu(parent_list, top, seq, mask, positions, *links, K, S, N, mode)
    return seq, mask, links


@pytest.mark.parametrize("name", sorted(BATCHES))
def test_the_selection_hands_the_tree_kernel_contiguous_int64(name):
    specs = BATCHES[name]
    bs = len(specs)
    parent_list, top, tokens, keep = selection(specs)
    assert contiguous_of(top, torch.int64, (bs, N - 1)), (top.stride(), top.dtype)
    assert contiguous_of(tokens, torch.int64, (bs, N - 1))
    assert contiguous_of(keep, torch.bool, (bs, N))
    assert contiguous_of(parent_list, torch.int64, (bs, 1 + (S - 1) * K))
    _, _, links = sglang_tree(parent_list, top, bs)  # raises on a strided or mistyped argument
    nt, ns = unlink_filler(links[1], links[2], keep)
    assert contiguous_of(nt, torch.int64, (bs, N)) and contiguous_of(ns, torch.int64, (bs, N))


def test_the_tree_kernel_refuses_the_strided_slice_as_sglang_does():
    """The defect itself: the first N-1 columns of a sorted [bs, P] index are a view with row stride P."""
    bs, P = 2, K + (S - 1) * K * K
    parent_list = torch.cat([torch.full((bs, 1), -1), torch.arange(K * (S - 1)).expand(bs, -1)], 1).contiguous()
    sliced = torch.sort(torch.stack([torch.randperm(P) for _ in range(bs)]), dim=-1).values[:, :N - 1]
    with pytest.raises(RuntimeError, match=rf"selected_index: Size mismatch for stride#0: expected {N - 1} but got {P}"):
        sglang_tree(parent_list, sliced, bs)
    sglang_tree(parent_list, sliced.contiguous(), bs)


def test_the_ragged_verify_hands_contiguous_arguments_of_sglangs_dtypes():
    specs = BATCHES["every policy, no native row"]
    bs = len(specs)
    parent_list, top, _, keep = selection(specs, seed=3)
    seq, mask, _ = sglang_tree(parent_list, top, bs, mode=1)
    plan = plan_ragged(keep, mask)
    total = int(keep.sum())
    assert contiguous_of(plan.rows, torch.int64, (total,))
    assert contiguous_of(plan.lens, torch.int64, (bs,)) and contiguous_of(plan.starts, torch.int64, (bs,))
    assert contiguous_of(plan.tree_mask, torch.bool, (int((plan.lens ** 2).sum()),))
    x = torch.randn(total, 5)
    assert contiguous_of(scatter_rows(x, plan, bs), torch.float32, (bs * N, 5))
    # FlashInfer's paged arguments (int32 indices and offsets, a bool FULL_MASK), compacted
    seq_full, full, _ = sglang_tree(parent_list, top, bs, mode=0)
    kv_len = (seq_full + N).to(torch.int32)
    kv_indptr = torch.cat([torch.zeros(1, dtype=torch.int32), torch.cumsum(kv_len, 0).to(torch.int32)])
    kv_indices = torch.arange(int(kv_indptr[-1]), dtype=torch.int32)
    idx, indptr, qo, cmask = compact_paged_verify_args(kv_indices, kv_indptr, full, keep)
    lens = keep.sum(-1)
    assert contiguous_of(idx, torch.int32, (int((seq_full + lens).sum()),))
    assert contiguous_of(indptr, torch.int32, (bs + 1,)) and contiguous_of(qo, torch.int32, (bs + 1,))
    assert contiguous_of(cmask, torch.bool, (int((lens * (seq_full + lens)).sum()),))
