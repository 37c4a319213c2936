"""The demo's budget plan: each policy's per-round overhead, measured at the planned batch, is priced into its
rounds (and printed next to the curve-alone choice), on a cost curve measured at that batch."""

import json
from pathlib import Path

import pytest

import treespec_sglang.engine.overhead as O
from treespec_sglang.engine.runs import pick_budgets
from treespec_sglang.engine.cost import CostCurve
from treespec_sglang.engine.overhead import Overheads

TABLE = {"chain": {"2": {"tau": 1.5, "delta": 1, "tree": 2, "width": 1, "spec": {"policy": "chain", "length": 1}},
                   "4": {"tau": 1.9, "delta": 3, "tree": 4, "width": 1, "spec": {"policy": "chain", "length": 3}}}}


@pytest.fixture
def planned(tiny_engine, tmp_path, monkeypatch):
    """The shared tiny engine on a pinned curve (verify 10 + 1 ms/token, draft 2 ms) and a draft dir holding
    ``TABLE``."""
    monkeypatch.setattr(tiny_engine, "cost_curve", CostCurve((1, 16), (10.0, 25.0), (1, 4), (2.0, 3.0)))
    (tmp_path / "policy_table.json").write_text(json.dumps({"table": TABLE}))
    return tiny_engine, str(tmp_path)


def test_batch_one_prices_the_measured_overhead(planned, monkeypatch):
    e, d = planned
    seen = []

    def fake(engine, curve, specs, widths, bs):
        seen.append((specs, widths, bs))
        return Overheads(1.0, {"chain": 40.0}, bs)

    monkeypatch.setattr(O, "measure_overheads", fake)
    plans = {}
    specs, lines = pick_budgets(e, [{"policy": "chain", "length": 9}], d, None, bs=1, plans=plans)
    # curve alone: N 2 = 1.5 / (11 + 2) = .115 > N 4 = 1.9 / (13 + 6) = .100; the overhead is measured there
    assert seen == [([{"policy": "chain", "length": 1}], {"chain": 1}, 1)]
    # with 40 ms per round the choice flips: N 4 = 1.9 / 59 = .0322 > N 2 = 1.5 / 53 = .0283; plain 10 + 1 = 11 ms
    c = plans["chain"]
    assert c.budget == 4 and c.round_ms == pytest.approx(13 + 3 * 2 + 40)
    assert c.speedup == pytest.approx(1.9 / 59 * 11) and specs == [{"policy": "chain", "length": 3}]
    assert any("plain +1.0, chain +40.0" in x for x in lines), lines
    assert any("the curve alone: budget 2" in x for x in lines), lines


def test_batch_above_one_prices_its_overhead_on_the_batch_curve(planned, monkeypatch):
    e, d = planned
    seen = []

    def fake(engine, curve, specs, widths, bs):
        seen.append((specs, curve.bs, bs))
        return Overheads(1.0, {"chain": 40.0}, bs)

    monkeypatch.setattr(O, "measure_overheads", fake)
    # the batch-2 curve (verify 12 + 1.2 ms per token per request, draft 2.5 + 1/3 ms per node per request)
    monkeypatch.setattr(e, "_batch_curves", {2: (CostCurve((1, 16), (12.0, 30.0), (1, 4), (2.5, 3.5), bs=2), True)})
    plans = {}
    _, lines = pick_budgets(e, [{"policy": "chain", "length": 9}], d, None, bs=2, plans=plans)
    assert any("(cached, torch.float32, batch 2)" in x for x in lines), lines
    # curve alone on the batch-2 curve: N 2 = 1.5 / (verify(2) 13.2 + draft(1) 2.5) = .0955 > N 4 = 1.9 / (15.6 +
    # 3 x 2.5) = .0823 (the bs-1 curve's approximation would price a plain step 13 + 2.33 ms, not 12); the
    # overheads are measured there, at batch 2 on that curve
    assert seen == [([{"policy": "chain", "length": 1}], 2, 2)]
    assert any("bs 2): plain +1.0, chain +40.0" in x for x in lines), lines
    # + 40 ms a round flips the choice: N 4 = 1.9 / 63.1 = .0301 > N 2 = 1.5 / 55.7 = .0269; plain 12 + 1 ms
    c = plans["chain"]
    assert c.budget == 4 and c.round_ms == pytest.approx(15.6 + 3 * 2.5 + 40)
    assert c.speedup == pytest.approx(1.9 / 63.1 * 13) and c.tail == 1.0
    assert any("the curve alone: budget 2" in x for x in lines), lines
    assert any("the batch's tail is not priced: the acceptance table holds no per-prompt taus" in x for x in lines)


def test_a_batch_plan_measures_its_own_curve_once(planned, monkeypatch):
    """pick_budgets at batch 3 asks the engine for a batch-3 curve; the engine measures it once and keeps it."""
    import treespec_sglang.engine.cost as C

    e, d = planned
    calls = []

    def fake(engine, cache_dir=None, model_id="", bs=1, **kw):
        calls.append(bs)
        return CostCurve((1, 16), (12.0, 30.0), (1, 4), (2.5, 3.5), bs=bs), False

    monkeypatch.setattr(C, "measure_cost_curve", fake)
    monkeypatch.setattr(e, "_batch_curves", {})
    for _ in range(2):
        pick_budgets(e, [{"policy": "chain", "length": 9}], d, None, bs=3)
    assert calls == [3] and e.measured_cost_curve(3)[0].bs == 3 and e.measured_cost_curve()[0].bs == 1


def test_batch_above_one_prices_its_tail_from_the_per_prompt_taus(planned, monkeypatch):
    """With per-prompt taus in the table, a bs-2 plan also measures the overheads at bs 1 on the bs-1 curve and
    prices each round between one row and two: a batch of two prompts drawn from taus [1.5, 3] waits for the
    slower one."""
    e, d = planned
    table = {"chain": {"4": dict(TABLE["chain"]["4"], tau=2.0, taus=[1.5, 3.0])}}
    tmp = Path(d) / "policy_table.json"
    tmp.write_text(json.dumps({"table": table}))
    seen = []

    def fake(engine, curve, specs, widths, bs):
        seen.append((curve.bs, bs))
        return Overheads(1.0, {"chain": 4.0 if bs == 2 else 2.0}, bs)

    monkeypatch.setattr(O, "measure_overheads", fake)
    monkeypatch.setattr(e, "_batch_curves", {2: (CostCurve((1, 16), (12.0, 30.0), (1, 4), (2.5, 3.5), bs=2), True)})
    plans = {}
    _, lines = pick_budgets(e, [{"policy": "chain", "length": 9}], d, None, bs=2, plans=plans)
    assert seen == [(2, 2), (1, 1)] and tmp.is_file()
    assert any("bs 1): plain +1.0, chain +2.0 (prices the batch's tail" in x for x in lines), lines
    c2 = 15.6 + 3 * 2.5 + 4.0  # two rows: batch curve at 4 tokens, 3 draft steps, batch overhead
    c1 = 13.0 + 3 * 2.0 + 2.0  # one row: the pinned bs-1 curve (10 + 1 ms/token), its overhead
    # draws (1.5, 1.5): 2/3 x c2; (3, 3): 1/3 x c2; (1.5, 3) twice: 1/3 x c2 + 1/3 x c1
    ms = (2 / 3 * c2 + 1 / 3 * c2 + 2 * (1 / 3 * c2 + 1 / 3 * c1)) / 4
    c = plans["chain"]
    assert c.speedup == pytest.approx((12.0 + 1.0) / ms) and c.tail == pytest.approx(ms / (c2 / 2.0))
    assert any(f"batch tail x{c.tail:.2f}" in x for x in lines), lines
