"""The machine's cost curve and per-policy budgets chosen from it.

:func:`measure_cost_curve` times, on the engine as loaded (dtype, threads), one verify forward of
``n`` tree tokens over a ``prefix``-token cache plus the target LM head on those rows, and one draft
step at width ``w`` (draft layer + its LM head + log_softmax). It takes a few seconds and is cached
on disk per machine / torch / dtype / model / threads.

:func:`choose_budgets` combines that curve with a draft's *acceptance table* (tau and draft
forwards per round for each policy at each budget, measured once offline on training-split prompts
by ``bench/policy_table.py`` and shipped beside the draft as ``policy_table.json``) and picks, per
policy, the budget with the highest expected tokens/s::

    tokens/s(N) = tau(N) / (verify_ms(tree(N)) + delta(N) * draft_ms(width) + overhead_ms)

Acceptance is a property of the draft and the policy; cost is a property of the machine: that
split is what lets one shipped table serve every machine.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import statistics
import time
from dataclasses import dataclass
from typing import Dict, Optional, Sequence, Tuple

import torch

from .kv_cache import KVCache

__all__ = ["CostCurve", "measure_cost_curve", "choose_budgets", "BudgetChoice", "load_policy_table", "POLICY_TABLE",
           "RoundCost"]

POLICY_TABLE = "policy_table.json"


@dataclass(frozen=True)
class CostCurve:
    """Measured milliseconds: ``verify_ms[i]`` for ``sizes[i]`` tree tokens (bs 1), ``draft_ms[j]`` for
    one draft step at ``widths[j]`` frontier nodes."""

    sizes: Tuple[int, ...]
    verify_ms: Tuple[float, ...]
    widths: Tuple[int, ...]
    draft_ms: Tuple[float, ...]

    def __post_init__(self):
        for xs, ys, name in ((self.sizes, self.verify_ms, "sizes"), (self.widths, self.draft_ms, "widths")):
            if len(xs) < 1 or len(xs) != len(ys) or list(xs) != sorted(set(xs)) or xs[0] < 1:
                raise ValueError(f"CostCurve.{name} must be increasing positive integers, one time each")

    @staticmethod
    def _interp(xs, ys, x: float) -> float:
        if x <= xs[0]:
            return ys[0]
        for (x0, y0), (x1, y1) in zip(zip(xs, ys), zip(xs[1:], ys[1:])):
            if x <= x1:
                return y0 + (y1 - y0) * (x - x0) / (x1 - x0)
        return ys[-1] + (ys[-1] - ys[-2]) * (x - xs[-1]) / (xs[-1] - xs[-2]) if len(xs) > 1 else ys[-1]

    def verify(self, n: float) -> float:
        """Interpolated (linearly extrapolated past the last size) ms for ``n`` verified tokens."""
        return self._interp(self.sizes, self.verify_ms, n)

    def draft(self, w: float) -> float:
        return self._interp(self.widths, self.draft_ms, w)


def _median_ms(fn, repeats: int) -> float:
    fn()  # warm-up (allocator, oneDNN primitive cache)
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        ts.append(1e3 * (time.perf_counter() - t0))
    return statistics.median(ts)


@torch.inference_mode()
def _measure(engine, sizes, widths, prefix: int, repeats: int) -> CostCurve:
    tcfg, dcfg, dev = engine.target.config, engine.draft.config, engine.device
    top = max(sizes)
    cache = KVCache(tcfg.num_hidden_layers, 1, tcfg.num_key_value_heads, prefix + top, tcfg.head_dim, engine.dtype, dev)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, tcfg.vocab_size, (1, prefix + top), generator=g).to(dev)
    pos = torch.arange(prefix, device=dev)[None]
    engine.target(ids[:, :prefix], pos, cache.stores(pos, prefix),
                  torch.ones(prefix, prefix, dtype=torch.bool, device=dev).tril()[None])

    def verify(n):
        p = prefix + torch.arange(n, device=dev)[None]
        mask = torch.ones(n, prefix + n, dtype=torch.bool, device=dev).tril(prefix)[None]
        return lambda: engine._logits(engine.target(ids[:, prefix:prefix + n], p, cache.stores(p, prefix + n), mask))

    dcache = KVCache(1, 1, dcfg.num_key_value_heads, prefix + 1 + max(widths), dcfg.head_dim, engine.dtype, dev)

    def draft(w):
        p = prefix + torch.arange(w, device=dev)[None]
        mask = torch.ones(w, prefix + w, dtype=torch.bool, device=dev)[None]
        feats = torch.zeros(1, w, dcfg.hidden_size, dtype=engine.dtype, device=dev)
        return lambda: engine._draft_logprobs(engine.draft(ids[:, :w], feats, p, dcache.stores(p, prefix + w)[0], mask))

    return CostCurve(tuple(sizes), tuple(_median_ms(verify(n), repeats) for n in sizes),
                     tuple(widths), tuple(_median_ms(draft(w), repeats) for w in widths))


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), platform.processor())
    except OSError:
        return platform.processor()


def measure_cost_curve(engine, sizes: Sequence[int] = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64),
                       widths: Sequence[int] = (1, 2, 4, 8, 16), prefix: int = 256, repeats: int = 5,
                       cache_dir: Optional[str] = None, model_id: str = "") -> Tuple[CostCurve, bool]:
    """-> (curve, whether it came from the cache). ``cache_dir`` None: measure, store nothing."""
    key = json.dumps([_cpu_name(), torch.__version__, str(engine.dtype), str(engine.device), torch.get_num_threads(),
                      model_id, engine.target.config.hidden_size, engine.target.config.num_hidden_layers,
                      engine.draft_vocab, type(engine.draft).__name__, list(sizes), list(widths), prefix])
    path = None
    if cache_dir is not None:
        path = os.path.join(cache_dir, f"cost-{hashlib.sha1(key.encode()).hexdigest()[:16]}.json")
        if os.path.isfile(path):
            with open(path) as f:
                d = json.load(f)
            return CostCurve(**{k: tuple(v) for k, v in d["curve"].items()}), True
    curve = _measure(engine, sizes, widths, prefix, repeats)
    if path is not None:
        with open(path + ".tmp", "w") as f:
            json.dump({"key": key, "curve": {k: list(getattr(curve, k)) for k in
                                            ("sizes", "verify_ms", "widths", "draft_ms")}}, f)
        os.replace(path + ".tmp", path)
    return curve, False


def load_policy_table(draft_dir: Optional[str]) -> Optional[dict]:
    """``{policy: {budget: {"tau", "delta", "tree", "width"}}}`` from ``<draft_dir>/policy_table.json``."""
    if not draft_dir:
        return None
    path = os.path.join(draft_dir, POLICY_TABLE)
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        return json.load(f)["table"]


@dataclass(frozen=True)
class BudgetChoice:
    policy: str
    budget: int
    tau: float
    round_ms: float
    speedup: float  # expected tokens/s over plain decoding on this curve


def choose_budgets(table: Dict[str, Dict[str, dict]], curve: CostCurve, overhead_ms: float = 0.0,
                   bs: int = 1) -> Dict[str, BudgetChoice]:
    """Per policy, the budget with the highest expected tokens/s (module docstring's formula).

    ``bs`` > 1 approximates a batch's round by the bs-1 curve at ``bs`` times the tokens (one forward
    verifies every request's tree; the draft steps run at ``bs`` times the width), which is why the
    best budget shrinks as the batch grows on a compute-bound CPU.

    ``table[policy][str(budget)]`` holds ``tau`` (tokens per round), ``delta`` (draft forwards per
    round), ``tree`` (mean verified tokens per round) and ``width`` (mean frontier per draft step).

    Example: with verify 40 ms at 1 token and 48 ms at 8, draft 2 ms, tau(4) = 2.0 with delta 2 and
    tau(8) = 2.4 with delta 3, budget 8 wins: 2.4 / (48 + 6) > 2.0 / (44 + 4).
    """
    if bs < 1:
        raise ValueError(f"bs must be >= 1, got {bs}")
    plain = curve.verify(bs) + overhead_ms
    out = {}
    for policy, rows in table.items():
        best = None
        for budget, r in rows.items():
            ms = curve.verify(bs * r["tree"]) + r["delta"] * curve.draft(bs * r.get("width", 1)) + overhead_ms
            c = BudgetChoice(policy, int(budget), r["tau"], ms, (r["tau"] / ms) * plain)
            if best is None or c.speedup > best.speedup:
                best = c
        if best is not None:
            out[policy] = best
    return out


class RoundCost:
    """A round's wall time in the tokens it verifies and the draft forwards it ran,
    ``ms = level + slope * T + step * (D - mean D)``, learned online from the rounds themselves
    (T per round from the running machine's cost).

    Why online: a batch round costs what this batch costs. The bs-1 start-up curve prices one more
    verified token at ~1-2 ms, while a bs-8 / bs-32 round pays ~0.3-0.7 ms for it on top of attention over
    the prefixes, drafting and Python that no bs-1 profile sees. Why the draft term: with draft pruning a
    confident batch runs more draft steps *and* verifies more tokens, so a fit on T alone charges the
    draft steps to the tokens (measured: the slope drifted from 2 to 5-6 ms per token at bs 32 and the
    budget starved itself). The start-up curve gives the priors (``slope``, ``step``); each round adds
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
        exceeds its parent's): the draft-pruning threshold of ``verify_budget="auto"``.

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
