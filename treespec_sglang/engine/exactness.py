"""Lossless in bf16: where a speculative output differs from plain decoding, was it a near-tie?

In float32 our speculative greedy output equals plain greedy token for token (attention still rounds a
query by the batch's shape, by some 1e-5 logits: a float32 near-tie inside that would show as a divergence, and
the verdict stays strict there). In bf16 a tree
forward (many query tokens) and a one-token forward round differently, so the target's argmax can
flip where its top two logits are within bf16 rounding (measured on the demo target: max
logit difference 0.875 between the two paths, disagreements at margins below 0.5). The check this
module implements: at the first position where two greedy outputs of the same prompt differ, the
target's logits for the two tokens (one prefill forward over the common prefix) must be within
:data:`TIE_BOUND`; anything wider is a real bug and is reported as such.
"""

from __future__ import annotations

from typing import List, Optional, Sequence

import torch

from .kv_cache import prefill

__all__ = ["TIE_BOUND", "first_divergence", "divergence_margin", "compare_outputs"]

TIE_BOUND = 1.0  # logits; bf16 rounding through 30 layers moved logits by up to 0.875 (measured)


def first_divergence(a: Sequence[int], b: Sequence[int]) -> Optional[int]:
    """First index where ``a`` and ``b`` differ (None when one is a prefix of the other).

    >>> first_divergence([1, 2, 3], [1, 2, 4]), first_divergence([1, 2], [1, 2, 5])
    (2, None)
    """
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None


@torch.inference_mode()
def divergence_margin(engine, prompt: Sequence[int], ref: Sequence[int], other: Sequence[int]) -> Optional[float]:
    """|logit(ref[i]) - logit(other[i])| of the target after ``prompt + ref[:i]``, i = the first
    divergence; None when the outputs agree."""
    i = first_divergence(ref, other)
    if i is None:
        return None
    seq = list(prompt) + list(ref[:i])
    _, _, hidden, _ = prefill(engine.target, [seq], len(seq))
    logits = engine.calls.logits(hidden[0, -1])  # [vocab] float32
    return float((logits[ref[i]] - logits[other[i]]).abs())


def compare_outputs(engine, prompts: Sequence[Sequence[int]], ref: Sequence[Sequence[int]],
                    outs: Sequence[Sequence[int]]) -> dict:
    """Per-run verdict: ``same`` (identical outputs), ``diverged`` (how many differ), ``max_margin``
    (largest first-divergence margin) and ``ok`` (every divergence within :data:`TIE_BOUND`)."""
    margins: List[float] = []
    for p, r, o in zip(prompts, ref, outs):
        m = divergence_margin(engine, p, r, o)
        if m is not None:
            margins.append(m)
    return {"same": not margins and all(len(r) == len(o) for r, o in zip(ref, outs)), "diverged": len(margins),
            "max_margin": max(margins, default=0.0), "ok": all(m <= TIE_BOUND for m in margins)}
