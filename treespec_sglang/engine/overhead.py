"""The part of a round's time the cost curve does not see, measured by running real rounds.

The cost curve (:mod:`treespec_sglang.engine.cost`) prices a speculative round by its model forwards
alone, ``verify_ms(tree) + delta * draft_ms(width)``, and a plain step by ``verify_ms(1)``. A real round
also runs the draft extend over the tokens just accepted, the policy's own work (top-k, tree
bookkeeping), the verification walk, the KV commit, masks and Python; a plain step runs its own smaller
share. Left out, that work makes every plan optimistic, and more so for the policies that do more of it.

:func:`measure_overheads` runs a few real rounds of each policy (and plain steps) on a seeded
random prompt at the batch size being planned, times each round between two of the engine's
``progress`` callbacks, and keeps what the curve does not explain::

    round overhead(policy) = median round ms - (verify_ms(k * mean tree) + delta * draft_ms(k * width))
    step overhead          = median plain step ms - verify_ms(k)

with the run's own mean tree per request and draft forwards per round (``width``: the acceptance table's
mean frontier for that policy and budget) and ``k = CostCurve.scale(bs)``: 1 on a curve measured at the batch,
``bs`` on a bs-1 curve. :func:`~treespec_sglang.engine.cost.choose_budgets` prices forwards the same way and adds
these overheads to its round and plain-step prices. A random prompt accepts less than real text, so its
draft extend is shorter: the measured overhead is, if anything, slightly low. Each policy runs a few untimed
rounds first (warm-up). Takes about ``(len(specs) + 1) * rounds`` round times.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from typing import Dict, Optional, Sequence

import torch

from .cost import PREFIX

__all__ = ["Overheads", "measure_overheads", "round_times_ms"]


@dataclass(frozen=True)
class Overheads:
    """Measured ms per plain step (``step_ms``) and per round of each policy (``round_ms[policy]``) on top
    of the cost curve's forwards; ``bs`` is the batch size they were measured at."""

    step_ms: float = 0.0
    round_ms: Dict[str, float] = field(default_factory=dict)
    bs: int = 1

    def lines(self) -> str:
        per = ", ".join(f"{p} +{ms:.1f}" for p, ms in self.round_ms.items())
        return f"measured per-round overhead (ms beyond the curve's forwards, bs {self.bs}): plain +{self.step_ms:.1f}" \
               + (f", {per}" if per else "")


def round_times_ms(engine, prompts, spec, max_new_tokens: int):
    """Generate once and return ``(results, [ms of each verify round])``: the time between two consecutive
    ``progress`` callbacks. The engine calls it once for the prefill's token and once per round after, so
    the gaps are exactly the rounds (a plain step is a round of one token), prefill excluded."""
    stamps = []
    res = engine.generate(prompts, max_new_tokens=max_new_tokens, policy=spec,
                          progress=lambda n: stamps.append(time.perf_counter()))
    return res, [1e3 * (b - a) for a, b in zip(stamps, stamps[1:])]


def measure_overheads(engine, curve, specs: Sequence[dict], widths: Optional[Dict[str, float]] = None, bs: int = 1,
                      rounds: int = 12, prompt_len: int = PREFIX, seed: int = 0) -> Overheads:
    """Per policy of ``specs`` (policy dicts, one per policy name) and for plain decoding: the median ms per
    round beyond what ``curve`` prices (module docstring; the median, so one round the machine stalled does
    not move a dozen rounds' figure: a mean once read +48 ms for the chain from one such round).
    ``widths``: policy -> mean frontier per draft step (default 1). Each measurement generates ``rounds`` + 1
    tokens on ``bs`` seeded random prompts: the prefill's token, then at most ``rounds`` rounds (fewer where
    the draft is accepted), each one timed. The prompts are as long as the curve's context (``PREFIX``), so
    their forwards cost what the curve says: with 64-token prompts a bs-8 round ran faster than the curve's
    forwards and the overheads came out negative."""
    if bs < 1 or rounds < 1:
        raise ValueError(f"bs and rounds must be >= 1, got bs={bs}, rounds={rounds}")
    k = curve.scale(bs, f"price rounds of batch {bs}")
    g = torch.Generator().manual_seed(seed)
    vocab = engine.target.config.vocab_size
    prompts = torch.randint(0, vocab, (bs, prompt_len), generator=g).tolist()
    widths = widths or {}

    def mean(xs):
        return sum(xs) / len(xs) if xs else 0.0

    def median(xs):
        return statistics.median(xs) if xs else 0.0

    engine.generate(prompts[:1], max_new_tokens=2)  # warm-up
    _, plain = round_times_ms(engine, prompts, None, rounds + 1)
    step = median(plain) - curve.verify(k)
    out = {}
    for spec in specs:
        # warm-up at the batch: a policy's first rounds meet new shapes (oneDNN primitives) and first calls
        # (C2T's classifier); measured cold, they read +6.7 / +12.5 ms a round for salf / c2t at bs 1, warm +1
        engine.generate(prompts, max_new_tokens=3, policy=spec)
        res, ts = round_times_ms(engine, prompts, spec, rounds + 1)  # each round emits >= 1 token
        n = max(1, max(len(r.stats.tree_sizes) for r in res))
        tree = mean([s for r in res for s in r.stats.tree_sizes])  # verified tokens per round, per request
        delta = max(r.stats.draft_forwards for r in res) / n
        priced = curve.verify(k * tree) + delta * curve.draft(k * widths.get(spec["policy"], 1.0))
        out[spec["policy"]] = median(ts) - priced
    return Overheads(step, out, bs)
