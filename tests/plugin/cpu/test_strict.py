"""The stand-ins refuse what the real kernels refuse (:mod:`treespec_sglang.plugin.cpu.matcher`).

Each case starts from arguments shaped and typed as SGLang 0.5.23 passes them (the call sites in
``eagle_utils.py``, ``eagle_worker_common.py``, ``cache_locs.py``, ``intel_amx_backend.py``), checks that
the op takes them, then breaks one rule the compiled op (``sgl-kernel/csrc/cpu``) or SGLang's JIT kernel
(``kernels/jit/csrc/speculative``) checks and expects the same refusal."""

import pytest
import torch

from treespec_sglang.plugin.cpu import attention as A
from treespec_sglang.plugin.cpu import kernels as K
from treespec_sglang.plugin.cpu import sampling as S
from treespec_sglang.plugin.cpu.matcher import Device, Matcher, Size

BS, TOPK, DEPTH, N, POOL_LEN, H, D = 2, 2, 3, 4, 32, 2, 32


def strided(t):
    """The same values as a non-contiguous view (every other column of a wider tensor)."""
    wide = torch.zeros(*t.shape[:-1], 2 * t.shape[-1], dtype=t.dtype)
    wide[..., ::2] = t
    return wide[..., ::2]


def meta(t):
    return torch.empty_like(t, device="meta")


def build_tree():
    sel = torch.tensor([[0, 1, 2], [0, 2, 3]])
    return dict(parent_list=torch.tensor([[-1, 0, 1, 2, 3]] * BS), selected_index=sel,
                verified_seq_len=torch.tensor([5, 9]), tree_mask=torch.zeros(BS * N * N, dtype=torch.bool),
                positions=torch.zeros(BS * N, dtype=torch.int64), retrive_index=torch.zeros(BS, N, dtype=torch.int64),
                retrive_next_token=torch.full((BS, N), -1, dtype=torch.int64),  # filled with -1, as eagle_utils does
                retrive_next_sibling=torch.full((BS, N), -1, dtype=torch.int64), topk=TOPK, depth=DEPTH, draft_token_num=N,
                tree_mask_mode=1)


def verify_greedy():
    return dict(predicts=torch.zeros(BS * N, dtype=torch.int32), accept_index=torch.full((BS, DEPTH + 1), -1, dtype=torch.int32),
                accept_token_num=torch.zeros(BS, dtype=torch.int32), candidates=torch.zeros(BS, N, dtype=torch.int64),
                retrive_index=torch.arange(BS * N).view(BS, N), retrive_next_token=torch.full((BS, N), -1),
                retrive_next_sibling=torch.full((BS, N), -1), target_predict=torch.zeros(BS, N, dtype=torch.int64))


def sampling():
    v = verify_greedy()
    del v["target_predict"]
    probs = torch.full((BS, N, 8), 1 / 8)
    return dict(v, uniform_samples=torch.rand(BS, N), uniform_samples_for_final_sampling=torch.rand(BS),
                target_probs=probs, draft_probs=torch.zeros_like(probs), threshold_single=1.0, threshold_acc=1.0)


def pool():
    return torch.arange(6 * POOL_LEN, dtype=torch.int32).view(6, POOL_LEN)


def decode():
    return dict(query=torch.randn(BS, H, D), k_cache=torch.randn(64, H, D), v_cache=torch.randn(64, H, D), k_scale=1.0,
                v_scale=1.0, output=torch.zeros(BS, H, D), key=torch.randn(BS, H, D), value=torch.randn(BS, H, D),
                loc=torch.tensor([3, 4]), attn_logits=torch.zeros(BS, H, 4, D + 1), req_to_token=pool(),
                req_pool_indices=torch.tensor([0, 1]), seq_lens=torch.tensor([3, 6]), sm_scale=0.2, logit_cap=0.0,
                is_cross_attn=False, sliding_window_size=0, encoder_lens=None, sinks=None)


def extend():
    T = BS * N
    return dict(q_extend=torch.randn(T, H, D), k_extend=torch.randn(T, H, D), v_extend=torch.randn(T, H, D),
                o_extend=torch.zeros(T, H, D), k_buffer=torch.randn(6 * POOL_LEN, H, D),
                v_buffer=torch.randn(6 * POOL_LEN, H, D), k_scale=1.0, v_scale=1.0, req_to_token=pool(),
                req_pool_indices=torch.tensor([0, 2]), seq_lens=torch.tensor([9, 12]),
                extend_seq_lens=torch.full((BS,), N, dtype=torch.int32),
                extend_start_loc=torch.arange(0, T, N, dtype=torch.int32), max_len_extend=N, sm_scale=0.2,
                logit_cap=0.0, is_cross_attn=False, sliding_window_size=0, encoder_lens=None, sinks=None,
                tree_mask=torch.eye(N, dtype=torch.bool).repeat(BS, 1, 1).reshape(-1) | torch.tensor([True] + [False] * (N - 1)).repeat(BS * N),
                is_causal=True)


def segments():
    return dict(req_pool_indices=torch.tensor([0, 3]), req_to_token=pool(),
                start_offset=torch.tensor([2, 0], dtype=torch.int32), end_offset=torch.tensor([4, 3], dtype=torch.int32),
                out_cache_loc=torch.arange(5), pool_len=POOL_LEN)


def draft_locs():
    return dict(req_pool_indices=torch.tensor([0, 3]), req_to_token=pool(), seq_lens=torch.tensor([2, 7]),
                out_cache_loc=torch.zeros(BS * TOPK * DEPTH, dtype=torch.int64), pool_len=POOL_LEN, topk=TOPK,
                num_steps=DEPTH)


def bonus():
    return dict(accept_tokens=torch.zeros(BS, 3, dtype=torch.int32), accept_lens=torch.tensor([1, 3], dtype=torch.int32),
                bonus_tokens=torch.zeros(BS, dtype=torch.int32), accept_stride=3)


def accept_locs():
    return dict(accept_index=torch.tensor([[0, 2, -1], [4, -1, -1]], dtype=torch.int32), out_cache_loc=torch.arange(8),
                accept_out_cache_loc=torch.zeros(6, dtype=torch.int64))


KV = torch.zeros(16, 8)


def kv_copy():
    return dict(data_ptrs=torch.tensor([KV.data_ptr()], dtype=torch.uint64), strides=torch.tensor([32]),
                tgt_loc=torch.tensor([1, 2]), src_loc=torch.tensor([3, 4]))


def draft_metadata():
    return dict(req_to_token=pool(), req_pool_indices=torch.tensor([0, 1]), seq_lens=torch.tensor([3, 5]), topk=TOPK,
                num_steps=DEPTH, pool_len=POOL_LEN)


OPS = {
    "build_tree": (K.build_tree_kernel_efficient_cpu, build_tree),
    "verify_greedy": (K.verify_tree_greedy_cpu, verify_greedy),
    "sampling": (S.tree_speculative_sampling_target_only, sampling),
    "decode": (A.decode_attention_cpu, decode),
    "extend": (A.extend_attention_cpu, extend),
    "req_to_token": (K.assign_req_to_token_pool_cpu, segments),
    "extend_locs": (K.assign_extend_cache_locs_cpu, segments),
    "draft_locs": (K.assign_draft_cache_locs_contiguous_cpu, draft_locs),
    "bonus": (K.fill_bonus_tokens_cpu, bonus),
    "accept_locs": (K.fill_accept_out_cache_loc_cpu, accept_locs),
    "kv_copy": (K.copy_all_layer_kv_cache_cpu, kv_copy),
    "draft_metadata": (K.build_draft_decode_metadata_cpu, draft_metadata),
}

# (op, argument, how it is broken, what the kernel says)
BROKEN = [
    ("build_tree", "selected_index", lambda t: torch.zeros(BS, 2 * N, dtype=torch.int64)[:, :N - 1],
     rf"selected_index: Size mismatch for stride#0: expected {N - 1} but got {2 * N}"),
    ("build_tree", "selected_index", lambda t: t.int(), "selected_index: dtype mismatch: expected int64 but got int32"),
    ("build_tree", "parent_list", lambda t: t[:, :3].contiguous(), "parent_list has 3 columns"),
    ("build_tree", "positions", lambda t: strided(t), "positions: Tensor is not contiguous"),
    ("build_tree", "retrive_next_token", lambda t: t.int(), "retrive_next_token: dtype mismatch"),
    ("build_tree", "verified_seq_len", meta, "verified_seq_len: Device mismatch"),
    ("build_tree", "tree_mask", lambda t: t.to(torch.uint8), "tree_mask must be bool"),
    ("build_tree", "tree_mask", lambda t: t[:-1], "tree_mask has 31 entries, expected 32"),
    ("build_tree", "tree_mask_mode", lambda m: 3, "tree_mask_mode must be 0"),
    ("build_tree", "retrive_next_sibling", lambda t: torch.zeros_like(t), "retrive_next_sibling must come filled"),
    ("verify_greedy", "accept_index", lambda t: t.long(), "accept_index: dtype mismatch: expected int32"),
    ("verify_greedy", "predicts", lambda t: t[:-1], "predicts: Size mismatch for shape#0"),
    ("verify_greedy", "candidates", lambda t: strided(t), "candidates: Tensor is not contiguous"),
    ("verify_greedy", "target_predict", lambda t: t[:1], r"target_predict: Size mismatch for shape#0\('batch_size'\)"),
    ("sampling", "target_probs", lambda t: t.double(), "target_probs: dtype mismatch: expected float32"),
    ("sampling", "uniform_samples", lambda t: strided(t), "uniform_samples: Tensor is not contiguous"),
    ("sampling", "threshold_acc", lambda t: 1.5, "threshold_acc must be in"),
    ("decode", "query", lambda t: t.transpose(1, 2).contiguous().transpose(1, 2), "query must be contiguous at last dim"),
    ("decode", "attn_logits", lambda t: t.half(), "attn_logits must be float32"),
    ("decode", "seq_lens", lambda t: t.int(), "expect req_lens to be int64"),
    ("decode", "value", lambda t: None, "key and value should have values at the same time"),
    ("decode", "loc", lambda t: t.int(), "loc must be int64"),
    ("decode", "output", lambda t: t.double(), "output must have the query's dtype"),
    ("decode", "key", lambda t: t.double(), "key must have the query's dtype"),
    ("decode", "v_cache", lambda t: t.double(), "the KV buffers must share the query's dtype"),
    ("decode", "sinks", lambda t: torch.zeros(1), r"sinks must be 1D with one entry per query head \(2\)"),
    ("extend", "o_extend", lambda t: strided(t), "o_extend: Tensor is not contiguous"),
    ("extend", "extend_seq_lens", lambda t: t.long(), "same dtype as req_to_token"),
    ("extend", "extend_seq_lens", lambda t: torch.tensor([N, N - 1], dtype=torch.int32), "uniform extend_seq_lens"),
    ("extend", "tree_mask", lambda t: t[: -N], "expect tree_mask numel to be num_seqs"),
    ("extend", "tree_mask", lambda t: t.to(torch.uint8), "tree_mask: dtype mismatch: expected bool"),
    ("extend", "req_pool_indices", lambda t: t.int(), "expect req_pool_indices to be int64"),
    ("extend", "o_extend", lambda t: t.double(), "o_extend must have the query's dtype"),
    ("extend", "k_buffer", lambda t: t.double(), "the KV buffers must share the query's dtype"),
    ("extend", "sinks", lambda t: torch.zeros(2, 2), "sinks must be 1D"),
    ("req_to_token", "req_to_token", lambda t: t.long(), "req_to_token: dtype mismatch: expected int32"),
    ("req_to_token", "out_cache_loc", lambda t: t.int(), "out_cache_loc must be int64"),
    ("req_to_token", "end_offset", lambda t: t.long(), "start_offset and end_offset must have the same dtype"),
    ("req_to_token", "out_cache_loc", lambda t: t[:4], "out_cache_loc has 4 entries but offsets require 5"),
    ("extend_locs", "req_to_token", lambda t: strided(t), "req_to_token: Tensor is not contiguous"),
    ("draft_locs", "out_cache_loc", lambda t: t[:-1], "expected bs \\* topk \\* num_steps"),
    ("draft_locs", "pool_len", lambda n: n - 1, r"req_to_token: Size mismatch for shape#1"),
    ("bonus", "accept_tokens", lambda t: t.long(), "accept_tokens must be int32"),
    ("bonus", "accept_stride", lambda n: 2, "expected bs \\* accept_stride"),
    ("bonus", "accept_lens", lambda t: torch.zeros_like(t), r"accept_lens must be in \[1, accept_stride"),
    ("accept_locs", "accept_out_cache_loc", lambda t: t[:5], "fewer than accept_index's 6"),
    ("accept_locs", "out_cache_loc", lambda t: t.int(), "out_cache_loc must be int64"),
    ("accept_locs", "out_cache_loc", lambda t: t[:4], "accept_index out of range"),
    ("kv_copy", "data_ptrs", lambda t: t.long(), "data_ptrs must be uint64"),
    ("kv_copy", "src_loc", lambda t: t.int(), "tgt_loc and src_loc must share"),
    ("kv_copy", "tgt_loc", lambda t: t[:0], "src_loc and tgt_loc must have the same length"),  # checked when empty too
    ("draft_metadata", "req_to_token", lambda t: strided(t), "req_to_token: Tensor is not contiguous"),
    ("draft_metadata", "seq_lens", lambda t: t[:1], "seq_lens has 1 elements, expected 2"),
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
    with pytest.raises(RuntimeError, match=msg):
        fn(**args)


def test_every_stand_in_is_checked_here():
    from treespec_sglang.plugin.cpu import OPS as INSTALLED

    covered = {OPS[name][0].__name__ for name in OPS}
    assert set(INSTALLED) <= covered, set(INSTALLED) - covered
    assert {name for name, *_ in BROKEN} == set(OPS)  # every op has at least one refusal case


def test_a_symbol_binds_to_the_first_tensor_and_holds_the_rest_to_it():
    bs = Size("batch_size")
    m = Matcher("op", [bs, -1]).dtype(torch.int64)
    m.verify(torch.zeros(3, 5, dtype=torch.int64), "a")
    m.verify(torch.zeros(3, 5, dtype=torch.int64), "b")
    with pytest.raises(RuntimeError, match=r"op: c: Size mismatch for shape#0\('batch_size'\): expected 3 but got 2"):
        m.verify(torch.zeros(2, 5, dtype=torch.int64), "c")
    with pytest.raises(RuntimeError, match="op: d: Size mismatch for shape#1: expected 5 but got 4"):  # -1 bound too
        m.verify(torch.zeros(3, 4, dtype=torch.int64), "d")


def test_given_strides_replace_the_contiguity_rule_and_skip_bound_size_one_dims():
    col = torch.zeros(4, 9)[:, :3]  # strides (9, 1)
    Matcher("op", [4, 3]).strides([9, 1]).verify(col, "a")
    with pytest.raises(RuntimeError, match="not contiguous"):
        Matcher("op", [4, 3]).verify(col, "a")
    one_row = torch.zeros(1, 9)[:, :3]  # size-1 dim: its (bound) stride is not checked, as in TensorMatcher
    Matcher("op", [1, 3]).strides([3, 1]).verify(one_row, "a")
    with pytest.raises(RuntimeError, match="stride#0"):
        Matcher("op", [4, 3]).strides([3, 1]).verify(col, "a")


def test_a_device_symbol_wants_one_device_of_its_kind():
    dev = Device("cpu")
    m = Matcher("op", [-1]).device(dev)
    m.verify(torch.zeros(2), "a")
    with pytest.raises(RuntimeError, match="a: Device mismatch: expected cpu but got meta"):
        Matcher("op", [-1]).device(Device("cpu")).verify(torch.zeros(2, device="meta"), "a")
    with pytest.raises(RuntimeError, match="dimension mismatch: expected 1 but got 2"):
        m.verify(torch.zeros(2, 2), "b")
