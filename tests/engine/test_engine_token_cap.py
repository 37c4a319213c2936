"""SpecEngine end to end under the batch's token cap (``token_cap``: fixed, calibrated, ``"auto"`` from the
round-cost line, a request's opt-out) and auto draft pruning: greedy output == plain greedy in every case, and
each round's trees keep the cap and the allocation a brute force restated from the definitions finds."""

import itertools

import pytest
import torch

from tests.helpers import best_allocation, calibration_weights, kept_indices, oracle_node_values
from tests.engines import POLICIES, prompts

pytest.importorskip("transformers")


@pytest.mark.parametrize("per_request", [1, 2, 5])
def test_token_cap_is_lossless_and_respected(aligned_engine, per_request):
    """One token cap for the whole batch (roots included): greedy output == plain greedy for every
    allocation, and every round's tree sizes sum to at most the cap across the requests still running."""
    ps = prompts(6, seed=11)
    mix = [POLICIES[i % len(POLICIES)] for i in range(6)]
    plain = aligned_engine.generate(ps, max_new_tokens=14, policy=None)
    cap = per_request * len(ps)
    res = aligned_engine.generate(ps, max_new_tokens=14, policy=mix, token_cap=cap)
    assert [r.token_ids for r in res] == [r.token_ids for r in plain]
    sizes = [r.stats.tree_sizes for r in res]
    for rnd in range(max(len(s) for s in sizes)):
        running = sum(1 for s in sizes if len(s) > rnd)  # the cap scales with the requests still running
        assert sum(s[rnd] for s in sizes if len(s) > rnd) <= max(-(-cap * running // len(ps)), running)
    if per_request == 1:
        assert all(x == 1 for s in sizes for x in s)  # only roots fit
    if per_request == 5:
        assert max(x for s in sizes for x in s) > 5  # the cap moves between requests
    with pytest.raises(ValueError, match="token_cap must be an integer >= 1"):
        aligned_engine.generate(ps, max_new_tokens=4, policy=mix, token_cap=0)


def test_calibrated_token_cap_is_lossless_and_learns(aligned_engine):
    ps = prompts(6, seed=12)
    mix = [POLICIES[i % len(POLICIES)] for i in range(6)]
    plain = aligned_engine.generate(ps, max_new_tokens=14, policy=None)
    res = aligned_engine.generate(ps, max_new_tokens=14, policy=mix, token_cap=18, calibrate=True)
    assert [r.token_ids for r in res] == [r.token_ids for r in plain]
    cal = aligned_engine.calibration
    assert cal is not None and float(cal.predicted.sum()) > 0 and float(cal.accepted.sum()) > 0
    assert sum(cal.curve()["nodes"]) == sum(sum(s - 1 for s in r.stats.tree_sizes) for r in res)
    with pytest.raises(ValueError, match="calibrate=True needs token_cap"):
        aligned_engine.generate(ps, max_new_tokens=4, policy=mix, calibrate=True)


def test_each_round_allocates_under_the_calibration(aligned_engine, monkeypatch):
    """calibrate=True: the round's calibration reaches its allocation. With a frozen per-depth calibration
    (depth >= 2 x100: a child's value rises to its parent's cap, above the parent's weaker siblings), every
    round keeps the nodes whose calibrated values (path probability x its depth's ratio, capped by the
    parent: a plain loop) sum to the brute-force optimum over closed subsets under that round's T, and in
    some rounds the uncalibrated optimum would have been worse."""
    from treespec_sglang.engine import engine as E
    from treespec_sglang.engine import round as R
    from treespec_sglang.policies.calibration import DepthCalibration

    accepted, predicted = [0.0, 0.0, 198.0, 198.0, 198.0], [0.0] * 5  # ratios (a + 2) / (p + 2): 1, 1, 100, 100, 100

    class Frozen(DepthCalibration):
        def update(self, tree, path):  # the weights stay the test's
            pass

    def frozen():
        cal = Frozen(max_depth=4)
        cal.accepted = torch.tensor(accepted, dtype=torch.float64)
        cal.predicted = torch.tensor(predicted, dtype=torch.float64)
        return cal

    rounds = []  # (candidates, T, verified trees)
    real = R.plan_round

    def spy(tree, cap, *a, **k):
        out = real(tree, cap, *a, **k)
        rounds.append((tree, cap, out[0]))
        return out

    monkeypatch.setattr(E, "DepthCalibration", frozen)
    monkeypatch.setattr(R, "plan_round", spy)
    ps = prompts(4, seed=29)
    mix = [{"policy": "eagle2", "budget": 10, "topk": 3, "depth": 3}, {"policy": "chain", "length": 4},
           {"policy": "c2t", "budget": 8, "topk": 3, "beta": 0.2},
           {"policy": "salf", "budget": 8, "batch": 3, "th": 0.3}]
    aligned_engine.generate(ps, max_new_tokens=6, policy=mix, token_cap=10, calibrate=True)
    assert isinstance(aligned_engine.calibration, Frozen) and rounds
    prior, worse = aligned_engine.calibration.prior, 0
    for tree, total, out in rounds:
        values = oracle_node_values(tree, calibration_weights(tree, accepted, predicted, prior, 4))  # [bs][n]
        kept = kept_indices(tree, out)
        total = max(total, tree.bs)
        assert sum(len(k) for k in kept) <= total
        best, _ = best_allocation(tree, values, total)
        assert sum(values[b][i] for b, k in enumerate(kept) for i in k[1:]) == pytest.approx(best, abs=1e-6)
        _, raw = best_allocation(tree, oracle_node_values(tree), total)  # the uncalibrated choice
        worse += sum(values[b][i] for b, k in enumerate(raw) for i in k if i != 0) < best - 1e-6
    assert worse > 0, "the calibration never changed a round's best allocation: the check is vacuous"


@pytest.mark.parametrize("curve_kind", ["flat", "steep"])
def test_auto_token_cap_follows_the_round_cost_and_is_lossless(aligned_engine, monkeypatch, curve_kind):
    """token_cap="auto": T per round from the round-cost line. A flat line (verifying more is free)
    keeps every proposed node; a line where every extra token costs a whole round keeps the roots only
    (no node is worth an expected 1 token). Greedy output == plain greedy either way."""
    from treespec_sglang.engine import engine as E
    from treespec_sglang.engine.round_cost import RoundCost

    ps = prompts(4, seed=13)
    mix = [POLICIES[i % len(POLICIES)] for i in range(4)]
    plain = aligned_engine.generate(ps, max_new_tokens=12, policy=None)
    full = aligned_engine.generate(ps, max_new_tokens=12, policy=mix)
    slope = 0.0 if curve_kind == "flat" else 1e4  # pinned: the prior outweighs any measured round
    monkeypatch.setattr(E.SpecEngine, "_round_cost",
                        lambda self: RoundCost(slope, 10.0, strength=1e30, probes=(1.0,)))
    res = aligned_engine.generate(ps, max_new_tokens=12, policy=mix, token_cap="auto")
    assert [r.token_ids for r in res] == [r.token_ids for r in plain]
    if curve_kind == "flat":
        assert [r.stats.tree_sizes for r in res] == [r.stats.tree_sizes for r in full]
    else:  # roots only: 1 token per request per round
        assert all(x == 1 for r in res for x in r.stats.tree_sizes)
    with pytest.raises(ValueError, match="'auto' or None"):
        aligned_engine.generate(ps, max_new_tokens=4, policy=mix, token_cap="big")


def test_auto_token_cap_probes_and_learns_from_its_rounds(aligned_engine, monkeypatch):
    """The default round cost: probing rounds scale T, every round is observed, output stays lossless."""
    from treespec_sglang.engine import engine as E

    made, seen = [], []
    real = E.SpecEngine._round_cost

    def round_cost(self):  # record every observation the engine feeds the fit (no timing asserted)
        rc = real(self)
        obs = rc.observe
        rc.observe = lambda verified, ms, bs, **kw: seen.append((verified, ms, bs)) or obs(verified, ms, bs, **kw)
        made.append(rc)
        return rc

    monkeypatch.setattr(E.SpecEngine, "_round_cost", round_cost)
    ps = prompts(4, seed=17)
    mix = [POLICIES[i % len(POLICIES)] for i in range(4)]
    plain = aligned_engine.generate(ps, max_new_tokens=16, policy=None)
    res = aligned_engine.generate(ps, max_new_tokens=16, policy=mix, token_cap="auto", calibrate=True)
    assert [r.token_ids for r in res] == [r.token_ids for r in plain]
    (rc,) = made
    rounds = max(len(r.stats.tree_sizes) for r in res)
    assert rc.rounds == len(seen) == rounds
    # round i verified the trees of the requests still running then (the stats' i-th entries), in bs requests
    expect = [(sum(r.stats.tree_sizes[i] for r in res if len(r.stats.tree_sizes) > i),
               sum(len(r.stats.tree_sizes) > i for r in res)) for i in range(rounds)]
    assert [(v, bs) for v, _, bs in seen] == expect
    assert all(ms > 0 for _, ms, _ in seen) and rc.level >= 0 and rc.slope >= 0


def test_a_request_can_opt_out_of_the_token_cap(aligned_engine):
    """{"token_cap": False} keeps that request's whole tree under a tight token cap (its nodes
    still count); the sharing requests are trimmed; greedy output == plain; a non-bool is refused alone."""
    ps = prompts(4, seed=19)
    own = {"policy": "eagle2", "budget": 6, "topk": 2, "depth": 3}
    mix = [dict(own, token_cap=False)] + [dict(own)] * 3
    plain = aligned_engine.generate(ps, max_new_tokens=12, policy=None)
    whole = aligned_engine.generate(ps[:1], max_new_tokens=12, policy=own)
    res = aligned_engine.generate(ps, max_new_tokens=12, policy=mix, token_cap=8)
    assert [r.token_ids for r in res] == [r.token_ids for r in plain]
    n0 = len(res[0].stats.tree_sizes)
    assert res[0].stats.tree_sizes == whole[0].stats.tree_sizes[:n0] and max(res[0].stats.tree_sizes) == 6
    assert all(x == 1 for r in res[1:] for x in r.stats.tree_sizes[:n0])  # 8 - 6 = 2 tokens: their roots
    bad = aligned_engine.generate(ps[:2], max_new_tokens=4, policy=[dict(own, token_cap="no"), own],
                                  token_cap=8)
    assert "token_cap must be true" in bad[0].error and bad[1].error is None and bad[1].token_ids


def pin_marginal_value(monkeypatch, value=0.6):
    """Every round's marginal value ``value`` tokens per ms, on a round-cost line that never refits."""
    from treespec_sglang.engine import engine as E
    from treespec_sglang.engine.round_cost import RoundCost

    monkeypatch.setattr(RoundCost, "marginal_value", lambda self: value)
    monkeypatch.setattr(E.SpecEngine, "_round_cost", lambda self: RoundCost(0.0, 10.0, strength=1e30, probes=(1.0,)))


def test_auto_draft_pruning_is_lossless_and_drafts_less(aligned_engine, monkeypatch):
    """token_cap="auto" with draft pruning: a pinned marginal value of 0.3 (no node below it could be
    worth verifying) drafts fewer forwards than no pruning, every expanded node at depth >= 2 hangs off a
    parent at or above the threshold, opted-out requests are never pruned, and greedy output == plain."""
    ps = prompts(4, seed=23)
    deep = {"policy": "eagle2", "budget": 10, "topk": 3, "depth": 4}
    mix = [deep, deep, deep, dict(deep, token_cap=False)]
    plain = aligned_engine.generate(ps, max_new_tokens=12, policy=None)
    pin_marginal_value(monkeypatch)
    trees = []
    from treespec_sglang.engine import round as R

    real = R.plan_round
    monkeypatch.setattr(R, "plan_round", lambda tree, *a, **k: trees.append(tree) or real(tree, *a, **k))
    runs = {p: aligned_engine.generate(ps, max_new_tokens=12, policy=mix, token_cap="auto", draft_prune=p)
            for p in (0.0, 0.5)}
    for res in runs.values():
        assert [r.token_ids for r in res] == [r.token_ids for r in plain]
    n0 = max(len(r.stats.tree_sizes) for r in runs[0.0])  # rounds of the first call
    full, pruned = trees[:n0], trees[n0:]  # the draft_prune=0.5 call's candidate trees (threshold 0.5 x 0.6 = 0.3)
    mean = [sum(int(t.size[:3].sum()) for t in ts) / len(ts) for ts in (full, pruned)]  # sharing requests' candidates
    assert mean[1] < 0.8 * mean[0], mean
    for t in pruned:
        deep_nodes = t.valid & (t.depth >= 2)
        parent_lp = torch.gather(t.logprob, 1, t.parents.clamp(min=0))
        assert (parent_lp[:3][deep_nodes[:3]] >= torch.tensor(0.3).log() - 1e-6).all()
    # the opted-out request (row 3 while all four run) keeps its whole tree: the same sizes as unpruned
    k = min(len(runs[0.0][3].stats.tree_sizes), len(runs[0.5][3].stats.tree_sizes))
    assert runs[0.5][3].stats.tree_sizes[:k] == runs[0.0][3].stats.tree_sizes[:k]
    with pytest.raises(ValueError, match=r"draft_prune must be a number in \[0, 1\]"):
        aligned_engine.generate(ps, max_new_tokens=4, policy=mix, token_cap="auto", draft_prune=1.5)


def test_draft_prunes_every_request_when_shares_are_unset(aligned_engine, monkeypatch):
    """``RoundOptions.shares`` None means every request shares the token cap: the round's draft then prunes each
    request as ``[True] * bs`` does, and not as ``[False] * bs`` (no request pruned) does."""
    import dataclasses

    from treespec_sglang.engine import engine as E
    from treespec_sglang.engine import round as R

    deep = {"policy": "eagle2", "budget": 10, "topk": 3, "depth": 4}
    pin_marginal_value(monkeypatch)
    trees = {}
    real = R.draft

    def spy(m, b, params, opts):
        if not trees:  # the first round: the same batch drafted under each reading of shares
            bs = b.root.shape[0]
            for key, shares in (("unset", None), ("all", [True] * bs), ("none", [False] * bs)):
                trees[key] = real(m, b, params, dataclasses.replace(opts, shares=shares))[0]
        return real(m, b, params, opts)

    monkeypatch.setattr(E, "draft", spy)
    aligned_engine.generate(prompts(4, seed=23), max_new_tokens=4, policy=deep, token_cap="auto", draft_prune=0.5)
    unset, every, none = trees["unset"], trees["all"], trees["none"]
    for name in ("tokens", "parents", "size"):
        assert torch.equal(getattr(unset, name), getattr(every, name)), name
    assert bool((unset.size < none.size).any()) and bool((unset.size <= none.size).all())


def test_a_capped_verify_runs_the_kept_nodes_only(aligned_engine, monkeypatch):
    """Under a token cap the target's verify forward takes the kept nodes' rows: each round's T tokens (the
    requests' tree sizes summed), not bs x the widest tree."""
    calls, rows = aligned_engine.calls, []
    target = calls.target

    class Recording:  # the target, recording the rows of every forward
        def __getattr__(self, name):
            return getattr(target, name)

        def __call__(self, *a, **k):
            rows.append(k.get("rows"))
            return target(*a, **k)

    monkeypatch.setattr(calls, "target", Recording())
    ps = prompts(4, seed=29)
    res = aligned_engine.generate(ps, max_new_tokens=10, policy=POLICIES[:4], token_cap=9)
    monkeypatch.undo()
    sizes = [r.stats.tree_sizes for r in res]
    verified = [sum(s[i] for s in sizes if len(s) > i) for i in range(max(map(len, sizes)))]
    assert [len(x) for x in rows if x is not None] == verified and rows[0] is None  # the prefill: every token
    assert [r.token_ids for r in res] == [r.token_ids for r in aligned_engine.generate(ps, max_new_tokens=10)]


def test_each_round_reports_its_tokens_time_and_draft_forwards(aligned_engine, monkeypatch):
    """What the decode loop tells the token cap plan after each round, against the requests' own stats: the
    tokens verified, the round's wall time in ms (a clock that ticks 2 s per read: whole multiples of 2000 ms), the
    requests running, the tokens committed and the round's draft forwards."""
    from treespec_sglang.engine import engine as E
    from treespec_sglang.engine.token_cap import TokenCapPlan

    seen, ticks = [], itertools.count()
    monkeypatch.setattr(TokenCapPlan, "observe", lambda self, *a: seen.append(a))
    monkeypatch.setattr(E.time, "perf_counter", lambda: 2.0 * next(ticks))
    res = aligned_engine.generate(prompts(3, seed=23), max_new_tokens=12, policy=POLICIES[:3])
    monkeypatch.undo()
    assert len(seen) == max(len(r.stats.accepted) for r in res) >= 2
    for i, (verified, ms, running, committed, steps) in enumerate(seen):
        live = [r.stats for r in res if len(r.stats.accepted) > i]
        assert (verified, running) == (sum(s.tree_sizes[i] for s in live), len(live))
        assert committed == sum(s.accepted[i] + 1 for s in live) and steps >= 1
        assert ms >= 2000 and ms % 2000 == 0
    longest = max(res, key=lambda r: len(r.stats.accepted)).stats
    assert sum(a[4] for a in seen) == longest.draft_forwards
