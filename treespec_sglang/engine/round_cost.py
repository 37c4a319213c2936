"""``RoundCost``: the online fit of a running call's round time (``token_cap="auto"``), its prior from the
start-up cost curve of :mod:`treespec_sglang.engine.cost`."""

from __future__ import annotations

import torch

from .cost import CostCurve

__all__ = ["RoundCost"]


class RoundCost:
    """A round's wall time in the tokens it verifies and the draft forwards it ran,
    ``ms = level + slope * T + step * (D - mean D)``, learned online from the rounds themselves
    (T per round from the running machine's cost).

    Why online: a batch round costs what this batch costs. The bs-1 start-up curve prices one more
    verified token at ~1-2 ms, while a bs-8 / bs-32 round pays ~0.3-0.7 ms for it on top of attention over
    the prefixes, drafting and Python that no bs-1 profile sees. Why the draft term: with draft pruning a
    confident batch runs more draft steps *and* verifies more tokens, so a fit on T alone charges the
    draft steps to the tokens (measured: the slope drifted from 2 to 5-6 ms per token at bs 32 and the
    token cap starved itself). The start-up curve gives the priors (``slope``, ``step``); each round adds
    ``(T, D, ms)``; a weighted ridge fit with exponential forgetting (``decay`` per round) and ``strength``
    pseudo-observations of each prior gives the plane; every few rounds :meth:`probe` scales the chosen T
    so that the fit sees a spread of T (losslessness does not depend on T). When the batch shrinks (a
    request finished) the level jumps, so the sums restart with the current slopes as the new priors.
    Host-side floats: one update per round, after its host read.

    >>> rc = RoundCost(prior_slope=1.0, prior_level=50.0)
    >>> for t, ms in [(16, 66.0), (32, 82.0), (24, 74.0)] * 3: rc.observe(t, ms, bs=8)
    >>> round(rc.slope, 2), round(rc.level, 1)
    (1.0, 50.0)
    """

    PROBES = (1.0, 1.0, 1.0, 1.5, 1.0, 1.0, 1.0, 0.67)

    def __init__(self, prior_slope: float, prior_level: float, strength: float = 32.0, decay: float = 0.93,
                 probes=PROBES, prior_step: float = 0.0):
        if not (prior_slope >= 0 and prior_level >= 0 and prior_step >= 0 and strength > 0 and 0 < decay <= 1):
            raise ValueError("RoundCost: prior_slope, prior_level, prior_step >= 0, strength > 0 and decay in (0, 1] "
                             "required")
        if not probes or any(not f > 0 for f in probes):
            raise ValueError(f"RoundCost.probes must be positive factors, got {probes!r}")
        self.prior, self.level0, self.strength, self.decay = float(prior_slope), float(prior_level), strength, decay
        self.prior_step = float(prior_step)
        self.probes = tuple(float(f) for f in probes)
        self.bs = None
        self.rounds = 0
        self._sums = [0.0] * 9  # decayed W, sum T, D, ms, T^2, D^2, T*D, T*ms, D*ms
        self._rate = [0.0, 0.0]  # decayed committed tokens, ms

    @classmethod
    def from_curve(cls, curve: CostCurve, **kw) -> "RoundCost":
        """Priors from the start-up curve: slope between 16 and 64 verified tokens, one draft forward at
        width four, and a level of 16 tokens plus four such draft forwards."""
        return cls(prior_slope=max((curve.verify(64) - curve.verify(16)) / 48, 0.0),
                   prior_level=curve.verify(16) + 4 * curve.draft(4), prior_step=curve.draft(4), **kw)

    def _fit(self):
        """(slope, step, mean T, mean ms) of the ridge fit; the priors before any round."""
        w, st, sd, sy, stt, sdd, std, sty, sdy = self._sums
        if w <= 0:
            return self.prior, self.prior_step, 0.0, 0.0
        ctt, cdd, ctd = stt - st * st / w, sdd - sd * sd / w, std - st * sd / w  # centred (co)variances
        cty, cdy = sty - st * sy / w, sdy - sd * sy / w
        lam, lam_d = self.strength, self.strength / 64  # a draft step spreads ~8x less than T: same pull per unit
        a, b, d = ctt + lam, ctd, cdd + lam_d
        r1, r2 = cty + lam * self.prior, cdy + lam_d * self.prior_step
        det = a * d - b * b
        slope, step = (d * r1 - b * r2) / det, (a * r2 - b * r1) / det
        return max(slope, 0.0), max(step, 0.0), st / w, sy / w

    @property
    def slope(self) -> float:
        """ms per verified token."""
        return self._fit()[0]

    @property
    def step(self) -> float:
        """ms per draft forward."""
        return self._fit()[1]

    @property
    def level(self) -> float:
        """ms of a round verifying no token at the rounds' mean number of draft forwards."""
        slope, _, mt, my = self._fit()
        return self.level0 if self._sums[0] <= 0 else max(my - slope * mt, 0.0)

    def observe(self, verified: int, ms: float, bs: int, committed: int = 0, steps: int = 0) -> None:
        """One round: ``verified`` tokens (the whole batch's, roots included) and ``steps`` draft forwards
        took ``ms``; ``bs`` requests committed ``committed`` tokens (for :meth:`marginal_value`)."""
        if self.bs is not None and bs != self.bs:  # the level moves with the batch: refit it, keep the slopes
            self.prior, self.prior_step = self.slope, self.step
            self._sums, self._rate = [0.0] * 9, [0.0, 0.0]
        self.bs = bs
        self.rounds += 1
        t, dd = float(verified), float(steps)
        self._sums = [self.decay * x for x in self._sums]
        for i, v in enumerate((1.0, t, dd, ms, t * t, dd * dd, t * dd, t * ms, dd * ms)):
            self._sums[i] += v
        self._rate = [self.decay * self._rate[0] + committed, self.decay * self._rate[1] + ms]

    def marginal_value(self) -> float:
        """Expected tokens a verified node must bring to pay for itself: the recent rounds' tokens per ms
        times the fit's ms per verified token (0 before any round). A node whose path probability is
        below it lowers tokens/s, and so does every node under it (a child's path probability never
        exceeds its parent's): the draft-pruning threshold of ``token_cap="auto"``.

        >>> rc = RoundCost(prior_slope=2.0, prior_level=50.0)
        >>> rc.observe(16, 80.0, bs=8, committed=16); round(rc.marginal_value(), 2)
        0.4
        """
        tokens, ms = self._rate
        return self.slope * tokens / ms if ms > 0 else 0.0

    def probe(self) -> float:
        """The factor on this round's chosen T: the schedule's 1.5x / 0.67x rounds spread the observed T,
        without which the slope could never move off its prior (the chosen T barely varies)."""
        return self.probes[self.rounds % len(self.probes)]

    def costs(self, t_max: int) -> "torch.Tensor":
        """``[t_max + 1]`` float32 ms of a round verifying T = 0..t_max tokens (what ``best_total`` reads)."""
        return self.level + self.slope * torch.arange(t_max + 1, dtype=torch.float32)
