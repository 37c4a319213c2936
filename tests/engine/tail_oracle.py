"""Brute-force oracle for a batch's tail, shared by the batch-tail and budget-choice tests."""

import itertools


def walk_batch_ms(taus, bs, c1, cb):
    """Expected ms per token of each request: enumerate every ordered draw of ``bs`` taus (each prompt equally
    likely, with replacement); for one draw, walk time along r (rounds per token) and price each stretch by
    the rows still running, c(a) = c1 + (cb - c1)(a - 1)/(bs - 1); average over the draws."""
    def cost(a):
        return 0.0 if a == 0 else c1 + ((cb - c1) * (a - 1) / (bs - 1) if bs > 1 else 0.0)

    draws = list(itertools.product(taus, repeat=bs))
    total = 0.0
    for draw in draws:
        ends = sorted(1.0 / t for t in draw)
        t_prev, ms = 0.0, 0.0
        for i, end in enumerate(ends):
            ms += (end - t_prev) * cost(bs - i)  # rows i.. still running on [t_prev, end)
            t_prev = end
        total += ms
    return total / len(draws)
