"""Draft-training objectives as pure functions over logits (and tree tensors).

Notation: p = target next-token distribution, q = draft distribution. With a truncated draft
vocabulary (EAGLE-3 / FR-Spec) the draft scores ``V_d`` tokens and ``d2t[v]`` is the target id of
draft token v.

* KL (EAGLE baseline): KL(p || q) = sum p (log p - log q). With truncation the target is the
  masked proxy p' = softmax(target logits restricted to the draft vocabulary) (LK paper §4.4).
* acceptance alpha = sum_v min(p(v), q(v)) = 1 - TV(p, q); out-of-vocabulary tokens have q = 0 and
  contribute nothing, so no proxy is needed (LK §4.4).
* LK^alpha = -log alpha (LK §4.3); LK^lambda = lambda KL + (1 - lambda) TV with
  lambda = exp(-eta * stopgrad(mean alpha)) per draft position (LK §4.2).
* Multi-step test-time training: step k weighted gamma^k, gamma = 0.8 (EAGLE / SpecForge).
* TALF (SALF&TALF Alg. 1, §3.2): sum over tree nodes of CE(p_target(child(n)), p_draft(child(n))).

Shapes: ``[..., vocab]`` logits, ``[...]`` masks; every loss returns a scalar (mean over valid
positions) unless it says otherwise.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

__all__ = ["target_probs_for_draft", "kl_div", "soft_cross_entropy", "acceptance_rate", "kl_loss", "lk_alpha_loss",
           "lk_lambda_loss", "lk_lambda", "ttt_weights", "multi_step_loss", "talf_loss", "masked_mean"]


def masked_mean(x: torch.Tensor, mask: Optional[torch.Tensor]) -> torch.Tensor:
    """Mean of ``x`` over positions where ``mask`` is True (all if None); 0 if none are."""
    if mask is None:
        return x.sum() / max(x.numel(), 1)  # an empty batch step contributes 0, not nan
    m = mask.to(x.dtype)
    return (x * m).sum() / m.sum().clamp(min=1.0)


def target_probs_for_draft(target_logits: torch.Tensor, d2t: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``[..., V_t]`` target logits -> ``[..., V_d]`` probabilities over the draft vocabulary.

    Without ``d2t`` this is softmax. With ``d2t`` ([V_d] int64) it is the masked proxy of LK §4.4:
    logits outside the draft vocabulary are dropped before the softmax.
    """
    x = target_logits.float()
    if d2t is not None:
        x = x.index_select(-1, d2t)
    return torch.softmax(x, dim=-1)


def kl_div(p: torch.Tensor, log_q: torch.Tensor) -> torch.Tensor:
    """KL(p || q) per position, ``[..., V]`` -> ``[...]`` (0 log 0 = 0)."""
    log_p = torch.where(p > 0, p.clamp(min=1e-30).log(), 0.0)
    return (p * (log_p - log_q)).sum(-1)


def soft_cross_entropy(p: torch.Tensor, log_q: torch.Tensor) -> torch.Tensor:
    """H(p, q) = -sum p log q per position, ``[..., V]`` -> ``[...]``."""
    return -(torch.where(p > 0, p * log_q, 0.0)).sum(-1)


def acceptance_rate(target_logits: torch.Tensor, draft_logits: torch.Tensor,
                    d2t: Optional[torch.Tensor] = None) -> torch.Tensor:
    """alpha = sum_v min(p(v), q(v)) per position against the *original* target distribution.

    ``[..., V_t]``, ``[..., V_d]`` -> ``[...]``; example p = [.5, .3, .2], q = [.2, .5, .3] -> 0.7.
    """
    p = torch.softmax(target_logits.float(), dim=-1)
    if d2t is not None:
        p = p.index_select(-1, d2t)  # out-of-vocabulary target mass meets q = 0: contributes 0
    q = torch.softmax(draft_logits.float(), dim=-1)
    return torch.minimum(p, q).sum(-1)


def kl_loss(target_logits, draft_logits, mask=None, d2t=None) -> torch.Tensor:
    """Forward KL(p || q), mean over masked positions (the EAGLE baseline)."""
    p = target_probs_for_draft(target_logits, d2t)
    return masked_mean(kl_div(p, torch.log_softmax(draft_logits.float(), -1)), mask)


def lk_alpha_loss(target_logits, draft_logits, mask=None, d2t=None, eps: float = 1e-6) -> torch.Tensor:
    """LK^alpha = -log alpha, mean over masked positions (LK §4.3)."""
    a = acceptance_rate(target_logits, draft_logits, d2t)
    return masked_mean(-torch.log(a + eps), mask)


def lk_lambda(alpha: torch.Tensor, mask=None, eta: float = 3.0) -> torch.Tensor:
    """lambda = exp(-eta * stopgrad(batch-mean alpha)) for one draft position (a scalar)."""
    return torch.exp(-eta * masked_mean(alpha.detach(), mask))


def lk_lambda_loss(target_logits, draft_logits, mask=None, d2t=None, eta: float = 3.0) -> torch.Tensor:
    """LK^lambda = lambda KL + (1 - lambda) TV with the adaptive lambda of LK §4.2.

    KL uses the truncated-vocabulary proxy (§4.4); TV = 1 - alpha uses the original target.
    Call it once per draft position (TTT step): lambda is computed from that position's alpha.
    """
    a = acceptance_rate(target_logits, draft_logits, d2t)
    lam = lk_lambda(a, mask, eta)
    kl = kl_div(target_probs_for_draft(target_logits, d2t), torch.log_softmax(draft_logits.float(), -1))
    return lam * masked_mean(kl, mask) + (1 - lam) * masked_mean(1 - a, mask)


def ttt_weights(steps: int, gamma: float = 0.8) -> torch.Tensor:
    """``[steps]`` weights gamma^k for draft positions k = 0..steps-1."""
    if not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps must be an integer >= 1, got {steps!r}")
    if not 0.0 < gamma <= 1.0:
        raise ValueError(f"gamma must be in (0, 1], got {gamma}")
    return gamma ** torch.arange(steps, dtype=torch.float32)


def multi_step_loss(step_losses: Sequence[torch.Tensor], gamma: float = 0.8) -> torch.Tensor:
    """sum_k gamma^k L_k over the test-time-training steps."""
    w = ttt_weights(len(step_losses), gamma)
    return sum(wk * lk for wk, lk in zip(w.tolist(), step_losses))


def talf_loss(target_logits: torch.Tensor, draft_logits: torch.Tensor, node_mask: torch.Tensor,
              d2t: Optional[torch.Tensor] = None) -> torch.Tensor:
    """TALF: cross-entropy between the target's and the draft's next-token distributions at every
    node of the target-built trees, ``[bs, n_nodes, V]`` x2 and ``[bs, n_nodes]`` bool -> mean."""
    p = target_probs_for_draft(target_logits, d2t)
    return masked_mean(soft_cross_entropy(p, torch.log_softmax(draft_logits.float(), -1)), node_mask)
