"""The stand-ins refuse what the real kernels refuse (:mod:`treespec_sglang.plugin.cpu.matcher`).

Each case starts from arguments shaped and typed as SGLang 0.5.23 passes them (the call sites in
``eagle_utils.py``, ``eagle_worker_common.py``, ``cache_locs.py``, ``intel_amx_backend.py``), checks that
the op takes them, then breaks one rule the compiled op (``sgl-kernel/csrc/cpu``) or SGLang's JIT kernel
(``kernels/jit/csrc/speculative``) checks and expects the same refusal."""

import pytest
import torch

from tests.plugin.cpu.standin_args import BS, N, OPS, meta, strided, tree_of, verify_greedy
from treespec_sglang.plugin.cpu import kernels as K

# (op, argument, how it is broken, what the stand-in says after "<op>: ", to the letter)
BROKEN = [
    ("build_tree", "selected_index", lambda t: torch.zeros(BS, 2 * N, dtype=torch.int64)[:, :N - 1],
     f"selected_index: Size mismatch for stride#0: expected {N - 1} but got {2 * N}"),
    ("build_tree", "selected_index", lambda t: t.int(), "selected_index: dtype mismatch: expected int64 but got int32"),
    ("build_tree", "selected_index", meta, "selected_index: Device mismatch: expected cpu but got meta"),
    ("build_tree", "parent_list", lambda t: t[:, :3].contiguous(), "parent_list has 3 columns, expected topk * (depth - 1) + 1 = 5"),
    ("build_tree", "parent_list", lambda t: torch.zeros(BS, 10, dtype=torch.int64)[:, :5],
     "parent_list: Size mismatch for stride#0: expected 5 but got 10"),
    ("build_tree", "parent_list", meta, "parent_list: Device mismatch: expected cpu but got meta"),
    ("build_tree", "parent_list", lambda t: t[0], "parent_list: Tensor dimension mismatch: expected 2 but got 1"),
    ("build_tree", "parent_list", lambda t: t[:, :0], "parent_list has 0 columns, expected topk * (depth - 1) + 1 = 5"),
    ("build_tree", "selected_index", lambda t: t[:1], "selected_index: Size mismatch for shape#0('batch_size'): expected 2 but got 1"),
    ("build_tree", "depth", lambda d: 2, "parent_list has 5 columns, expected topk * (depth - 1) + 1 = 3"),
    ("build_tree", "positions", lambda t: strided(t), "positions: Tensor is not contiguous as expected (shape (8,), strides (2,))"),
    ("build_tree", "positions", meta, "positions: Device mismatch: expected cpu but got meta"),
    ("build_tree", "retrive_index", lambda t: t.int(), "retrive_index: dtype mismatch: expected int64 but got int32"),
    ("build_tree", "retrive_index", meta, "retrive_index: Device mismatch: expected cpu but got meta"),
    ("build_tree", "retrive_next_token", lambda t: t.int(), "retrive_next_token: dtype mismatch: expected int64 but got int32"),
    ("build_tree", "retrive_next_sibling", lambda t: t.int(), "retrive_next_sibling: dtype mismatch: expected int64 but got int32"),
    ("build_tree", "verified_seq_len", meta, "verified_seq_len: Device mismatch: expected cpu but got meta"),
    ("build_tree", "verified_seq_len", lambda t: t.int(), "verified_seq_len: dtype mismatch: expected int64 but got int32"),
    ("build_tree", "tree_mask", lambda t: t.to(torch.uint8), "tree_mask must be bool, got torch.uint8"),
    ("build_tree", "tree_mask", lambda t: t[:-1], "tree_mask has 31 entries, expected 32 for mode 1"),
    ("build_tree", "tree_mask", meta, "tree_mask: Device mismatch: expected cpu but got meta"),
    ("build_tree", "tree_mask", lambda t: torch.zeros(2 * t.numel(), dtype=torch.bool)[::2],
     "tree_mask: Tensor is not contiguous as expected (shape (32,), strides (2,))"),
    ("build_tree", "tree_mask_mode", lambda m: 3,
     "tree_mask_mode must be 0 (FULL_MASK), 1 (QLEN_ONLY) or 2 (QLEN_ONLY_BITPACKING), got 3"),
    ("build_tree", "tree_mask_mode", lambda m: -1,
     "tree_mask_mode must be 0 (FULL_MASK), 1 (QLEN_ONLY) or 2 (QLEN_ONLY_BITPACKING), got -1"),
    ("build_tree", "tree_mask_mode", lambda m: 0, "tree_mask has 32 entries, expected 88 for mode 0"),  # (5 + 9 + 8) * 4
    ("build_tree", "topk", lambda k: 0, "topk and depth must be > 0, got 0, 3"),
    ("build_tree", "depth", lambda d: 0, "topk and depth must be > 0, got 2, 0"),
    ("build_tree", "draft_token_num", lambda n: 0, "draft_token_num must be in [1, 1024], got 0"),
    ("build_tree", "draft_token_num", lambda n: 1025, "draft_token_num must be in [1, 1024], got 1025"),
    ("build_tree", "retrive_next_sibling", lambda t: torch.zeros_like(t),
     "retrive_next_sibling must come filled with -1 (the kernel only adds links)"),
    ("build_tree", "retrive_next_token", lambda t: torch.zeros_like(t),
     "retrive_next_token must come filled with -1 (the kernel only adds links)"),
    ("verify_greedy", "accept_index", lambda t: t.long(), "accept_index: dtype mismatch: expected int32 but got int64"),
    ("verify_greedy", "accept_index", lambda t: t[:, :0], "draft_tokens and spec_tokens must be > 0"),
    ("verify_greedy", "accept_index", meta, "accept_index: Device mismatch: expected cpu but got meta"),
    ("verify_greedy", "accept_token_num", lambda t: t.long(), "accept_token_num: dtype mismatch: expected int32 but got int64"),
    ("verify_greedy", "accept_token_num", lambda t: t[:1],
     "accept_token_num: Size mismatch for shape#0('batch_size'): expected 2 but got 1"),
    ("verify_greedy", "predicts", lambda t: t[:-1], "predicts: Size mismatch for shape#0: expected 8 but got 7"),
    ("verify_greedy", "predicts", lambda t: t.long(), "predicts: dtype mismatch: expected int32 but got int64"),
    ("verify_greedy", "candidates", lambda t: strided(t),
     "candidates: Tensor is not contiguous as expected (shape (2, 4), strides (8, 2))"),
    ("verify_greedy", "candidates", lambda t: t.int(), "candidates: dtype mismatch: expected int64 but got int32"),
    ("verify_greedy", "candidates", meta, "candidates: Device mismatch: expected cpu but got meta"),
    ("verify_greedy", "accept_token_num", meta, "accept_token_num: Device mismatch: expected cpu but got meta"),
    ("verify_greedy", "predicts", meta, "predicts: Device mismatch: expected cpu but got meta"),
    ("verify_greedy", "retrive_index", lambda t: t[:, :3],
     "retrive_index: Size mismatch for shape#1('draft_tokens'): expected 4 but got 3"),
    ("verify_greedy", "retrive_next_token", lambda t: t.int(), "retrive_next_token: dtype mismatch: expected int64 but got int32"),
    ("verify_greedy", "retrive_next_sibling", lambda t: t.int(),
     "retrive_next_sibling: dtype mismatch: expected int64 but got int32"),
    ("verify_greedy", "target_predict", lambda t: t[:1],
     "target_predict: Size mismatch for shape#0('batch_size'): expected 2 but got 1"),
    ("sampling", "target_probs", lambda t: t.double(), "target_probs: dtype mismatch: expected float32 but got float64"),
    ("sampling", "draft_probs", lambda t: t[:, :, :7].contiguous(),
     "draft_probs: Size mismatch for shape#2('vocab_size'): expected 8 but got 7"),
    ("sampling", "uniform_samples", lambda t: strided(t),
     "uniform_samples: Tensor is not contiguous as expected (shape (2, 4), strides (8, 2))"),
    ("sampling", "uniform_samples_for_final_sampling", lambda t: t.double(),
     "uniform_samples_for_final_sampling: dtype mismatch: expected float32 but got float64"),
    ("sampling", "retrive_index", lambda t: t.int(), "retrive_index: dtype mismatch: expected int64 but got int32"),
    ("sampling", "uniform_samples", meta, "uniform_samples: Device mismatch: expected cpu but got meta"),
    ("sampling", "uniform_samples_for_final_sampling", meta,
     "uniform_samples_for_final_sampling: Device mismatch: expected cpu but got meta"),
    ("sampling", "target_probs", meta, "target_probs: Device mismatch: expected cpu but got meta"),
    ("sampling", "threshold_acc", lambda t: 1.5, "threshold_acc must be in [0, 1], got 1.5"),
    ("sampling", "threshold_single", lambda t: -0.5, "threshold_single must be in [0, 1], got -0.5"),
    ("decode", "query", lambda t: t.transpose(1, 2).contiguous().transpose(1, 2), "query must be contiguous at last dimension"),
    ("decode", "query", meta, "query must be a CPU tensor"),
    ("decode", "k_cache", lambda t: t[:, 0], "k_buffer must be a 3D tensor, got 2D"),
    ("decode", "v_cache", lambda t: t[:, :, None, :], "v_buffer must be a 3D tensor, got 4D"),
    ("decode", "attn_logits", lambda t: t.half(), "attn_logits must be float32, got torch.float16"),
    ("decode", "attn_logits", lambda t: t[0], "attn_logits must be [2, 2, splits, 33], got (2, 4, 33)"),
    ("decode", "attn_logits", lambda t: t[:1], "attn_logits must be [2, 2, splits, 33], got (1, 2, 4, 33)"),
    ("decode", "attn_logits", lambda t: t[:, :1], "attn_logits must be [2, 2, splits, 33], got (2, 1, 4, 33)"),
    ("decode", "attn_logits", lambda t: t[..., :-1], "attn_logits must be [2, 2, splits, 33], got (2, 2, 4, 32)"),
    ("decode", "seq_lens", lambda t: t.int(), "expect req_lens to be int64, got torch.int32"),
    ("decode", "req_to_token", lambda t: t.float(), "expect req_to_token to be int32 or int64, got torch.float32"),
    ("decode", "req_pool_indices", lambda t: t.int(), "expect req_pool_indices to be int64, got torch.int32"),
    ("decode", "req_pool_indices", lambda t: t[:1], "req_pool_indices has 1 rows, expected 2"),
    ("decode", "value", lambda t: None, "key and value should have values at the same time"),
    ("decode", "key", lambda t: None, "key and value should have values at the same time"),
    ("decode", "key", lambda t: t.transpose(1, 2).contiguous().transpose(1, 2), "key must be contiguous at last dimension"),
    ("decode", "value", lambda t: t.transpose(1, 2).contiguous().transpose(1, 2), "value must be contiguous at last dimension"),
    ("decode", "loc", lambda t: t.int(), "loc must be int64, got torch.int32"),
    ("decode", "loc", lambda t: t[:1], "loc must be a 1D tensor of 2 slots"),
    ("decode", "loc", lambda t: t[None], "loc must be a 1D tensor of 2 slots"),
    ("decode", "output", lambda t: t.double(), "output must have the query's dtype torch.float32, got torch.float64"),
    ("decode", "key", lambda t: t.double(), "key must have the query's dtype torch.float32, got torch.float64"),
    ("decode", "value", lambda t: t.double(), "value must have the query's dtype torch.float32, got torch.float64"),
    ("decode", "v_cache", lambda t: t.double(),
     "the KV buffers must share the query's dtype (or float8_e4m3fn), got torch.float32, torch.float64"),
    ("decode", "sinks", lambda t: torch.zeros(1), "sinks must be 1D with one entry per query head (2), got (1,)"),
    ("extend", "o_extend", lambda t: strided(t),
     "o_extend: Tensor is not contiguous as expected (shape (8, 2, 32), strides (128, 64, 2))"),
    ("extend", "o_extend", meta, "o_extend: Device mismatch: expected cpu but got meta"),
    ("extend", "k_extend", lambda t: t.transpose(1, 2).contiguous().transpose(1, 2), "k_extend must be contiguous at last dimension"),
    ("extend", "v_extend", lambda t: t.transpose(1, 2).contiguous().transpose(1, 2), "v_extend must be contiguous at last dimension"),
    ("extend", "q_extend", lambda t: t.transpose(1, 2).contiguous().transpose(1, 2), "q_extend must be contiguous at last dimension"),
    ("extend", "k_buffer", lambda t: t.transpose(1, 2).contiguous().transpose(1, 2), "k_buffer must be contiguous at last dimension"),
    ("extend", "v_buffer", lambda t: t.transpose(1, 2).contiguous().transpose(1, 2), "v_buffer must be contiguous at last dimension"),
    ("extend", "v_extend", lambda t: t.double(), "v_extend must have the query's dtype torch.float32, got torch.float64"),
    ("extend", "v_extend", lambda t: t[:, :1].contiguous(), "v_extend and k_buffer must have the same KV heads"),
    ("extend", "k_extend", lambda t: t.double(), "k_extend must have the query's dtype torch.float32, got torch.float64"),
    ("extend", "q_extend", lambda t: t[..., :16].contiguous(), "invalid head_size 16"),
    ("extend", "v_buffer", lambda t: t[..., :16].contiguous(), "invalid head_size_v 16"),
    ("extend", "seq_lens", lambda t: t.int(), "expect req_lens to be int64, got torch.int32"),
    ("extend", "extend_seq_lens", lambda t: t.long(),
     "expect extend_seq_lens and extend_start_loc to have same dtype as req_to_token."),
    ("extend", "extend_start_loc", lambda t: t.long(),
     "expect extend_seq_lens and extend_start_loc to have same dtype as req_to_token."),
    ("extend", "extend_start_loc", lambda t: t[:1], "extend_seq_lens and extend_start_loc must have 2 rows"),
    ("extend", "extend_seq_lens", lambda t: torch.tensor([N, N - 1], dtype=torch.int32),
     "tree_mask requires uniform extend_seq_lens, got [4, 3] vs 4"),
    ("extend", "tree_mask", lambda t: t[: -N], "expect tree_mask numel to be num_seqs * max_len_extend^2 = 32, got 28"),
    ("extend", "tree_mask", lambda t: t.to(torch.uint8), "tree_mask: dtype mismatch: expected bool but got uint8"),
    ("extend", "tree_mask", meta, "tree_mask: Device mismatch: expected cpu but got meta"),
    ("extend", "max_len_extend", lambda n: None, "max_len_extend must be given with a tree_mask"),
    ("extend", "sliding_window_size", lambda w: 1, "tree_mask is not supported with sliding window attention"),
    ("extend", "req_pool_indices", lambda t: t.int(), "expect req_pool_indices to be int64, got torch.int32"),
    ("extend", "o_extend", lambda t: t.double(), "o_extend must have the query's dtype torch.float32, got torch.float64"),
    ("extend", "k_buffer", lambda t: t.double(),
     "the KV buffers must share the query's dtype (or float8_e4m3fn), got torch.float64, torch.float32"),
    ("extend", "sinks", lambda t: torch.zeros(2, 2), "sinks must be 1D with one entry per query head (2), got (2, 2)"),
    ("req_to_token", "req_to_token", lambda t: t.long(), "req_to_token: dtype mismatch: expected int32 but got int64"),
    ("req_to_token", "req_to_token", meta, "req_to_token: Device mismatch: expected cpu but got meta"),
    ("req_to_token", "req_pool_indices", lambda t: t.float(), "req_pool_indices must be torch.int32 or torch.int64, got torch.float32"),
    ("req_to_token", "req_pool_indices", strided, "req_pool_indices: Tensor is not contiguous as expected (shape (2,), strides (2,))"),
    ("req_to_token", "start_offset", lambda t: t[:1], "start_offset has 1 elements, expected 2"),
    ("req_to_token", "end_offset", lambda t: t[:1], "end_offset has 1 elements, expected 2"),
    ("req_to_token", "start_offset", strided, "start_offset: Tensor is not contiguous as expected (shape (2,), strides (2,))"),
    ("req_to_token", "end_offset", strided, "end_offset: Tensor is not contiguous as expected (shape (2,), strides (2,))"),
    ("req_to_token", "out_cache_loc", lambda t: t.int(), "out_cache_loc must be int64, got torch.int32"),
    ("req_to_token", "out_cache_loc", strided, "out_cache_loc: Tensor is not contiguous as expected (shape (5,), strides (2,))"),
    ("req_to_token", "end_offset", lambda t: t.long(), "start_offset and end_offset must have the same dtype"),
    ("req_to_token", "out_cache_loc", lambda t: t[:4], "out_cache_loc has 4 entries but offsets require 5 (the slots to store)"),
    ("extend_locs", "out_cache_loc", lambda t: t[:4], "out_cache_loc has 4 entries but offsets require 5 (the slots to gather)"),
    ("extend_locs", "req_to_token", lambda t: strided(t),
     "req_to_token: Tensor is not contiguous as expected (shape (6, 32), strides (64, 2))"),
    ("draft_locs", "out_cache_loc", lambda t: t[:-1], "out_cache_loc has 11 entries, expected bs * topk * num_steps = 12"),
    ("draft_locs", "out_cache_loc", lambda t: t.int(), "out_cache_loc must be int64, got torch.int32"),
    ("draft_locs", "out_cache_loc", strided, "out_cache_loc: Tensor is not contiguous as expected (shape (12,), strides (2,))"),
    ("draft_locs", "seq_lens", lambda t: t.float(), "seq_lens must be torch.int32 or torch.int64, got torch.float32"),
    ("draft_locs", "seq_lens", strided, "seq_lens: Tensor is not contiguous as expected (shape (2,), strides (2,))"),
    ("draft_locs", "req_pool_indices", strided,
     "req_pool_indices: Tensor is not contiguous as expected (shape (2,), strides (2,))"),
    ("draft_locs", "req_pool_indices", lambda t: t.float(),
     "req_pool_indices must be torch.int32 or torch.int64, got torch.float32"),
    ("draft_locs", "req_pool_indices", lambda t: t[:1], "seq_lens has 2 elements, expected 1"),
    ("draft_locs", "pool_len", lambda n: n - 1, "req_to_token: Size mismatch for shape#1: expected 31 but got 32"),
    ("bonus", "accept_tokens", lambda t: t.long(), "accept_tokens must be int32, got torch.int64"),
    ("bonus", "accept_tokens", lambda t: strided(t), "accept_tokens: Tensor is not contiguous as expected (shape (2, 3), strides (6, 2))"),
    ("bonus", "accept_stride", lambda n: 2, "accept_tokens has 6 elements, expected bs * accept_stride = 4"),
    ("bonus", "accept_lens", lambda t: torch.zeros_like(t), "accept_lens must be in [1, accept_stride = 3], got [0, 0]"),
    ("bonus", "accept_lens", lambda t: torch.tensor([1, 4], dtype=torch.int32), "accept_lens must be in [1, accept_stride = 3], got [1, 4]"),
    ("bonus", "accept_lens", lambda t: t.long(), "accept_lens must be torch.int32, got torch.int64"),
    ("bonus", "bonus_tokens", lambda t: t[:1], "bonus_tokens has 1 elements, expected 2"),
    ("bonus", "bonus_tokens", strided, "bonus_tokens: Tensor is not contiguous as expected (shape (2,), strides (2,))"),
    ("bonus", "accept_lens", strided, "accept_lens: Tensor is not contiguous as expected (shape (2,), strides (2,))"),
    ("accept_locs", "accept_out_cache_loc", lambda t: t[:5], "accept_out_cache_loc has 5 entries, fewer than accept_index's 6"),
    ("accept_locs", "accept_out_cache_loc", lambda t: t.int(), "accept_out_cache_loc must be int64, got torch.int32"),
    ("accept_locs", "accept_index", lambda t: t.float(), "accept_index must be int32 or int64, got torch.float32"),
    ("accept_locs", "accept_index", strided, "accept_index: Tensor is not contiguous as expected (shape (2, 3), strides (6, 2))"),
    ("accept_locs", "out_cache_loc", lambda t: t.int(), "out_cache_loc must be int64, got torch.int32"),
    ("accept_locs", "out_cache_loc", lambda t: t[:4], "accept_index out of range"),
    ("accept_locs", "out_cache_loc", strided, "out_cache_loc: Tensor is not contiguous as expected (shape (8,), strides (2,))"),
    ("accept_locs", "accept_out_cache_loc", strided,
     "accept_out_cache_loc: Tensor is not contiguous as expected (shape (6,), strides (2,))"),
    ("kv_copy", "data_ptrs", lambda t: t.long(), "data_ptrs must be uint64, got torch.int64"),
    ("kv_copy", "strides", lambda t: t.int(), "strides must be int64, got torch.int32"),
    ("kv_copy", "strides", lambda t: t.repeat(2), "strides must have one entry per buffer"),
    ("kv_copy", "src_loc", lambda t: t.int(), "tgt_loc and src_loc must share an int32 / int64 dtype, got torch.int64, torch.int32"),
    ("kv_copy", "src_loc", lambda t: t.float(), "tgt_loc and src_loc must share an int32 / int64 dtype, got torch.int64, torch.float32"),
    ("kv_copy", "tgt_loc", strided, "tgt_loc: Tensor is not contiguous as expected (shape (2,), strides (2,))"),
    ("kv_copy", "tgt_loc", lambda t: t[:0], "src_loc and tgt_loc must have the same length"),  # checked when empty too
    ("kv_copy", "data_ptrs", meta, "data_ptrs: Device mismatch: expected cpu but got meta"),
    ("kv_copy", "strides", meta, "strides: Device mismatch: expected cpu but got meta"),
    ("kv_copy", "src_loc", meta, "src_loc: Device mismatch: expected cpu but got meta"),
    ("draft_metadata", "req_to_token", lambda t: strided(t),
     "req_to_token: Tensor is not contiguous as expected (shape (6, 32), strides (64, 2))"),
    ("draft_metadata", "seq_lens", lambda t: t[:1], "seq_lens has 1 elements, expected 2"),
    ("draft_metadata", "seq_lens", strided, "seq_lens: Tensor is not contiguous as expected (shape (2,), strides (2,))"),
    ("draft_metadata", "req_to_token", lambda t: t.long(), "req_to_token: dtype mismatch: expected int32 but got int64"),
    ("draft_metadata", "req_pool_indices", lambda t: t.float(), "req_pool_indices must be torch.int32 or torch.int64, got torch.float32"),
    ("draft_metadata", "req_pool_indices", strided, "req_pool_indices: Tensor is not contiguous as expected (shape (2,), strides (2,))"),
]


@pytest.mark.parametrize("name", sorted(OPS))
def test_the_stand_in_takes_sglangs_own_arguments(name):
    fn, args = OPS[name]
    fn(**args())


@pytest.mark.parametrize("name,arg,breaks,msg", BROKEN, ids=[f"{c[0]}-{c[1]}-{i}" for i, c in enumerate(BROKEN)])
def test_the_stand_in_refuses_what_the_kernel_refuses(name, arg, breaks, msg):
    fn, make = OPS[name]
    args = make()
    args[arg] = breaks(args[arg])
    with pytest.raises(RuntimeError) as refused:
        fn(**args)
    assert str(refused.value) == f"{fn.__name__}: {msg}"


@pytest.mark.parametrize("n,row_bytes", [(8, 1), (9, 2), (16, 2), (17, 4), (32, 4)])
def test_the_bit_packed_mask_needs_one_integer_of_its_rows_width_per_row(n, row_bytes):
    """QLEN_ONLY_BITPACKING (the CUDA kernel's mode 2): uint8 rows up to 8 nodes, 16-bit up to 16, 32-bit up to 32."""
    need = BS * n * row_bytes
    with pytest.raises(RuntimeError) as refused:
        K.build_tree_kernel_efficient_cpu(**tree_of(n, 2, torch.zeros(need - 1, dtype=torch.uint8)))
    assert str(refused.value) == f"build_tree_kernel_efficient_cpu: tree_mask holds {need - 1} bytes, needs >= {need}"
    K.build_tree_kernel_efficient_cpu(**tree_of(N, 2, torch.zeros(BS * N, dtype=torch.uint8)))  # exactly enough


def test_the_bit_packed_mask_holds_at_most_32_nodes():
    with pytest.raises(RuntimeError) as refused:
        K.build_tree_kernel_efficient_cpu(**tree_of(33, 2, torch.zeros(BS * 33 * 4, dtype=torch.uint8)))
    assert str(refused.value) == "build_tree_kernel_efficient_cpu: QLEN_ONLY_BITPACKING needs draft_token_num <= 32, got 33"


EDGES = [  # (op, arguments replaced): at the edge of what the kernel takes, and taken
    ("build_tree", dict(depth=1)),  # one step: any parent_list width
    ("build_tree", dict(topk=1, parent_list=torch.tensor([[-1, 0, 1]] * BS), selected_index=torch.tensor([[0, 1, 2]] * BS))),
    ("build_tree", dict(tree_of(1024, 1, torch.zeros(BS * 1024 * 1024, dtype=torch.bool)))),  # the largest tree
    ("sampling", dict(target_probs=torch.ones(BS, N, 1), draft_probs=torch.zeros(BS, N, 1))),  # one token
    ("req_to_token", dict(end_offset=torch.tensor([2, 3], dtype=torch.int32), out_cache_loc=torch.arange(3))),  # one empty
    ("build_tree", dict(tree_mask_mode=0, tree_mask=torch.zeros((5 + 9 + BS * N) * N, dtype=torch.bool))),  # FULL_MASK
    ("build_tree", dict(tree_mask_mode=2, tree_mask=torch.zeros(BS * N, dtype=torch.uint8))),  # one byte a row
    ("sampling", dict(threshold_single=0.0, threshold_acc=0.0)),
    ("kv_copy", dict(tgt_loc=torch.zeros(0, dtype=torch.int64), src_loc=torch.zeros(0, dtype=torch.int64))),  # no copy
    ("bonus", dict(accept_tokens=torch.zeros(0, 3, dtype=torch.int32), accept_lens=torch.zeros(0, dtype=torch.int32),
                   bonus_tokens=torch.zeros(0, dtype=torch.int32))),  # an empty batch
]


@pytest.mark.parametrize("name,replaced", EDGES, ids=[f"{c[0]}-{i}" for i, c in enumerate(EDGES)])
def test_the_stand_in_takes_the_edges_the_kernel_takes(name, replaced):
    fn, make = OPS[name]
    fn(**dict(make(), **replaced))


@pytest.mark.parametrize("name", ["decode", "extend"])
def test_cross_attention_is_refused(name):
    fn, make = OPS[name]
    with pytest.raises(NotImplementedError) as refused:
        fn(**dict(make(), is_cross_attn=True))
    assert str(refused.value) == "treespec CPU attention stand-ins do not implement cross-attention"


def test_a_single_rows_accept_length_is_checked_too():
    fn, make = OPS["bonus"]
    one = dict(accept_tokens=torch.zeros(1, 3, dtype=torch.int32), accept_lens=torch.tensor([4], dtype=torch.int32),
               bonus_tokens=torch.zeros(1, dtype=torch.int32))
    with pytest.raises(RuntimeError) as refused:
        fn(**dict(make(), **one))
    assert str(refused.value) == "fill_bonus_tokens_cpu: accept_lens must be in [1, accept_stride = 3], got [4]"


def test_an_empty_vocabulary_or_tree_is_refused():
    fn, make = OPS["sampling"]
    with pytest.raises(RuntimeError) as refused:
        fn(**dict(make(), target_probs=torch.zeros(BS, N, 0), draft_probs=torch.zeros(BS, N, 0)))
    assert str(refused.value) == "tree_speculative_sampling_target_only: vocab_size must be > 0"
    empty = dict(predicts=torch.zeros(0, dtype=torch.int32), candidates=torch.zeros(BS, 0, dtype=torch.int64),
                 retrive_index=torch.zeros(BS, 0, dtype=torch.int64), retrive_next_token=torch.zeros(BS, 0, dtype=torch.int64),
                 retrive_next_sibling=torch.zeros(BS, 0, dtype=torch.int64), target_predict=torch.zeros(BS, 0, dtype=torch.int64))
    with pytest.raises(RuntimeError) as refused:
        K.verify_tree_greedy_cpu(**dict(verify_greedy(), **empty))
    assert str(refused.value) == "verify_tree_greedy_cpu: draft_tokens and spec_tokens must be > 0"


def test_a_one_column_parent_list_is_held_to_its_row_stride():
    """One step (depth 1): SGLang's parent_list has one column, and the kernel binds its row stride to 1."""
    fn, make = OPS["build_tree"]
    with pytest.raises(RuntimeError) as refused:
        fn(**dict(make(), depth=1, parent_list=torch.full((BS, 5), -1, dtype=torch.int64)[:, :1]))
    assert str(refused.value) == "build_tree_kernel_efficient_cpu: parent_list: Size mismatch for stride#0: expected 1 but got 5"


def test_a_one_node_tree_takes_any_row_stride_of_its_empty_selection():
    """N = 1: ``selected_index`` is ``[bs, 0]`` and the kernel binds no row stride to it."""
    args = dict(tree_of(1, 1, torch.zeros(BS, dtype=torch.bool)),
                selected_index=torch.zeros(BS, 5, dtype=torch.int64)[:, :0])
    K.build_tree_kernel_efficient_cpu(**args)
    assert args["positions"].tolist() == [5, 9] and args["retrive_index"].tolist() == [[0], [1]]
    assert args["tree_mask"].all() and (args["retrive_next_token"] == -1).all()


def test_every_stand_in_is_checked_here():
    from treespec_sglang.plugin.cpu import OPS as INSTALLED

    covered = {OPS[name][0].__name__ for name in OPS}
    assert set(INSTALLED) <= covered, set(INSTALLED) - covered
    assert {name for name, *_ in BROKEN} == set(OPS)  # every op has at least one refusal case
