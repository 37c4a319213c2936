"""The CPU sampling-verify stand-in: SGLang's op interface over our exact walk."""

from collections import Counter

import pytest
import torch

from tests.helpers import random_batch
from tests.verify.test_sampling import exact_law, tv, tv_bound
from treespec_sglang.plugin.cpu.kernels import verify_tree_greedy_cpu
from treespec_sglang.plugin.cpu.sampling import (parents_from_links, top_k_renorm_prob, top_p_renorm_prob,
                                                 tree_speculative_sampling_target_only)
from treespec_sglang.tree import DraftTree, sglang_retrive
from treespec_sglang.verify import target_probs


@pytest.mark.parametrize("seed", range(4))
def test_parents_from_links_inverts_sglang_retrive(rng, seed):
    tree = random_batch(rng, [1, 5, 9, 12], vocab=7)
    r = sglang_retrive(tree)
    par = parents_from_links(r.retrive_next_token, r.retrive_next_sibling)
    assert torch.equal(par, torch.where(tree.valid, tree.parents, -1))


def run_op(tree: DraftTree, probs, coins, final):
    bs, n = tree.tokens.shape
    r = sglang_retrive(tree)
    predicts = torch.full((bs * n,), -5, dtype=torch.long)
    accept_index = torch.full((bs, tree.depth_bound + 1), -1, dtype=torch.long)
    num = torch.zeros(bs, dtype=torch.int32)
    ridx = torch.arange(bs)[:, None] * n + torch.arange(n)
    tree_speculative_sampling_target_only(predicts, accept_index, num, tree.tokens.clamp(min=0), ridx,
                                          r.retrive_next_token, r.retrive_next_sibling, coins, final, probs,
                                          torch.zeros_like(probs))
    return predicts, accept_index, num


def test_one_hot_probs_give_the_greedy_kernel(rng):
    tree = random_batch(rng, [6, 9, 3], vocab=4)  # tiny vocab: plenty of accepts
    bs, n = tree.tokens.shape
    logits = torch.randn(bs, n, 4)
    probs = target_probs(logits, 0.0)
    greedy = [torch.full((bs * n,), -5, dtype=torch.long), torch.full((bs, tree.depth_bound + 1), -1, dtype=torch.long),
              torch.zeros(bs, dtype=torch.int32)]
    r = sglang_retrive(tree)
    verify_tree_greedy_cpu(*greedy, tree.tokens.clamp(min=0), torch.arange(bs)[:, None] * n + torch.arange(n),
                           r.retrive_next_token, r.retrive_next_sibling, logits.argmax(-1))
    out = run_op(tree, probs, torch.rand(bs, n), torch.rand(bs))
    for a, b in zip(out, greedy):
        assert torch.equal(a, b)


def test_emitted_sequences_follow_the_target_law():
    """Many draws of one small tree with repeated sibling tokens and peaked p: empirical law of the
    committed tokens (predicts along accept_index) within the TV bound of the exact law."""
    tree = DraftTree.from_lists([[0, 1, 1, 2, 0, 2]], [[-1, 0, 0, 0, 1, 3]])
    V = 3
    logits = torch.tensor([[2.0, 1.5, -1.0], [0.0, 0.1, 0.2], [3.0, 0.0, 0.0], [0.5, -2.0, 1.0], [1.0, 1.0, 1.0],
                           [0.0, 0.0, 0.0]])
    probs = torch.softmax(logits, -1)
    n_draws = 200_000
    big = DraftTree(*(getattr(tree, f).expand(n_draws, -1) for f in ("tokens", "parents", "depth", "logprob")),
                    tree.size.expand(n_draws), tree.depth_bound)
    g = torch.Generator().manual_seed(0)
    predicts, accept_index, num = run_op(big, probs.expand(n_draws, -1, -1).contiguous(),
                                         torch.rand(n_draws, 6, generator=g), torch.rand(n_draws, generator=g))
    committed = torch.gather(predicts.view(n_draws, -1), 1, (accept_index % 6).clamp(min=0))
    counts = Counter(tuple(row[: k + 1]) for row, k in zip(committed.tolist(), num.tolist()))
    emp = {k: v / n_draws for k, v in counts.items()}
    law = exact_law(tree, probs)
    assert tv(emp, law) < tv_bound(len(law), n_draws)
    # control: SGLang's CPU behaviour (greedy verify at T > 0) is far from the law
    g_pred, g_acc, g_num = run_op(tree, target_probs(logits[None], 0.0),
                                  torch.rand(1, 6), torch.rand(1))
    greedy_seq = tuple(torch.gather(g_pred.view(1, -1), 1, g_acc.clamp(min=0))[0, : int(g_num) + 1].tolist())
    assert tv({greedy_seq: 1.0}, law) > 10 * tv_bound(len(law), n_draws)


@pytest.mark.parametrize("k", [1, 3, 50, 0])
def test_top_k_renorm_matches_plain_sampling(k):
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(k))
    torch.testing.assert_close(top_k_renorm_prob(torch.softmax(logits, -1), torch.full((4,), k)),
                               target_probs(logits, 1.0, top_k=k if k > 0 else -1))


@pytest.mark.parametrize("p", [0.05, 0.5, 0.9, 1.0])
def test_top_p_renorm_matches_plain_sampling(p):
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(3)) * 2
    torch.testing.assert_close(top_p_renorm_prob(torch.softmax(logits, -1), torch.full((4,), p)),
                               target_probs(logits, 1.0, top_p=p))
