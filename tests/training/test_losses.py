"""The training objectives against hand-computed values."""

import math

import pytest
import torch

from treespec_sglang.training.losses import (acceptance_rate, kl_loss, lk_alpha_loss, lk_lambda, lk_lambda_loss,
                                             multi_step_loss, talf_loss, ttt_weights)

P = torch.tensor([0.5, 0.3, 0.2])
Q = torch.tensor([0.2, 0.5, 0.3])
# hand-computed: alpha = .2 + .3 + .2; KL = .5 ln 2.5 + .3 ln .6 + .2 ln(2/3); H(p, q) = -sum p ln q
ALPHA = 0.7
KL = 0.5 * math.log(2.5) + 0.3 * math.log(0.6) + 0.2 * math.log(2 / 3)  # 0.2238047
CE = -(0.5 * math.log(0.2) + 0.3 * math.log(0.5) + 0.2 * math.log(0.3))  # 1.253458


def logits(p):
    return p.log()[None]


def test_acceptance_kl_and_lk_alpha_by_hand():
    t, d = logits(P), logits(Q)
    assert acceptance_rate(t, d).item() == pytest.approx(ALPHA, abs=1e-6)
    assert kl_loss(t, d).item() == pytest.approx(KL, abs=1e-6)
    assert kl_loss(t, d).item() == pytest.approx(0.2238047, abs=1e-6)
    assert lk_alpha_loss(t, d).item() == pytest.approx(-math.log(0.7), abs=1e-5)


@pytest.mark.parametrize("seed", range(3))
def test_acceptance_rate_is_one_minus_total_variation(seed):
    """alpha = sum min(p, q) = 1 - TV(p, q), checked on the code's output for random sharp and flat pairs
    (TV computed independently here), not on the test's own constants."""
    g = torch.Generator().manual_seed(seed)
    scale = torch.tensor([0.1, 1.0, 8.0])[:, None, None]
    t, d = torch.randn(3, 5, 13, generator=g) * scale, torch.randn(3, 5, 13, generator=g) * scale
    tv = 0.5 * (t.softmax(-1) - d.softmax(-1)).abs().sum(-1)
    got = acceptance_rate(t, d)
    assert got.shape == (3, 5)
    torch.testing.assert_close(got, 1 - tv, rtol=0, atol=1e-6)
    assert acceptance_rate(t, t).sub(1).abs().max() < 1e-6


def test_lk_lambda_by_hand():
    t, d = logits(P), logits(Q)
    lam = math.exp(-3.0 * ALPHA)  # 0.1224564
    assert lk_lambda(acceptance_rate(t, d), eta=3.0).item() == pytest.approx(lam, abs=1e-6)
    assert lk_lambda_loss(t, d, eta=3.0).item() == pytest.approx(lam * KL + (1 - lam) * (1 - ALPHA), abs=1e-6)
    assert lk_lambda_loss(t, d, eta=3.0).item() == pytest.approx(0.2906695, abs=1e-6)


def test_lambda_is_a_stopgrad_weight():
    t = logits(P)
    d = logits(Q).clone().requires_grad_(True)
    lk_lambda_loss(t, d, eta=3.0).backward()
    lam = math.exp(-3.0 * ALPHA)
    d2 = logits(Q).clone().requires_grad_(True)
    (lam * kl_loss(t, d2) + (1 - lam) * (1 - acceptance_rate(t, d2)).mean()).backward()
    torch.testing.assert_close(d.grad, d2.grad)


def test_truncated_vocabulary_by_hand():
    """Target vocab 4, draft vocab = target tokens {0, 2}: alpha uses the original p, KL the masked proxy."""
    p = torch.tensor([0.4, 0.1, 0.3, 0.2])
    q = torch.tensor([0.6, 0.4])
    d2t = torch.tensor([0, 2])
    t, d = logits(p), logits(q)
    assert acceptance_rate(t, d, d2t).item() == pytest.approx(0.4 + 0.3, abs=1e-6)
    proxy = [4 / 7, 3 / 7]
    kl = proxy[0] * math.log(proxy[0] / 0.6) + proxy[1] * math.log(proxy[1] / 0.4)  # 0.001688
    assert kl_loss(t, d, d2t=d2t).item() == pytest.approx(kl, abs=1e-6)
    lam = math.exp(-3 * 0.7)
    assert lk_lambda_loss(t, d, d2t=d2t).item() == pytest.approx(lam * kl + (1 - lam) * 0.3, abs=1e-6)


def test_masks_and_ttt_weights():
    t = torch.stack([logits(P)[0], logits(Q)[0]])[None]  # [1, 2, 3]
    d = torch.stack([logits(Q)[0], logits(Q)[0]])[None]
    mask = torch.tensor([[True, False]])
    assert kl_loss(t, d, mask).item() == pytest.approx(KL, abs=1e-6)  # the masked position (KL 0) is ignored
    assert kl_loss(t, d).item() == pytest.approx(KL / 2, abs=1e-6)
    assert ttt_weights(3).tolist() == pytest.approx([1.0, 0.8, 0.64])
    assert multi_step_loss([torch.tensor(1.0), torch.tensor(2.0), torch.tensor(3.0)]).item() == pytest.approx(4.52)
    with pytest.raises(ValueError, match="gamma must be in"):
        ttt_weights(2, gamma=0.0)


def test_talf_is_per_node_cross_entropy():
    t = torch.stack([logits(P)[0], logits(Q)[0], logits(P)[0]])[None]  # 3 tree nodes
    d = torch.stack([logits(Q)[0], logits(Q)[0], logits(P)[0]])[None]
    mask = torch.tensor([[True, True, False]])  # node 2 is padding
    H_qq = -(Q * Q.log()).sum().item()
    assert talf_loss(t, d, mask).item() == pytest.approx((CE + H_qq) / 2, abs=1e-5)
