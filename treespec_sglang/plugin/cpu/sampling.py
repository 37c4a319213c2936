"""Exact sampling verification for SGLang's CPU engine (SGLang verifies greedily on CPU at any T).

SGLang 0.5.23's ``eagle_utils.eagle_sample`` takes its sampling branch only where
``tree_speculative_sampling_target_only`` / ``top_k_renorm_prob`` / ``top_p_renorm_prob`` exist; on
CPU they are ``None`` and ``_verify_uses_greedy`` forces the greedy walk, so T > 0 requests come back
greedy-verified (not the target distribution). These torch versions, with the plugin's
``_verify_uses_greedy`` replacement, give CPU requests at T > 0 the exact sibling walk of
:func:`treespec_sglang.verify.walk_tree` (SGLang's "target-only" rule, :mod:`treespec_sglang.verify.tree`).
No sglang import.
"""

from __future__ import annotations

import torch

from ...tree import DraftTree
from ...verify import walk_tree
from .kernels import _check_verify_greedy
from .matcher import Device, Matcher, Size, check

__all__ = ["tree_speculative_sampling_target_only", "top_k_renorm_prob", "top_p_renorm_prob",
           "parents_from_links"]


def parents_from_links(next_token: torch.Tensor, next_sibling: torch.Tensor) -> torch.Tensor:
    """``[bs, N]`` parent of every node reachable from the root through first-child / next-sibling links.

    Unreachable nodes (SGLang's unlinked filler) and the root get -1.
    Example: next_token [1, 3, -1, -1], next_sibling [-1, 2, -1, -1] -> parents [-1, 0, 0, 1].
    """
    bs, n = next_token.shape
    parent = torch.full((bs, n + 1), -1, dtype=torch.int64, device=next_token.device)  # column n: dump slot
    nt, ns = next_token.long(), next_sibling.long()
    owner = torch.arange(n, device=nt.device).expand(bs, n)  # the parent each chain walk belongs to
    c = nt
    for _ in range(n):  # a sibling chain is at most N - 1 long
        parent.scatter_(1, torch.where(c >= 0, c, n), torch.where(c >= 0, owner, -1))
        c = torch.where(c >= 0, torch.gather(ns, 1, c.clamp(min=0)), -1)
    return parent[:, :n]


def _check_sampling(predicts, accept_index, accept_token_num, candidates, retrive_index, retrive_next_token,
                    retrive_next_sibling, uniform_samples, uniform_samples_for_final_sampling, target_probs,
                    draft_probs, threshold_single, threshold_acc) -> None:
    """The entry checks of SGLang's sampling verify (``kernels/jit/csrc/speculative/sampling.cuh``), on the
    CPU: the greedy op's tree tensors and outputs, float32 coins ``[bs, N]`` / ``[bs]``, float32 contiguous
    ``[bs, N, vocab]`` target and draft probabilities, thresholds in [0, 1]."""
    op = "tree_speculative_sampling_target_only"
    bs, n = _check_verify_greedy(op, predicts, accept_index, accept_token_num, candidates, retrive_index,
                                 retrive_next_token, retrive_next_sibling)
    vocab, dev = Size("vocab_size"), Device("cpu")
    Matcher(op, [bs, n]).dtype(torch.float32).device(dev).verify(uniform_samples, "uniform_samples")
    Matcher(op, [bs]).dtype(torch.float32).device(dev).verify(uniform_samples_for_final_sampling,
                                                              "uniform_samples_for_final_sampling")
    Matcher(op, [bs, n, vocab]).dtype(torch.float32).device(dev).verify(target_probs, "target_probs") \
        .verify(draft_probs, "draft_probs")
    check(op, vocab.unwrap() > 0, "vocab_size must be > 0")
    for name, t in (("threshold_single", threshold_single), ("threshold_acc", threshold_acc)):
        check(op, 0 <= t <= 1, f"{name} must be in [0, 1], got {t}")


def tree_speculative_sampling_target_only(predicts, accept_index, accept_token_num, candidates, retrive_index,
                                          retrive_next_token, retrive_next_sibling, uniform_samples,
                                          uniform_samples_for_final_sampling, target_probs, draft_probs,
                                          threshold_single: float = 1.0, threshold_acc: float = 1.0,
                                          deterministic: bool = True) -> None:
    """Sampling verification with SGLang's ``sgl_kernel`` signature (outputs as in the greedy op).

    candidates / retrive_* ``[bs, N]``, uniform_samples ``[bs, N]`` (column d decides depth d + 1),
    uniform_samples_for_final_sampling ``[bs]``, target_probs ``[bs, N, vocab]``. ``draft_probs`` is
    SGLang's zeros (target-only rule) and unused. The accept thresholds are not applied: the walk
    is always the exact one (the plugin warns when a server relaxes them).
    Writes predicts ``[bs*N]`` (the next accepted token at each accepted node, the bonus at the
    last), accept_index ``[bs, S+1]`` and accept_token_num ``[bs]``.
    """
    _check_sampling(predicts, accept_index, accept_token_num, candidates, retrive_index, retrive_next_token,
                    retrive_next_sibling, uniform_samples, uniform_samples_for_final_sampling, target_probs,
                    draft_probs, threshold_single, threshold_acc)
    bs, n = candidates.shape
    if bs == 0:  # as the kernel: nothing to verify
        return
    steps = accept_index.shape[1]
    dev = candidates.device
    parents = parents_from_links(retrive_next_token, retrive_next_sibling)
    tree = DraftTree(candidates.long(), parents, torch.zeros_like(parents), torch.zeros(bs, n, device=dev),
                     torch.full((bs,), n, dtype=torch.int64, device=dev), steps - 1)
    inner = uniform_samples[:, : steps - 1].float()  # fewer columns when N < S + 1 (a tree is at most N - 1 deep)
    coins = torch.cat([inner, inner.new_zeros(bs, steps - 1 - inner.shape[1]),  # depths no tree reaches
                       uniform_samples_for_final_sampling.reshape(bs, 1).float()], 1)  # [bs, steps]
    res = walk_tree(tree, target_probs.reshape(bs, n, -1), coins)
    ridx = retrive_index.long()
    path = res.path  # [bs, steps] node ids, -1 padded
    acc = path >= 0
    accept_index[:, :steps] = torch.where(acc, torch.gather(ridx, 1, path.clamp(min=0)), accept_index[:, :steps])
    # the token committed at path node i is the token of path node i + 1, the bonus at the last
    nxt_tok = torch.gather(candidates.long(), 1, path[:, 1:].clamp(min=0))
    nxt_tok = torch.where(path[:, 1:] >= 0, nxt_tok, -1)
    commit = torch.cat([nxt_tok, nxt_tok.new_full((bs, 1), -1)], 1)
    commit.scatter_(1, res.num_accepted[:, None], res.bonus[:, None])
    at = torch.gather(ridx, 1, path.clamp(min=0))
    predicts[at[acc]] = commit[acc].to(predicts.dtype)
    accept_token_num.copy_(res.num_accepted.to(accept_token_num.dtype))


def top_k_renorm_prob(probs: torch.Tensor, top_k) -> torch.Tensor:
    """Keep each row's ``top_k`` largest probabilities (ties at the k-th kept) and renormalise.

    probs ``[rows, vocab]``; top_k int or ``[rows]`` (<= 0 or >= vocab: unchanged).
    """
    V = probs.shape[-1]
    k = torch.as_tensor(top_k, device=probs.device).long().reshape(-1, 1).expand(probs.shape[0], 1)
    k = torch.where((k > 0) & (k < V), k, V)
    kth = torch.gather(torch.sort(probs, dim=-1, descending=True).values, 1, k - 1)
    kept = torch.where(probs >= kth, probs, 0.0)
    return kept / kept.sum(-1, keepdim=True)


def top_p_renorm_prob(probs: torch.Tensor, top_p) -> torch.Tensor:
    """FlashInfer's ``top_p_renorm_probs`` (what SGLang's CUDA verify calls): keep each token whose row holds less
    than ``top_p`` of mass in strictly larger probabilities, and renormalise; ``top_p >= 1`` keeps the row.

    The kept set is every token >= v, v the smallest probability of the shortest descending prefix whose mass
    reaches p: tokens tied at v are all kept (a prefix walk in sorted order would keep only the first of them).
    probs ``[rows, vocab]``; top_p float or ``[rows]``.
    Example: [0.4, 0.3, 0.3], p 0.5 -> [0.4, 0.3, 0.3]; [0.5, 0.3, 0.2], p 0.6 -> [0.625, 0.375, 0].
    """
    p = torch.as_tensor(top_p, device=probs.device, dtype=torch.float32).reshape(-1, 1)  # [rows or 1, 1]
    sp = torch.sort(probs, dim=-1, descending=True).values  # [rows, vocab]
    in_prefix = (sp.cumsum(-1) - sp) < p  # the mass before it (descending) is below p; the first always
    v = torch.where(in_prefix, sp, float("inf")).amin(-1, keepdim=True)  # [rows, 1]
    kept = torch.where((p >= 1) | (probs >= v), probs, 0.0)
    return kept / kept.sum(-1, keepdim=True)
