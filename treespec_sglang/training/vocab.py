"""A reduced draft vocabulary from the distillation data (FR-Spec; SGLang ``--speculative-token-map``).

The draft scores only the ``size`` most frequent *answer* tokens of the training split (ties: more
frequent overall, then lower id), always including the target's EOS ids. Its LM head is those rows
of the target's head, so a draft step costs ``size / vocab`` of the full head (measurements.md:
8192 of 49152 rows is ~10x cheaper on CPU). Output is unchanged: verification reads only the
target; tokens outside the map simply are never drafted.
"""

from __future__ import annotations

from typing import Iterable, Sequence

import torch

__all__ = ["build_token_map", "coverage"]


def build_token_map(seqs: Sequence[tuple], size: int, vocab: int, always: Iterable[int] = ()) -> torch.Tensor:
    """``[size]`` int64 target ids, most frequent answer token first.

    ``seqs``: (tokens [T], hidden, loss_mask [T], ...) items. Example: answers [5, 5, 7, 2, 7, 5], size 2,
    always [9] -> [9, 5] (EOS first, then 5: three times).
    """
    if not isinstance(size, int) or not 1 <= size <= vocab:
        raise ValueError(f"size must be an integer in [1, {vocab}], got {size!r}")
    ans = torch.zeros(vocab, dtype=torch.float64)
    tot = torch.zeros(vocab, dtype=torch.float64)
    for s in seqs:
        tok, mask = s[0].long(), s[2].bool()
        ans += torch.bincount(tok[mask], minlength=vocab).double()
        tot += torch.bincount(tok, minlength=vocab).double()
    score = ans * (tot.max() + 1) + tot  # answer count first, overall count breaks ties
    for t in always:
        score[int(t)] = float("inf")
    order = torch.sort(score, descending=True, stable=True).indices  # stable: lower id wins exact ties
    return order[:size].clone()


def coverage(seqs: Sequence[tuple], token_map: torch.Tensor) -> float:
    """Fraction of answer tokens of ``seqs`` inside ``token_map`` (an upper bound on what the draft can hit)."""
    hit = tot = 0
    for s in seqs:
        a = s[0].long()[s[2].bool()]
        hit += int(torch.isin(a, token_map).sum())
        tot += a.numel()
    return hit / max(tot, 1)
