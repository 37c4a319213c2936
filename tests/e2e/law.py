"""The exact-law test of sampled tokens at T > 0, shared by the single- and multi-rank end-to-end tests:
the first two tokens' joint law from the float32 target (fixture ``sample_law`` in ``conftest.py``), a
Pearson chi-square test over it and a z test of the second token's temperature."""

import math
from collections import Counter

import torch

SAMPLE_PROMPT = "Name one animal."
DRAWS = 1200
Z = 3.719  # one-sided normal quantile at 1e-4


def chi2_threshold(df: int) -> float:
    """Upper 1e-4 quantile of chi-square(df), Wilson-Hilferty approximation."""
    a = 2.0 / (9 * df)
    return df * (1 - a + Z * math.sqrt(a)) ** 3


Z2 = 3.891  # two-sided normal quantile at 1e-4


def temperature_z(samples, cond) -> float:
    """z of the second token's target log-prob, given the first: the sum over draws (first token among
    ``cond``) of ``log p(t2 | t1) - E[log p | t1]`` over its standard deviation under T = 1. A verify that
    samples at T' < 1 picks likelier tokens (z > 0), T' > 1 less likely ones (z < 0)."""
    num = var = 0.0
    for t1, t2 in samples:
        if t1 in cond:
            lp = cond[t1]
            mean = float((lp.exp() * lp).sum())
            num += float(lp[t2]) - mean
            var += float((lp.exp() * lp * lp).sum()) - mean * mean
    return num / math.sqrt(var)


def temperature_power(cond, p1, wrong_t: float, draws: int) -> float:
    """Probability that :func:`temperature_z` rejects (|z| > Z2) when the second token is drawn at
    ``wrong_t``: the expected shift of z for ``draws`` draws against its unit standard deviation."""
    covered = sum(p1.values())
    shift = var = 0.0
    for t1, lp in cond.items():
        w = p1[t1] / covered
        p, q = lp.exp(), torch.softmax(lp / wrong_t, -1)  # T = 1, T = wrong_t
        mean = float((p * lp).sum())
        shift += w * (float((q * lp).sum()) - mean)
        var += w * (float((p * lp * lp).sum()) - mean * mean)
    n = draws * covered
    z = abs(n * shift / math.sqrt(n * var))
    return 0.5 * (1 + math.erf((z - Z2) / math.sqrt(2)))


def chi2_stat(samples, law):
    """Pearson statistic over the pairs expected >= 5 times plus one bin for everything else."""
    n = len(samples)
    bins = [k for k, p in law.items() if n * p >= 5]
    counts = Counter(s if s in bins else "other" for s in samples)
    p_other = 1 - sum(law[k] for k in bins)
    stat = sum((counts.get(k, 0) - n * law[k]) ** 2 / (n * law[k]) for k in bins)
    stat += (counts.get("other", 0) - n * p_other) ** 2 / (n * p_other)
    return stat, len(bins)


def draw_pairs(host, ids, temperature, custom=None):
    sp = {"max_new_tokens": 2, "temperature": temperature, "ignore_eos": True}
    if custom:
        sp["custom_params"] = {"treespec": custom}
    outs = host.generate(input_ids=[ids] * DRAWS, sampling_params=[sp] * DRAWS)
    return [tuple(o["output_ids"][:2]) for o in outs]


def top_k_law(p1, cond, temperature: float, top_k: int):
    """The exact law of the first two tokens under ``temperature`` and ``top_k`` (no top-p: SGLang's plain
    sampler and its speculative verify agree on top-k alone), from the T = 1 law (``sample_law``): each step keeps
    its ``top_k`` likeliest tokens, weighted ``p ** (1 / T)`` and renormalised. ``{(t1, t2): p}``."""
    def step(probs: dict) -> dict:
        top = sorted(probs, key=probs.get, reverse=True)[:top_k]
        w = {t: probs[t] ** (1.0 / temperature) for t in top}
        z = sum(w.values())
        return {t: v / z for t, v in w.items()}

    first = step(p1)
    law = {}
    for t1, q1 in first.items():
        lp = cond[t1]
        second = step({int(t): float(lp[t].exp()) for t in lp.topk(top_k + 8).indices})
        law.update({(t1, t2): q1 * q2 for t2, q2 in second.items()})
    return law


def chi2_power(law, wrong, draws: int, df: int) -> float:
    """Normal approximation of the probability that :func:`chi2_stat` (``df`` bins) rejects ``law`` at level 1e-4
    when the draws follow ``wrong``: noncentrality ``n * sum (q - p)^2 / p`` over ``law``'s pairs."""
    lam = draws * sum((wrong.get(k, 0.0) - p) ** 2 / p for k, p in law.items())
    mean, sd = df + lam, math.sqrt(2 * (df + 2 * lam))
    return 0.5 * (1 + math.erf((mean - chi2_threshold(df)) / (sd * math.sqrt(2))))
