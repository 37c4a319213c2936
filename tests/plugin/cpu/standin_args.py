"""SGLang 0.5.23's arguments to each ``sgl_kernel`` stand-in, shaped and typed as its call sites pass them
(``eagle_utils.py``, ``eagle_worker_common.py``, ``cache_locs.py``, ``intel_amx_backend.py``), and the views that
break one rule: shared by the strictness tests."""

import torch

from treespec_sglang.plugin.cpu import attention as A
from treespec_sglang.plugin.cpu import kernels as K
from treespec_sglang.plugin.cpu import sampling as S

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


def tree_of(n: int, mode: int, mask: torch.Tensor) -> dict:
    """``build_tree``'s arguments for an ``n``-node tree in ``mode`` (shapes and dtypes as SGLang passes them)."""
    return dict(build_tree(), selected_index=torch.zeros(BS, n - 1, dtype=torch.int64), tree_mask=mask,
                positions=torch.zeros(BS * n, dtype=torch.int64), retrive_index=torch.zeros(BS, n, dtype=torch.int64),
                retrive_next_token=torch.full((BS, n), -1), retrive_next_sibling=torch.full((BS, n), -1),
                draft_token_num=n, tree_mask_mode=mode)
