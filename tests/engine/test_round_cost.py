"""RoundCost: the online round-cost line of ``token_cap="auto"`` (its prior from the start-up curve, the fit of
verified tokens and draft steps, forgetting, the level refit when the batch shrinks, the marginal value)."""

import random

import pytest

from treespec_sglang.engine.cost import CostCurve
from treespec_sglang.engine.round_cost import RoundCost


def test_round_cost_prior_comes_from_the_startup_curve():
    curve = CostCurve((16, 64), (40.0, 88.0), (4,), (2.0,))
    rc = RoundCost.from_curve(curve)
    assert rc.slope == pytest.approx(1.0) and rc.level == pytest.approx(48.0) and rc.step == pytest.approx(2.0)


@pytest.mark.parametrize("slope,level", [(0.3, 100.0), (1.5, 20.0), (0.0, 60.0)])
def test_round_cost_learns_the_line_from_probed_rounds(slope, level):
    """RoundCost recovers a round's ms = level + slope * T from noisy rounds whose T spread comes from its
    own probe schedule, starting from a wrong prior (the bs-1 curve's slope)."""
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
