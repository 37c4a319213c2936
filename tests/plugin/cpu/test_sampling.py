"""The CPU sampling-verify stand-in: SGLang's op interface over our exact walk."""

from collections import Counter

import pytest
import torch

from tests.helpers import random_batch
from tests.laws import exact_law, tv, tv_bound
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


def run_op(tree: DraftTree, probs, coins, final, width=None):
    bs, n = tree.tokens.shape
    r = sglang_retrive(tree)
    predicts = torch.full((bs * n,), -5, dtype=torch.int32)  # SGLang's dtypes (eagle_utils.eagle_sample)
    accept_index = torch.full((bs, width or tree.depth_bound + 1), -1, dtype=torch.int32)
    num = torch.zeros(bs, dtype=torch.int32)
    ridx = torch.arange(bs)[:, None] * n + torch.arange(n)
    tree_speculative_sampling_target_only(predicts, accept_index, num, tree.tokens.clamp(min=0), ridx,
                                          r.retrive_next_token, r.retrive_next_sibling, coins, final, probs,
                                          torch.zeros_like(probs))
    return predicts, accept_index, num


@pytest.mark.parametrize("wider", [False, True])
def test_one_hot_probs_give_the_greedy_kernel(rng, wider):
    """Also with more draft steps than nodes (N < S + 1, which SGLang allows at topk > 1): the coins are ``[bs, N]``
    and accept_index ``[bs, S + 1]`` wider (the walk read a coin past the coins' end)."""
    tree = random_batch(rng, [6, 9, 3], vocab=4)  # tiny vocab: plenty of accepts
    bs, n = tree.tokens.shape
    width = n + 3 if wider else tree.depth_bound + 1  # S + 1 > N: more steps than the coins' N columns
    logits = torch.randn(bs, n, 4)
    probs = target_probs(logits, 0.0)
    greedy = [torch.full((bs * n,), -5, dtype=torch.int32), torch.full((bs, width), -1, dtype=torch.int32),
              torch.zeros(bs, dtype=torch.int32)]
    r = sglang_retrive(tree)
    verify_tree_greedy_cpu(*greedy, tree.tokens.clamp(min=0), torch.arange(bs)[:, None] * n + torch.arange(n),
                           r.retrive_next_token, r.retrive_next_sibling, logits.argmax(-1))
    out = run_op(tree, probs, torch.rand(bs, n), torch.rand(bs), width=width)
    for a, b in zip(out, greedy):
        assert torch.equal(a, b)


def test_an_empty_batch_verifies_nothing_as_the_kernel():
    z = lambda *shape, dtype=torch.int64: torch.zeros(*shape, dtype=dtype)  # noqa: E731
    predicts, accept_index, num = z(0, dtype=torch.int32), z(0, 4, dtype=torch.int32), z(0, dtype=torch.int32)
    tree_speculative_sampling_target_only(predicts, accept_index, num, z(0, 3), z(0, 3), z(0, 3), z(0, 3),
                                          z(0, 3, dtype=torch.float32), z(0, dtype=torch.float32),
                                          z(0, 3, 5, dtype=torch.float32), z(0, 3, 5, dtype=torch.float32))
    assert predicts.numel() == accept_index.numel() == num.numel() == 0


def test_emitted_sequences_follow_the_target_law():
    """Many draws of one small tree with repeated sibling tokens and peaked p: empirical law of the
    committed tokens (predicts along accept_index) within the TV bound of the exact law."""
    tree = DraftTree.from_lists([[0, 1, 1, 2, 0, 2]], [[-1, 0, 0, 0, 1, 3]])
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


@pytest.mark.parametrize("final,bonus", [(0.25, 0), (0.75, 1)])
def test_the_final_coin_draws_the_bonus(final, bonus):
    """A root alone: the bonus is drawn from the root's law [1/2, 1/2] with ``uniform_samples_for_final_sampling``
    (inverse CDF), whatever the per-node coins say."""
    tree = DraftTree.from_lists([[5]], [[-1]])
    probs = torch.tensor([[[0.5, 0.5]]])
    predicts, _, num = run_op(tree, probs, torch.tensor([[1 - final]]), torch.tensor([final]))
    assert predicts.tolist() == [bonus] and num.tolist() == [0]


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


def top_k_loop(row, k):
    """One row's top-k renormalisation from its definition: the k largest kept (ties at the k-th kept), the
    rest 0, divided by the kept mass; k <= 0 or >= vocab keeps the row."""
    kth = sorted(row, reverse=True)[k - 1] if 0 < k < len(row) else min(row)
    kept = [x if x >= kth else 0.0 for x in row]
    return [x / sum(kept) for x in kept]


def top_p_loop(row, p):
    """One row's top-p renormalisation as FlashInfer's kernel defines it: a token is kept when the mass of the
    strictly larger probabilities is below p (ties at the cut all kept); p >= 1 keeps the row."""
    kept = [x if p >= 1 or sum(y for y in row if y > x) < p else 0.0 for x in row]
    return [x / sum(kept) for x in kept]


@pytest.mark.parametrize("row, p, want", [
    ([0.4, 0.3, 0.3], 0.5, [0.4, 0.3, 0.3]),  # a tie at the cut: both kept
    ([0.25] * 4, 0.3, [0.25] * 4),
    ([0.5, 0.3, 0.2], 0.6, [0.625, 0.375, 0.0]),
    ([0.7, 0.2, 0.1], 1.0, [0.7, 0.2, 0.1]),
    ([0.1, 0.3, 0.3, 0.3], 0.35, [0.0, 1 / 3, 1 / 3, 1 / 3]),
    ([0.5, 0.25, 0.25], 0.5, [1.0, 0.0, 0.0]),  # mass before the cut exactly p: not below it, cut
])
def test_top_p_renorm_keeps_ties_at_the_cut_as_flashinfer_does(row, p, want):
    """FlashInfer's top_p_renorm_probs keeps every token >= its threshold: tokens tied at the cut all stay."""
    assert top_p_renorm_prob(torch.tensor([row]), torch.tensor([p]))[0].tolist() == pytest.approx(want, abs=1e-6)
    assert top_p_loop(row, p) == pytest.approx(want, abs=1e-6)


def test_top_p_1_keeps_every_token_whatever_the_rounding():
    """p >= 1 keeps the row outright (FlashInfer's fast path): a tail token whose mass before it rounds to 1 stays."""
    got = top_p_renorm_prob(torch.tensor([[0.5, 0.5, 1e-8]]), torch.tensor([1.0]))
    assert int((got > 0).sum()) == 3


def test_a_greedy_rows_tie_at_the_top_survives_top_k_1_and_top_p():
    """SGLang turns a greedy row of a mixed batch into top-k 1 at T = 1; a tie at its top stays two tokens through
    both renormalisations, as FlashInfer's kernels keep it (the row may commit either, on the GPU as here)."""
    probs = top_k_renorm_prob(torch.tensor([[0.4, 0.4, 0.2]]), torch.tensor([1]))
    assert top_p_renorm_prob(probs, torch.tensor([0.5]))[0].tolist() == pytest.approx([0.5, 0.5, 0.0])


@pytest.mark.parametrize("seed", range(3))
def test_top_k_renorm_uses_each_rows_own_k(seed):
    g = torch.Generator().manual_seed(seed)
    k = torch.tensor([1, 7, 0, 50, 3, 49, 2, 20])  # [rows]: one, a few, off (0 and >= vocab), near vocab
    k = k[torch.randperm(len(k), generator=g)]
    probs = torch.softmax(torch.randn(len(k), 50, generator=g, dtype=torch.float64) * 2, -1).float()  # [rows, vocab]
    got = top_k_renorm_prob(probs, k)
    for r in range(len(k)):
        assert got[r].tolist() == pytest.approx(top_k_loop(probs[r].tolist(), int(k[r])), abs=1e-6), r
        assert int((got[r] > 0).sum()) == (int(k[r]) if 0 < k[r] < 50 else 50)


@pytest.mark.parametrize("seed", range(3))
def test_top_p_renorm_uses_each_rows_own_p(seed):
    g = torch.Generator().manual_seed(10 + seed)
    p = torch.tensor([0.05, 0.5, 0.9, 1.0, 0.3, 0.75, 0.2, 0.97])  # [rows]
    p = p[torch.randperm(len(p), generator=g)]
    probs = torch.softmax(torch.randn(len(p), 50, generator=g, dtype=torch.float64) * 2, -1).float()  # [rows, vocab]
    got = top_p_renorm_prob(probs, p)
    sizes = []
    for r in range(len(p)):
        want = top_p_loop(probs[r].tolist(), float(p[r]))
        assert got[r].tolist() == pytest.approx(want, abs=1e-6), r
        sizes.append(sum(x > 0 for x in want))
    assert len(set(sizes)) > 4  # the rows keep different numbers of tokens
