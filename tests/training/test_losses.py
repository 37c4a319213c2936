"""The training objectives against hand-computed values."""

import itertools
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


def _batch(seed=0, bs=2, n=3, vt=7):
    """Random ``[bs, n, V_t]`` target and ``[bs, n, V_d]`` draft logits (V_d = 4 with ``D2T``), a mask with a
    masked position unlike the kept ones."""
    g = torch.Generator().manual_seed(seed)
    t = torch.randn(bs, n, vt, generator=g) * 2
    mask = torch.ones(bs, n, dtype=torch.bool)
    mask[0, 1] = False
    t[0, 1] *= 10  # the masked position: far sharper, so letting it in moves every mean
    return t, torch.randn(bs, n, vt, generator=g), torch.randn(bs, n, len(D2T), generator=g), mask


D2T = torch.tensor([5, 0, 3, 6])


def _restated(t, d, d2t=None):
    """Per position (plain Python over one position at a time): alpha against the whole target law, KL and
    cross-entropy against the target renormalised on the draft vocabulary."""
    alpha, kl, ce = torch.zeros(t.shape[:-1]), torch.zeros(t.shape[:-1]), torch.zeros(t.shape[:-1])
    for idx in itertools.product(*map(range, t.shape[:-1])):
        p = torch.softmax(t[idx].double(), -1)
        q = torch.softmax(d[idx].double(), -1).tolist()
        pd = (p if d2t is None else p[d2t]).tolist()
        pn = [x / sum(pd) for x in pd]
        alpha[idx] = sum(min(a, b) for a, b in zip(pd, q))
        kl[idx] = sum(a * math.log(a / b) for a, b in zip(pn, q))
        ce[idx] = -sum(a * math.log(b) for a, b in zip(pn, q))
    return alpha, kl, ce


@pytest.mark.parametrize("truncated", [False, True], ids=["full", "d2t"])
def test_losses_on_a_masked_batch_equal_the_restated_ones(truncated):
    """[bs, n, V] logits with a mask and (d2t) a reduced draft vocabulary, every loss against its per-position
    restatement and the mean over the kept positions only; LK^lambda's lambda from the kept positions' alpha, at a
    given eta and at its default 3 (LK §4.2-4.4)."""
    t, d_full, d_red, mask = _batch()
    d, d2t = (d_red, D2T) if truncated else (d_full, None)
    alpha, kl, ce = _restated(t, d, d2t)
    mean = lambda x: float(x[mask].mean())  # noqa: E731
    torch.testing.assert_close(acceptance_rate(t, d, d2t).double(), alpha.double(), rtol=0, atol=1e-6)
    assert kl_loss(t, d, mask, d2t).item() == pytest.approx(mean(kl), abs=1e-6)
    assert lk_alpha_loss(t, d, mask, d2t).item() == pytest.approx(mean(-torch.log(alpha + 1e-6)), abs=1e-5)
    assert talf_loss(t, d, mask, d2t).item() == pytest.approx(mean(ce), abs=1e-5)
    for eta, kw in ((3.0, {}), (1.5, {"eta": 1.5})):
        lam = math.exp(-eta * mean(alpha))
        assert lk_lambda(acceptance_rate(t, d, d2t), mask, **kw).item() == pytest.approx(lam, abs=1e-6)
        want = lam * mean(kl) + (1 - lam) * mean(1 - alpha)
        assert lk_lambda_loss(t, d, mask, d2t, **kw).item() == pytest.approx(want, abs=1e-5)


def test_losses_with_zero_probability_tokens():
    """A target token of probability 0 adds nothing to the cross-entropy; disjoint target and draft laws
    (alpha 0) give LK^alpha -log(eps), not nan."""
    t = torch.tensor([[0.0, 1.0, float("-inf"), float("-inf")]])
    d = torch.tensor([[1.0, 0.0, 2.0, -1.0]])
    lq = torch.log_softmax(d, -1)[0]
    p = torch.softmax(t, -1)[0]
    assert talf_loss(t, d, torch.tensor([True])).item() == pytest.approx(-float(p[0] * lq[0] + p[1] * lq[1]), abs=1e-6)
    disjoint = torch.tensor([[float("-inf"), float("-inf"), 0.0, 0.0]])
    assert acceptance_rate(t, disjoint).item() == 0.0
    assert lk_alpha_loss(t, disjoint).item() == pytest.approx(-math.log(1e-6), rel=1e-6)
    assert lk_alpha_loss(t, disjoint, eps=1e-3).item() == pytest.approx(-math.log(1e-3), rel=1e-6)


def test_ttt_weights_bounds_and_the_gamma_passed_on():
    assert ttt_weights(1).tolist() == [1.0]
    assert ttt_weights(3, gamma=1.0).tolist() == [1.0, 1.0, 1.0]
    assert ttt_weights(2).dtype == torch.float32
    for bad in (0, -1, 2.0, "2"):
        with pytest.raises(ValueError, match=r"^steps must be an integer >= 1, got " + repr(bad).replace(".", r"\.")):
            ttt_weights(bad)
    for bad in (0.0, 1.5, -0.2):
        with pytest.raises(ValueError, match=r"^gamma must be in \(0, 1\], got "):
            ttt_weights(2, gamma=bad)
    steps = [torch.tensor(1.0), torch.tensor(2.0), torch.tensor(3.0)]
    assert multi_step_loss(steps, gamma=0.5).item() == pytest.approx(1 + 1 + 0.75)
