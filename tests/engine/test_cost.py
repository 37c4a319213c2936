"""Cost curve (interpolation, cache) and per-policy budget choice against the formula by brute force."""

import time

import pytest
import torch

from tests.models.tiny import make_tiny_llama
from treespec_sglang.engine import SpecEngine
from treespec_sglang.engine.cost import CostCurve, choose_budgets, measure_cost_curve


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
        self.inner, self.ms_per_token, self.tokens, self.shapes = inner, ms_per_token, [], []

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def __call__(self, ids, *args, **kwargs):
        self.tokens.append(ids.shape[1])  # ids [bs, tokens]
        self.shapes.append(tuple(ids.shape))
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


@pytest.mark.parametrize("bad", [0, -1, 1.5, True])
def test_bad_batch_sizes_are_refused(bad):
    with pytest.raises(ValueError, match=r"CostCurve.bs must be an integer >= 1, got"):
        CostCurve((1,), (1.0,), (1,), (1.0,), bs=bad)


@pytest.mark.parametrize("bs", [2, 4])
def test_a_curve_measured_at_the_batch_prices_rounds_per_request(bs):
    """A batch-``bs`` curve is read at each request's own tree / width (a plain step at 1 token), never at
    ``bs`` times them: a plain loop over the rows with the formula written out."""
    c = CostCurve((1, 4, 8, 16), (50.0, 55.0, 64.0, 90.0), (1, 4), (3.0, 5.0), bs=bs)
    table = {"p": {str(n): dict(tau=1 + 0.4 * n ** 0.5, delta=3, tree=n - 0.5, width=2) for n in (2, 4, 8, 16)}}
    pick = choose_budgets(table, c, bs=bs)["p"]
    rates = {}
    for n, r in table["p"].items():
        t = r["tree"]  # verify: linear between the measured sizes around t
        lo = max(x for x in c.sizes if x <= t)
        hi = min(x for x in c.sizes if x >= t)
        v = c.verify_ms[c.sizes.index(lo)] + (0 if hi == lo else (c.verify_ms[c.sizes.index(hi)] - c.verify_ms[
            c.sizes.index(lo)]) * (t - lo) / (hi - lo))
        rates[int(n)] = r["tau"] / (v + 3 * (3.0 + 2.0 * (2 - 1) / 3))
    best = max(rates, key=rates.get)
    assert pick.budget == best and pick.speedup == pytest.approx(rates[best] * 50.0)


def test_a_curve_measured_at_another_batch_is_refused():
    c = CostCurve((1, 4), (50.0, 55.0), (1,), (3.0,), bs=2)
    table = {"p": {"2": dict(tau=1.5, delta=1, tree=2, width=1)}}
    with pytest.raises(ValueError, match="a cost curve measured at batch 2 cannot plan batch 4: measure it at 4 or 1"):
        choose_budgets(table, c, bs=4)
    assert choose_budgets(table, c, bs=2)["p"].round_ms == pytest.approx(50 + 5 / 3 + 3)


ZEN3 = "processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: 25\nmodel\t\t: 1\nmodel name\t: AMD EPYC\nstepping\t: 1\n"
ZEN4 = ZEN3.replace("model\t\t: 1\n", "model\t\t: 17\n")


@pytest.mark.parametrize("text, want", [
    (ZEN3, "AMD EPYC (family 25 model 1 stepping 1)"),
    (ZEN4 + "\nprocessor\t: 1\ncpu family\t: 26\nmodel\t\t: 2\n", "AMD EPYC (family 25 model 17 stepping 1)"),
    ("processor\t: 0\nmodel name\t: Intel(R) Xeon(R) Platinum 8488C\n", "Intel(R) Xeon(R) Platinum 8488C"),
    ("processor\t: 0\nCPU part\t: 0xd0c\n", None),  # no model name (some ARM kernels): platform's processor()
])
def test_the_cpu_is_named_with_its_family_model_and_stepping(tmp_path, text, want):
    """A VM may name Zen 3, 4 and 5 "AMD EPYC" alike: the first processor's family, model and stepping tell them
    apart in the cost curve's cache key and in every benchmark's figure."""
    from treespec_sglang.engine import cost

    path = tmp_path / "cpuinfo"
    path.write_text(text)
    assert cost._cpu_name(str(path)) == (cost.platform.processor() if want is None else want)
    assert cost._cpu_name(str(tmp_path / "missing")) == cost.platform.processor()


def test_curves_of_two_cpus_that_share_a_model_name_are_cached_apart(tmp_path, monkeypatch):
    from treespec_sglang.engine import cost

    make_tiny_llama(tmp_path / "m", vocab=40, hidden=32, layers=2, heads=4, kv_heads=2)
    e = SpecEngine.from_pretrained(str(tmp_path / "m"), draft=None, dtype="float32")
    kw = dict(sizes=(1, 2), widths=(1,), prefix=8, repeats=1, cache_dir=str(tmp_path))
    real, info = cost._cpu_name, tmp_path / "cpuinfo"
    monkeypatch.setattr(cost, "_cpu_name", lambda: real(str(info)))
    got = []
    for text in (ZEN3, ZEN4, ZEN3):
        info.write_text(text)
        got.append(measure_cost_curve(e, **kw)[1])
    assert got == [False, False, True] and len(list(tmp_path.glob("cost-*.json"))) == 2


def test_a_batch_curve_runs_every_forward_at_the_batch_and_caches_apart(tmp_path):
    make_tiny_llama(tmp_path / "m", vocab=40, hidden=32, layers=2, heads=4, kv_heads=2)
    e = SpecEngine.from_pretrained(str(tmp_path / "m"), draft=None, dtype="float32")
    e.target, e.draft = Slowed(e.target, 0.0), Slowed(e.draft, 0.0)
    kw = dict(sizes=(1, 4), widths=(1, 2), prefix=8, repeats=1, cache_dir=str(tmp_path))
    c1, cached1 = measure_cost_curve(e, **kw)
    e.target.shapes.clear(), e.draft.shapes.clear()
    c3, cached3 = measure_cost_curve(e, bs=3, **kw)
    # the bs-3 prefill, then every verify / draft forward over 3 requests at once
    assert e.target.shapes == [(3, 8)] + [(3, 1)] * 2 + [(3, 4)] * 2 and e.draft.shapes == [(3, 1)] * 2 + [(3, 2)] * 2
    again, cached_again = measure_cost_curve(e, bs=3, **kw)
    assert (cached1, cached3, cached_again) == (False, False, True)
    assert (c1.bs, c3.bs, again.bs) == (1, 3, 3) and again == c3
    assert len(list(tmp_path.glob("cost-*.json"))) == 2
    with pytest.raises(ValueError, match="bs must be an integer >= 1, got 0"):
        measure_cost_curve(e, bs=0, **kw)


def _tailed_table():
    # budget 2 accepts the same on every prompt; budget 8 accepts more on average (tau: the prompts' tokens over
    # their rounds, equal tokens each) but spreads widely
    taus8 = [1.6, 2.5, 3.0, 8.0]
    return {"p": {"2": dict(tau=1.8, delta=1, tree=2, width=1, taus=[1.8, 1.8, 1.8, 1.8]),
                  "8": dict(tau=4 / sum(1 / t for t in taus8), delta=3, tree=8, width=1, taus=taus8)}}


def test_a_batch_tail_prices_each_row_between_one_row_and_the_full_batch():
    """bs 4: each row's round is priced at 1 row on the tail's bs-1 curve (+ its overhead) and at 4 rows on the
    batch curve (+ the batch overhead); a brute-force walk over every draw of 4 prompts gives the ms per token."""
    from tests.engine.tail_oracle import walk_batch_ms
    from treespec_sglang.engine.cost import BatchTail
    from treespec_sglang.engine.overhead import Overheads

    batch = CostCurve((1, 2, 8), (60.0, 62.0, 80.0), (1,), (4.0,), bs=4)
    one = CostCurve((1, 2, 8), (30.0, 31.0, 40.0), (1,), (2.0,))
    ov4, ov1 = Overheads(1.0, {"p": 6.0}, 4), Overheads(0.5, {"p": 3.0}, 1)
    table = _tailed_table()
    picks = choose_budgets(table, batch, bs=4, overheads=ov4, tail=BatchTail(one, ov1))
    rounds = {"2": (31.0 + 2.0 + 3.0, 62.0 + 4.0 + 6.0), "8": (40.0 + 3 * 2.0 + 3.0, 80.0 + 3 * 4.0 + 6.0)}
    plain = 60.0 + 1.0
    speedups = {}
    for n, (c1, c4) in rounds.items():  # the batch waits for its slowest request; a round costs by its running rows
        speedups[n] = plain / walk_batch_ms(table["p"][n]["taus"], 4, c1, c4)
    best = max(speedups, key=speedups.get)
    c = picks["p"]
    assert best == "2" and c.budget == 2  # untailed, budget 8 wins: 2.70 / 98 > 1.8 / 72
    assert choose_budgets(table, batch, bs=4, overheads=ov4)["p"].budget == 8
    assert c.speedup == pytest.approx(speedups["2"]) and c.tail == pytest.approx(1.0)
    assert c.round_ms == pytest.approx(72.0)
    eight = choose_budgets({"p": {"8": table["p"]["8"]}}, batch, bs=4, overheads=ov4, tail=BatchTail(one, ov1))["p"]
    assert eight.speedup == pytest.approx(speedups["8"])
    assert eight.tail == pytest.approx((plain / speedups["8"]) / (98.0 / table["p"]["8"]["tau"])) and eight.tail > 1.1


def test_a_batch_tail_changes_nothing_at_batch_one_or_without_taus():
    from treespec_sglang.engine.cost import BatchTail

    one = CostCurve((1, 2, 8), (30.0, 31.0, 40.0), (1,), (2.0,))
    table = _tailed_table()
    bare = {"p": {n: {k: v for k, v in r.items() if k != "taus"} for n, r in table["p"].items()}}
    tail = BatchTail(CostCurve((1, 8), (10.0, 20.0), (1,), (1.0,)))
    assert choose_budgets(table, one, bs=1, tail=tail) == choose_budgets(table, one, bs=1)
    assert choose_budgets(bare, one, bs=4, tail=tail) == choose_budgets(bare, one, bs=4)
    with pytest.raises(ValueError, match="BatchTail.curve must be measured at batch 1, got batch 4"):
        BatchTail(CostCurve((1, 8), (10.0, 20.0), (1,), (1.0,), bs=4))
