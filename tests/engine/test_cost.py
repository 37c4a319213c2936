"""Cost curve (interpolation, cache) and per-policy budget choice against the formula by brute force."""

import random
import time

import pytest
import torch

from tests.models.tiny import make_tiny_llama
from treespec_sglang.engine import SpecEngine
from treespec_sglang.engine.cost import CostCurve, choose_budgets, measure_cost_curve
from treespec_sglang.engine.round_cost import RoundCost


def curve():
    return CostCurve((1, 4, 8, 16), (40.0, 42.0, 48.0, 60.0), (1, 4), (2.0, 3.0))


def test_interpolation_and_extrapolation():
    c = curve()
    assert c.verify(1) == 40 and c.verify(6) == 45 and c.verify(12) == 54 and c.verify(20) == 66
    assert c.verify(0.5) == 40 and c.draft(2) == pytest.approx(2 + 1 / 3)


@pytest.mark.parametrize("bad", [dict(sizes=(4, 1), verify_ms=(1.0, 2.0)), dict(sizes=(1, 2), verify_ms=(1.0,)),
                                 dict(sizes=(0, 2), verify_ms=(1.0, 2.0)), dict(sizes=(), verify_ms=())])
def test_bad_curves_are_refused(bad):
    with pytest.raises(ValueError, match="CostCurve.sizes"):
        CostCurve(widths=(1,), draft_ms=(1.0,), **bad)


def test_docstring_example():
    c = CostCurve((1, 4, 8), (40.0, 44.0, 48.0), (1,), (2.0,))
    table = {"p": {"4": dict(tau=2.0, delta=2, tree=4, width=1), "8": dict(tau=2.4, delta=3, tree=8, width=1)}}
    assert choose_budgets(table, c)["p"].budget == 8


@pytest.mark.parametrize("seed", range(5))
def test_choice_maximises_expected_tokens_per_second(seed):
    g = torch.Generator().manual_seed(seed)
    table = {}
    for pol in ("a", "b", "c"):
        table[pol] = {str(n): dict(tau=1 + float(torch.rand((), generator=g)) * n ** 0.5,
                                   delta=float(torch.randint(1, 6, (), generator=g)), tree=n * 0.9,
                                   width=int(torch.randint(1, 5, (), generator=g))) for n in (2, 4, 8, 16, 24)}
    c = curve()
    picks = choose_budgets(table, c, overhead_ms=1.5)
    for pol, rows in table.items():
        rate = {int(n): r["tau"] / (c.verify(r["tree"]) + r["delta"] * c.draft(r["width"]) + 1.5) for n, r in rows.items()}
        best = max(rate, key=rate.get)
        assert picks[pol].budget == best
        assert picks[pol].speedup == pytest.approx(rate[best] * (c.verify(1) + 1.5))


class Slowed:
    """A model stand-in that records the tokens of every forward and sleeps ``ms_per_token`` per token
    before running the real one: a verify curve whose shape the test knows."""

    def __init__(self, inner, ms_per_token):
        self.inner, self.ms_per_token, self.tokens = inner, ms_per_token, []

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def __call__(self, ids, *args, **kwargs):
        self.tokens.append(ids.shape[1])  # ids [1, tokens]
        time.sleep(self.ms_per_token * ids.shape[1] / 1e3)
        return self.inner(ids, *args, **kwargs)


def test_measured_curve_is_cached_per_key(tmp_path):
    make_tiny_llama(tmp_path / "m", vocab=40, hidden=32, layers=2, heads=4, kv_heads=2)
    e = SpecEngine.from_pretrained(str(tmp_path / "m"), draft=None, dtype="float32")
    e.target, e.draft = Slowed(e.target, 4.0), Slowed(e.draft, 4.0)
    c1, cached1 = measure_cost_curve(e, sizes=(1, 4, 8), widths=(1, 2), prefix=16, repeats=2, cache_dir=str(tmp_path))
    # the prefix prefill, then each size / width once to warm up and `repeats` times timed
    assert e.target.tokens == [16] + [1] * 3 + [4] * 3 + [8] * 3 and e.draft.tokens == [1] * 3 + [2] * 3
    c2, cached2 = measure_cost_curve(e, sizes=(1, 4, 8), widths=(1, 2), prefix=16, repeats=2, cache_dir=str(tmp_path))
    assert len(e.target.tokens) == 10  # read from the cache: nothing ran
    c3, cached3 = measure_cost_curve(e, sizes=(1, 2), widths=(1,), prefix=16, repeats=2, cache_dir=str(tmp_path))
    assert (cached1, cached2, cached3) == (False, True, False) and c1 == c2 and c3.sizes == (1, 2)
    # each entry at least its forward's sleep: 4 ms per token it verified / drafted
    assert all(ms >= 4.0 * n for ms, n in zip(c1.verify_ms, c1.sizes)), c1.verify_ms
    assert all(ms >= 4.0 * w for ms, w in zip(c1.draft_ms, c1.widths)), c1.draft_ms


def test_larger_batches_pick_smaller_or_equal_budgets():
    """A steep curve (compute-bound): the batch multiplies verified tokens, so budgets shrink."""
    c = CostCurve((1, 8, 16, 32, 64, 128), (40.0, 46.0, 60.0, 90.0, 150.0, 270.0), (1, 4, 16, 64), (2.0, 2.5, 4.0, 9.0))
    table = {"p": {str(n): dict(tau=1 + 0.6 * n ** 0.5, delta=3, tree=n, width=4) for n in (2, 4, 8, 16)}}
    picks = [choose_budgets(table, c, bs=bs)["p"].budget for bs in (1, 4, 8)]
    assert picks == sorted(picks, reverse=True) and picks[0] > picks[-1], picks
    with pytest.raises(ValueError, match="bs must be"):
        choose_budgets(table, c, bs=0)


@pytest.mark.parametrize("slope,level", [(0.3, 100.0), (1.5, 20.0), (0.0, 60.0)])
def test_round_cost_learns_the_line_from_probed_rounds(slope, level):
    """RoundCost recovers a round's ms = level + slope * T from noisy rounds whose T spread comes from its
    own probe schedule, starting from a wrong prior (the bs-1 curve's slope)."""
    import random

    from treespec_sglang.engine.round_cost import RoundCost

    rng = random.Random(0)
    rc = RoundCost(prior_slope=1.2, prior_level=10.0)
    for _ in range(60):
        t = round(32 * rc.probe())
        rc.observe(t, level + slope * t + rng.gauss(0, 1.0), bs=8)
    assert rc.slope == pytest.approx(slope, abs=0.15) and rc.level == pytest.approx(level, rel=0.1, abs=3.0)
    ms = rc.costs(64)
    assert ms.shape == (65,) and float(ms[32]) == pytest.approx(rc.level + 32 * rc.slope, rel=1e-5)


def test_round_cost_separates_draft_steps_from_verified_tokens():
    """Rounds whose draft steps grow with the tokens they verify (draft pruning: a confident batch drafts
    deeper and verifies more): the fit charges each to its own term; a fit on T alone would put the draft
    steps' time on the tokens (the slope measured 4-6 ms per token at bs 32 against a real ~0.5)."""
    import random

    from treespec_sglang.engine.round_cost import RoundCost

    rng = random.Random(3)
    rc = RoundCost(prior_slope=1.0, prior_level=50.0, prior_step=1.0)
    naive = RoundCost(prior_slope=1.0, prior_level=50.0)  # steps never reported: the old single-variable line
    for _ in range(80):
        d = rng.randint(1, 5)
        t = round((32 + 8 * d + rng.randint(-4, 4)) * rc.probe())
        ms = 100 + 0.5 * t + 6.0 * d + rng.gauss(0, 1.0)
        rc.observe(t, ms, bs=32, committed=40, steps=d)
        naive.observe(t, ms, bs=32, committed=40)
    assert rc.slope == pytest.approx(0.5, abs=0.1) and rc.step == pytest.approx(6.0, abs=1.0)
    assert naive.slope > 0.8  # confounded
    tokens, ms = rc._rate  # decayed sums: 40 tokens per round over the rounds' ms
    assert rc.marginal_value() == pytest.approx(rc.slope * tokens / ms, rel=1e-9) and 0 < rc.marginal_value() < 0.5


def test_round_cost_keeps_its_slope_and_refits_the_level_when_the_batch_shrinks():
    from treespec_sglang.engine.round_cost import RoundCost

    rc = RoundCost(prior_slope=1.0, prior_level=0.0, strength=1.0)
    for t in (16, 24, 32, 40) * 4:
        rc.observe(t, 100 + 0.5 * t, bs=8)
    s = rc.slope
    rc.observe(20, 40 + 0.5 * 20, bs=4)  # a request finished: a new level, the slope carried over as the prior
    assert rc.bs == 4 and rc.slope == pytest.approx(s, abs=1e-6) and rc.level == pytest.approx(40, abs=0.5)
    with pytest.raises(ValueError, match="prior_slope, prior_level, prior_step >= 0"):
        RoundCost(prior_slope=-1.0, prior_level=0.0)
    with pytest.raises(ValueError, match="probes must be positive"):
        RoundCost(1.0, 1.0, probes=(1.0, 0.0))


def test_round_cost_follows_a_step_change_within_fifty_rounds():
    """The round cost jumps from 40 + 0.5 T to 120 + 1.5 T (noise-free rounds, T spread by the probes):
    with the default forgetting (0.93 per round: the old regime weighs 0.93^50 < 3% after 50 rounds) the
    line is within 0.15 ms/token and 5 ms of the new plane 50 rounds later; the same rounds without
    forgetting (decay 1) leave it near the average of both regimes."""
    lines = {decay: RoundCost(prior_slope=0.5, prior_level=40.0, decay=decay) for decay in (0.93, 1.0)}
    for rc in lines.values():
        for _ in range(60):
            t = round(32 * rc.probe())
            rc.observe(t, 40 + 0.5 * t, bs=8)
        assert rc.slope == pytest.approx(0.5, abs=1e-6) and rc.level == pytest.approx(40.0, abs=1e-4)
        for _ in range(50):
            t = round(32 * rc.probe())
            rc.observe(t, 120 + 1.5 * t, bs=8)
    forgets, remembers = lines[0.93], lines[1.0]
    assert forgets.slope == pytest.approx(1.5, abs=0.15) and forgets.level == pytest.approx(120.0, abs=5.0)
    assert remembers.slope < 1.0 and remembers.level < 100.0  # without forgetting: stuck between regimes


def test_marginal_value_is_the_slope_times_the_recent_tokens_per_ms():
    """A known cost plane (0.5 ms per verified token, 2 ms per draft step, the priors equal to it: the fit
    is exact) and a known throughput: 0.5 committed tokens per ms for 60 rounds, then 0.1. The marginal value
    (ms per token x tokens per ms) is 0.5 x 0.5 = 0.25, then follows the new rate to 0.5 x 0.1 = 0.05
    within 3% after 80 rounds (the old rounds' weight decays); a rate that never decays would stay near
    the all-time mean (0.5 x 0.27)."""
    rng = random.Random(5)
    rc = RoundCost(prior_slope=0.5, prior_level=40.0, prior_step=2.0)
    assert rc.marginal_value() == 0.0  # no round yet
    for rate, rounds, want in ((0.5, 60, 0.25), (0.1, 80, 0.05)):
        for _ in range(rounds):
            t, d = round(32 * rc.probe()), rng.randint(1, 5)
            ms = 40 + 0.5 * t + 2.0 * d
            rc.observe(t, ms, bs=8, committed=rate * ms, steps=d)
        assert rc.slope == pytest.approx(0.5, abs=1e-6) and rc.step == pytest.approx(2.0, abs=1e-6)
        assert rc.marginal_value() == pytest.approx(want, rel=0.03)
