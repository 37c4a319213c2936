"""Chain verification with real draft probabilities (Leviathan et al.; LK App. D).

Draft token x_i ~ q_i is accepted with probability min(1, p_i(x_i) / q_i(x_i)); at the first
rejection the correction token is drawn from norm(max(0, p_i - q_i)); if all are accepted the
bonus is drawn from p_L. This needs the distribution q the draft actually sampled from.
"""

from __future__ import annotations

from typing import Optional

import torch

from .sampling import Num, sample_probs, target_probs, uniform
from .tree import VerifyResult

__all__ = ["verify_chain"]


def verify_chain(draft_tokens: torch.Tensor, draft_probs: torch.Tensor, target_logits: torch.Tensor, *,
                 lengths: Optional[torch.Tensor] = None, temperature: Num = 1.0, top_k: Num = -1,
                 top_p: Num = 1.0, generator: Optional[torch.Generator] = None) -> VerifyResult:
    """Verify sampled draft chains.

    Parameters
    ----------
    draft_tokens : ``[bs, depth]`` int64, x_i ~ q_i.
    draft_probs : ``[bs, depth, vocab]`` float, q_i (the distributions the tokens were drawn from).
    target_logits : ``[bs, depth + 1, vocab]``; row i follows the first i draft tokens.
    lengths : ``[bs]`` int64, optional; per-request chain length (<= depth), e.g. after early stop.
    temperature, top_k, top_p : as :func:`target_probs` (T = 0 makes p one-hot).

    Returns
    -------
    VerifyResult
        ``path`` holds chain node indices (node i = draft token i - 1, root 0).

    Examples
    --------
    >>> q = torch.full((1, 1, 3), 1 / 3); logits = torch.zeros(1, 2, 3)
    >>> r = verify_chain(torch.tensor([[2]]), q, logits)  # p == q: always accepted
    >>> r.num_accepted.tolist()
    [1]
    """
    bs, L = draft_tokens.shape
    if draft_probs.shape[:2] != (bs, L) or target_logits.shape[:2] != (bs, L + 1):
        raise ValueError(f"draft_probs must be [{bs}, {L}, vocab] and target_logits [{bs}, {L + 1}, vocab], "
                         f"got {tuple(draft_probs.shape)} and {tuple(target_logits.shape)}")
    dev = draft_tokens.device
    p = target_probs(target_logits, temperature, top_k, top_p)  # [bs, depth + 1, vocab]
    q = draft_probs.float()
    ar = torch.arange(L, device=dev)
    lengths = torch.full((bs,), L, dtype=torch.int64, device=dev) if lengths is None else lengths.long()
    tok = draft_tokens.clamp(min=0)[:, :, None]
    px = torch.gather(p[:, :L], 2, tok)[:, :, 0]
    qx = torch.gather(q, 2, tok)[:, :, 0]
    coins = uniform((bs, L + 1), dev, generator)
    # accept iff u < p/q  <=>  u * q < p (no division; q(x) > 0 for a drawn token)
    ok = (coins[:, :L] * qx < px) & (ar[None, :] < lengths[:, None])
    n_acc = ok.long().cumprod(-1).sum(-1)  # leading accepts
    # correction / bonus distribution at position n_acc
    p_n = torch.gather(p, 1, n_acc[:, None, None].expand(bs, 1, p.shape[-1]))[:, 0]
    q_n = torch.gather(q, 1, n_acc.clamp(max=L - 1)[:, None, None].expand(bs, 1, q.shape[-1]))[:, 0] if L else p_n
    rejected = n_acc < lengths
    resid = torch.where(rejected[:, None], (p_n - q_n).clamp(min=0), p_n)
    resid = torch.where(resid.sum(-1, keepdim=True) > 0, resid, p_n)
    bonus = sample_probs(resid, u=coins[:, L])
    path = torch.where(ar[None, :] < n_acc[:, None], ar[None, :] + 1, -1)
    path = torch.cat([torch.zeros(bs, 1, dtype=torch.int64, device=dev), path], dim=1)
    return VerifyResult(path, n_acc, bonus)
