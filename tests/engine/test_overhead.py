"""Measured round overheads: real rounds are timed, the part the cost curve does not price is what is
left, a step change in a round's host work shows up in it (and only for the rounds that do it), and the
budget choice prices it (plain arithmetic oracles)."""

from types import SimpleNamespace

import pytest

from treespec_sglang.engine.cost import CostCurve, choose_budgets
from treespec_sglang.engine.overhead import Overheads, measure_overheads, round_times_ms

CHAIN = {"policy": "chain", "length": 3}
ZERO = CostCurve((1, 64), (0.0, 0.0), (1, 16), (0.0, 0.0))  # prices nothing: overhead = the whole round


def test_round_times_are_one_per_verify_round(tiny_engine):
    res, ts = round_times_ms(tiny_engine, [[5, 9, 2, 7]], CHAIN, max_new_tokens=9)
    assert len(ts) == len(res[0].stats.tree_sizes) >= 2 and all(t > 0 for t in ts)
    res, ts = round_times_ms(tiny_engine, [[5, 9, 2, 7]], None, max_new_tokens=6)
    assert len(ts) == 5  # plain: one token per step, 6 steps, 5 gaps


def test_a_slower_round_shows_in_its_overhead_and_not_in_plain(tiny_engine, monkeypatch):
    """Add 30 ms of host work to every speculative round (the KV commit stage): the chain's measured
    overhead grows by exactly 30 ms; a plain step, which never commits a tree, does not. The timer is a
    virtual clock that only the added work moves (real rounds take no time on it), so the figure is exact on
    a loaded machine too: a commit counted twice, or in no round, would read 60 or 0."""
    import treespec_sglang.engine.engine as E
    import treespec_sglang.engine.overhead as O

    clock = [0.0]
    monkeypatch.setattr(O, "time", SimpleNamespace(perf_counter=lambda: clock[0]))  # the module's timer only
    base = measure_overheads(tiny_engine, ZERO, [CHAIN], rounds=6)
    real = E.commit

    def slow_commit(*a, **k):
        clock[0] += 0.030
        return real(*a, **k)

    monkeypatch.setattr(E, "commit", slow_commit)
    slow = measure_overheads(tiny_engine, ZERO, [CHAIN], rounds=6)
    assert base.round_ms["chain"] == 0.0 and base.step_ms == 0.0, base
    assert slow.round_ms["chain"] == pytest.approx(30.0) and slow.step_ms == 0.0, slow


def test_overhead_is_what_the_curve_does_not_price(tiny_engine, monkeypatch):
    """With a curve that prices each verified token at 1 ms and each draft step at 2 ms, the overhead is the
    measured round minus exactly that (the round times and stats are pinned, so the oracle is arithmetic)."""
    import treespec_sglang.engine.overhead as O

    curve = CostCurve((1, 64), (1.0, 64.0), (1, 16), (2.0, 32.0))
    real = O.round_times_ms

    def pinned(engine, prompts, spec, max_new_tokens):
        res, _ = real(engine, prompts, spec, max_new_tokens)
        return res, [50.0, 70.0]

    monkeypatch.setattr(O, "round_times_ms", pinned)
    ov = measure_overheads(tiny_engine, curve, [CHAIN], widths={"chain": 1.0}, rounds=4)
    res, _ = real(tiny_engine, [[1] * 64], CHAIN, 5)  # the same kind of run, for its stats
    assert ov.step_ms == pytest.approx(60.0 - 1.0)
    sizes = [s for s in res[0].stats.tree_sizes]
    # chain of length 3: every round verifies 4 tokens and runs 3 draft steps, whatever is accepted
    assert set(sizes) == {4}
    assert ov.round_ms["chain"] == pytest.approx(60.0 - (4 * 1.0 + 3 * 2.0), abs=1.0)
    with pytest.raises(ValueError, match="bs and rounds must be >= 1"):
        measure_overheads(tiny_engine, curve, [CHAIN], bs=0)


def test_one_stalled_round_does_not_move_the_overhead(tiny_engine, monkeypatch):
    """Rounds of 60 ms and one of 600 (the machine stalled once): the overhead is the typical round's, 60 ms
    less what the curve prices, not the mean's 150."""
    import treespec_sglang.engine.overhead as O

    curve = CostCurve((1, 64), (1.0, 64.0), (1, 16), (2.0, 32.0))
    real = O.round_times_ms
    monkeypatch.setattr(O, "round_times_ms", lambda *a: (real(*a)[0], [60.0, 600.0, 60.0, 60.0, 60.0]))
    ov = measure_overheads(tiny_engine, curve, [CHAIN], widths={"chain": 1.0}, rounds=4)
    assert ov.step_ms == pytest.approx(60.0 - 1.0)
    assert ov.round_ms["chain"] == pytest.approx(60.0 - (4 * 1.0 + 3 * 2.0))


@pytest.mark.parametrize("curve_bs, want_step, want_round", [
    (1, 60.0 - 2.0, 60.0 - (2 * 4 * 1.0 + 3 * 2 * 2.0)),  # a bs-1 curve: 2 x the tokens and the width
    (2, 60.0 - 1.0, 60.0 - (4 * 1.0 + 3 * 2.0)),  # measured at the batch: one request's tree and width
])
def test_a_batch_is_priced_as_choose_budgets_prices_it(tiny_engine, monkeypatch, curve_bs, want_step, want_round):
    """bs 2, pinned round times (mean 60 ms), 1 ms per verified token and 2 ms per frontier node: the
    overhead subtracts the forwards exactly as ``choose_budgets`` adds them, for either kind of curve; a
    curve measured at another batch is refused."""
    import treespec_sglang.engine.overhead as O

    curve = CostCurve((1, 64), (1.0, 64.0), (1, 16), (2.0, 32.0), bs=curve_bs)
    real = O.round_times_ms
    monkeypatch.setattr(O, "round_times_ms", lambda *a: (real(*a)[0], [50.0, 70.0]))
    ov = measure_overheads(tiny_engine, curve, [CHAIN], widths={"chain": 1.0}, bs=2, rounds=4)
    assert ov.bs == 2 and ov.step_ms == pytest.approx(want_step)
    assert ov.round_ms["chain"] == pytest.approx(want_round)  # chain of 3: 4 tokens, 3 draft steps a round
    with pytest.raises(ValueError, match="measured at batch 3 cannot price rounds of batch 2"):
        measure_overheads(tiny_engine, CostCurve((1, 64), (1.0, 64.0), (1, 16), (2.0, 32.0), bs=3), [CHAIN], bs=2)


def test_budget_choice_prices_the_overheads():
    """A per-round overhead favours bigger trees (it is paid once per round); it counts only for its own
    policy; a plain-step overhead lowers every speedup's denominator less than the round's."""
    c = CostCurve((1, 4, 8), (40.0, 44.0, 48.0), (1,), (2.0,))
    rows = {"4": dict(tau=2.0, delta=2, tree=4, width=1), "8": dict(tau=2.25, delta=3, tree=8, width=1)}
    table = {"p": rows, "q": rows}
    # curve only: 2.0 / 48 = .04167 > 2.25 / 54 = .04167 ... tie broken by the first (4); with 30 ms per round
    # of p: 2.0 / 78 = .02564 < 2.25 / 84 = .02679, so p moves to 8 and q stays at 4
    picks = choose_budgets(table, c, overheads=Overheads(0.0, {"p": 30.0}))
    assert (picks["p"].budget, picks["q"].budget) == (8, 4)
    assert picks["p"].round_ms == pytest.approx(48 + 3 * 2 + 30)
    assert picks["p"].speedup == pytest.approx(2.25 / 84 * 40)
    picks = choose_budgets(table, c, overheads=Overheads(10.0, {"p": 30.0}))
    assert picks["p"].speedup == pytest.approx(2.25 / 84 * 50) and picks["q"].speedup == pytest.approx(2.0 / 48 * 50)


def test_a_policys_first_round_is_not_timed(tiny_engine, monkeypatch):
    """A policy whose first round in the process is slow (new shapes, a classifier's first call): on a
    virtual clock that only that round moves, its measured overhead is 0, not that round's cost."""
    import treespec_sglang.engine.engine as E
    import treespec_sglang.engine.overhead as O

    clock = [0.0]
    monkeypatch.setattr(O, "time", SimpleNamespace(perf_counter=lambda: clock[0]))
    real, calls = E.commit, [0]

    def cold_then_warm(*a, **k):
        calls[0] += 1
        if calls[0] == 1:
            clock[0] += 0.5
        return real(*a, **k)

    monkeypatch.setattr(E, "commit", cold_then_warm)
    ov = measure_overheads(tiny_engine, ZERO, [CHAIN], rounds=6)
    assert calls[0] > 1 and ov.round_ms["chain"] == 0.0, (calls, ov)
