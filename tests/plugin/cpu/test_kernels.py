"""The index / tree stand-ins against SGLang's own Triton reference kernels (run by the Triton
interpreter on the CPU) and, where SGLang has no interpretable reference, against plain loops."""

import json
import os
import subprocess
import sys

import pytest
import torch

from tests.helpers import checkout_env
from treespec_sglang.plugin.cpu import kernels as K

ORACLE = os.path.join(os.path.dirname(__file__), "triton_oracle.py")
TRITON_CHECKED = ["build_tree_kernel_efficient_cpu[FULL_MASK]", "build_tree_kernel_efficient_cpu[QLEN_ONLY]",
                  "verify_tree_greedy_cpu", "assign_req_to_token_pool_cpu", "assign_extend_cache_locs_cpu",
                  "assign_draft_cache_locs_contiguous_cpu", "fill_bonus_tokens_cpu", "fill_accept_out_cache_loc_cpu",
                  "gather_spec_extras"]


@pytest.fixture(scope="module")
def triton_mismatches():
    pytest.importorskip("sglang")
    pytest.importorskip("triton")
    proc = subprocess.run([sys.executable, ORACLE, "0", "1"], capture_output=True, text=True, timeout=600,
                          env={k: v for k, v in checkout_env().items() if k != "SGLANG_USE_CPU_ENGINE"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.sglang
@pytest.mark.parametrize("op", TRITON_CHECKED)
def test_op_equals_sglang_triton_reference(triton_mismatches, op):
    assert op in triton_mismatches, sorted(triton_mismatches)
    assert triton_mismatches[op] == [], f"{op}: (seed, case) pairs differing from SGLang's Triton kernel"


def _tree_case(bs):
    """A small explicit selection (topk 3, 7 nodes): parent slots resolved by hand in the comments."""
    # topk 3, steps 3: flat slots 0..2 (depth 1), 3..11 (depth 2, from parent_list[1..3]), 12..20 (depth 3)
    parent_list = torch.tensor([[-1, 0, 1, 2, 3, 5, 7]] * bs)
    sel = torch.tensor([[0, 1, 3, 4, 5, 12]] * bs)  # 3, 4, 5 hang off slot 0; 12 off slot 3
    return parent_list, sel


def test_tree_parents_worked_example():
    parent_list, sel = _tree_case(bs=1)
    parent, found = K.tree_parents(parent_list, sel, 3)
    # nodes: 0 root, 1 = slot 0, 2 = slot 1, 3..5 = slots 3, 4, 5 (parent slot 0 = node 1), 6 = slot 12 (parent 3)
    assert parent[0].tolist() == [-1, 0, 0, 1, 1, 1, 3]
    assert found[0].tolist() == [False] + [True] * 6


def test_one_draft_step_hands_an_empty_parent_table_and_every_node_hangs_off_the_root():
    """SGLang's organize_draft_results at one step builds ``parent_list`` ``[bs, 0]`` (no step past the first) and
    every selected slot is below topk: the kernel never reads the table (the stand-in gathered from it and failed)."""
    parent, found = K.tree_parents(torch.zeros(2, 0, dtype=torch.int64), torch.tensor([[0, 2, 3]] * 2), 4)
    assert parent.tolist() == [[-1, 0, 0, 0]] * 2 and found.tolist() == [[False, True, True, True]] * 2


@pytest.mark.sglang
def test_one_draft_step_builds_sglangs_own_tree_from_its_own_selection():
    """Through SGLang 0.5.23's organize_draft_results at one step and the full build-tree stand-in."""
    eu = pytest.importorskip("sglang.srt.speculative.eagle_utils")
    from tests.plugin.cpu.standin_args import tree_of

    bs, topk, n = 2, 4, 4
    scores = [torch.tensor([[[0.5, 0.1, 0.3, 0.05]], [[0.2, 0.4, 0.1, 0.3]]])]  # [bs, 1, topk]
    tokens = [torch.tensor([[11, 12, 13, 14], [21, 22, 23, 24]])]
    parents = [torch.full((bs, 1), -1, dtype=torch.int64)]
    parent_list, top, _ = eu.organize_draft_results(scores, tokens, parents, n)
    assert parent_list.shape == (bs, 0)
    args = dict(tree_of(n, 1, torch.zeros(bs * n * n, dtype=torch.bool)), parent_list=parent_list,
                selected_index=top, topk=topk, depth=1)
    K.build_tree_kernel_efficient_cpu(**args)
    # every node a child of the root, linked in order: root -> 1 -> 2 -> 3 as siblings
    assert args["retrive_next_token"][:, 0].tolist() == [1, 1]
    assert args["retrive_next_sibling"].tolist() == [[-1, 2, 3, -1]] * 2


def test_tree_parents_leaves_an_unselected_parent_unfound():
    """Slot 12's parent is slot 3 (flat index 3): not selected here, so node 3 (slot 12) has parent -1, unfound."""
    parent, found = K.tree_parents(torch.tensor([[-1, 0, 1, 2, 3, 5, 7]]), torch.tensor([[0, 1, 12]]), 3)
    assert parent[0].tolist() == [-1, 0, 0, -1] and found[0].tolist() == [False, True, True, False]


def test_bitpacked_mask_is_the_packed_qlen_mask():
    parent_list, sel = _tree_case(bs=2)
    N = 7
    outs = {}
    for mode, mask in ((1, torch.ones(2 * N * N, dtype=torch.bool)), (2, torch.zeros(2 * N, dtype=torch.uint8))):
        r = torch.full((3, 2, N), -1)
        K.build_tree_kernel_efficient_cpu(parent_list, sel, torch.tensor([4, 9]), mask, torch.zeros(2 * N, dtype=torch.long),
                                          r[0], r[1], r[2], 3, 3, N, mode)
        outs[mode] = mask
    dense = outs[1].view(2, N, N).tolist()
    packed = [[sum(1 << j for j in range(N) if dense[b][i][j]) for i in range(N)] for b in range(2)]
    assert outs[2].view(2, N).tolist() == packed


def _wide_case(N, bs=2):
    """topk 4, two steps, N nodes: the four depth-1 slots (0-3), then depth-2 slots 4.. (slot s hangs off depth-1
    slot s // 4 - 1), N - 5 of them: a tree wider than a byte's worth of columns once N > 8."""
    parent_list = torch.tensor([[-1, 0, 1, 2, 3]] * bs)
    sel = torch.tensor([list(range(4)) + list(range(4, N - 1))] * bs)
    return parent_list, sel


@pytest.mark.parametrize("N", [8, 9, 12, 16, 17, 20])
@pytest.mark.parametrize("layout", ["one item per row", "bytes"])
def test_a_bitpacked_mask_holds_every_column_of_a_wide_tree(N, layout):
    """Mode 2 packs row i's ancestor columns as bits, little-endian over the row's 1 / 2 / 4 bytes (N <= 8 / 16 /
    32): in SGLang's own mask (one uint8 / uint16 / uint32 per row) and in a plain byte buffer of the same size the
    bytes decode to the dense QLEN_ONLY mask of the same tree (mode 1, the oracle here)."""
    bs = 2
    parent_list, sel = _wide_case(N, bs)
    width = 4 if N > 16 else 2 if N > 8 else 1

    def build(mode, mask):
        r = torch.full((3, bs, N), -1)
        K.build_tree_kernel_efficient_cpu(parent_list, sel, torch.tensor([4, 9]), mask,
                                          torch.zeros(bs * N, dtype=torch.long), r[0], r[1], r[2], 4, 2, N, mode)
        return mask

    dense = build(1, torch.ones(bs * N * N, dtype=torch.bool)).view(bs, N, N).tolist()
    dtype = {1: torch.uint8, 2: torch.uint16, 4: torch.uint32}[width] if layout == "one item per row" else torch.uint8
    packed = build(2, torch.zeros(bs * N * width // (torch.empty(0, dtype=dtype).element_size()), dtype=dtype))
    raw = packed.view(torch.uint8).tolist()
    for b in range(bs):
        for i in range(N):
            row = raw[(b * N + i) * width:(b * N + i + 1) * width]
            bits = sum(byte << (8 * k) for k, byte in enumerate(row))
            assert [bool(bits >> j & 1) for j in range(N)] == dense[b][i], (b, i)
    assert N <= 8 or any(dense[b][i][j] for b in range(bs) for i in range(N) for j in range(8, N))  # past a byte


def test_bad_mask_mode_names_the_range():
    parent_list, sel = _tree_case(bs=1)
    r = torch.full((3, 1, 7), -1)
    with pytest.raises(RuntimeError, match="tree_mask_mode must be 0"):
        K.build_tree_kernel_efficient_cpu(parent_list, sel, torch.tensor([3]), torch.ones(49, dtype=torch.bool),
                                          torch.zeros(7, dtype=torch.long), r[0], r[1], r[2], 3, 3, 7, 5)


@pytest.mark.parametrize("bs,topk,steps", [(1, 1, 3), (2, 4, 3), (3, 2, 5)])
def test_draft_decode_metadata_rows(bs, topk, steps):
    g = torch.Generator().manual_seed(bs * 10 + topk)
    pool_len = 40
    req_to_token = torch.randint(0, 999, (6, pool_len), generator=g, dtype=torch.int32)
    rpi = torch.randperm(6, generator=g)[:bs]
    seq = torch.randint(1, pool_len - topk * steps, (bs,), generator=g)
    seq[0] = pool_len - topk * steps  # the last branch's last slot is the row's last column
    out = K.build_draft_decode_metadata_cpu(req_to_token, rpi, seq, topk, steps, pool_len)
    assert out.shape == (bs * topk, pool_len)
    for b in range(bs):
        row = req_to_token[rpi[b]].tolist()
        s = int(seq[b])
        for k in range(topk):
            want = row[:s] + row[s + k * steps: s + (k + 1) * steps]
            assert out[b * topk + k, : s + steps].tolist() == want
            assert (out[b * topk + k, s + steps:] == 0).all()  # the rest is 0


@pytest.mark.parametrize("dtype,n_bufs", [(torch.float32, 5), (torch.bfloat16, 5), (torch.float32, 1)])
def test_copy_all_layer_kv_cache_moves_every_buffer(dtype, n_bufs):
    g = torch.Generator().manual_seed(3)
    bufs = [torch.randn(20, 6, generator=g).to(dtype)] + [torch.randn(20, 3, 4, generator=g).to(dtype) for _ in range(4)]
    bufs = bufs[:n_bufs]
    before = [b.clone() for b in bufs]
    ptrs = torch.tensor([b.data_ptr() for b in bufs], dtype=torch.uint64)  # as SGLang's memory pool builds them
    strides = torch.tensor([b.stride(0) * b.element_size() for b in bufs], dtype=torch.int64)
    tgt, src = torch.tensor([2, 7, 19, 5]), torch.tensor([7, 2, 0, 5])  # a swap, an overlap, a self copy
    K.copy_all_layer_kv_cache_cpu(ptrs, strides, tgt, src)
    for b, old in zip(bufs, before):
        want = old.clone()
        for t, s in zip(tgt.tolist(), src.tolist()):
            want[t] = old[s]
        assert torch.equal(b, want)
