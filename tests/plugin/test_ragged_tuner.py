"""The ragged verify's tuner (``TREESPEC_RAGGED_VERIFY=tuned``): its schedule (warm-up, exploration), decisions
from measured times (margin, smoothing, samples still in flight, turns passed on) and agreement across ranks. Its
options and clocks: ``test_ragged_tuner_options.py``; the verify hook running it: ``test_ragged_hooks.py``."""

import logging
from types import SimpleNamespace

import pytest

from treespec_sglang.plugin.ragged_tuner import RaggedTuner, TunerOptions, _Bucket, bucket


class FakeClock:
    """Each timed forward takes ``ms[path]`` (0 padded, 1 ragged) at its bucket; finished only once released
    (``held``: the device still running it)."""

    def __init__(self, padded, ragged, held=False):
        self.ms, self.held, self.pending = {0: padded, 1: ragged}, held, []

    def begin(self):
        return None

    def end(self, _, key):
        self.pending.append((key, self.ms[key[1]]))

    def cancel(self, _):
        pass

    def finished(self):
        if self.held:
            return []
        out, self.pending = self.pending, []
        return out


N = 8  # the verify width of every test batch but where a test says otherwise


def run(t: RaggedTuner, bs: int, rounds: int, group=None, n: int = N) -> list:
    """The paths ``t`` chose for ``rounds`` verifies of ``bs`` requests at width ``n`` (each timed as that path)."""
    out = []
    for _ in range(rounds):
        r = t.choose(bs, n, group)
        with t.timed(bs, n, r, "cpu"):
            pass
        out.append(int(r))
    return out


@pytest.mark.parametrize("bs, want", [(1, 1), (2, 2), (3, 2), (4, 3), (7, 3), (8, 4), (64, 7), (65, 7), (128, 8)])
def test_batch_sizes_share_a_bucket_between_powers_of_two(bs, want):
    assert bucket(bs, 8) == (want, 8)


def test_a_batch_size_or_width_below_one_is_refused():
    with pytest.raises(ValueError, match="batch size must be >= 1, got 0"):
        bucket(0, 8)
    with pytest.raises(ValueError, match="verify width N must be >= 1, got 0"):
        bucket(1, 0)
    assert bucket(1, 1) == (1, 1) and bucket(3, 1) == (2, 1)  # N 1 (a root-only verify) is a width of its own


def test_warm_up_alternates_the_paths_then_a_faster_ragged_path_is_chosen_and_padded_explored():
    t = RaggedTuner(TunerOptions(warmup=3, explore_every=5), clock=FakeClock(padded=10.0, ragged=6.0))
    assert run(t, 8, 16) == [0, 1, 0, 1, 0, 1] + [1, 1, 1, 0, 1, 1, 1, 1, 0, 1]
    table = t.table()["8-15, N 8"]
    assert table["ragged"] and table["padded_ms"] == 10.0 and table["ragged_ms"] == 6.0 and table["samples"] == [5, 11]


def test_a_faster_padded_path_stays_and_ragged_is_only_explored():
    t = RaggedTuner(TunerOptions(warmup=2, explore_every=4), clock=FakeClock(padded=5.0, ragged=9.0))
    assert run(t, 1, 12) == [0, 1, 0, 1] + [0, 0, 0, 1, 0, 0, 0, 1]
    assert not t.table()["1, N 8"]["ragged"]


@pytest.mark.parametrize("ragged_ms, want", [(9.8, 0), (9.6, 1)])
def test_the_other_path_must_win_by_the_margin(ragged_ms, want):
    t = RaggedTuner(TunerOptions(warmup=1, explore_every=100, margin=0.03), clock=FakeClock(10.0, ragged_ms))
    assert run(t, 4, 4)[2:] == [want, want]


def test_a_decided_path_switches_back_when_the_other_wins_by_the_margin():
    clock = FakeClock(padded=10.0, ragged=5.0)
    t = RaggedTuner(TunerOptions(warmup=1, explore_every=2, smoothing=1.0), clock=clock)
    assert run(t, 2, 4) == [0, 1, 1, 0]  # ragged decided; the 4th verify explores padded
    clock.ms = {0: 4.0, 1: 5.0}  # padded now faster: the next exploration's sample switches it
    assert run(t, 2, 4) == [1, 0, 0, 1]


def test_buckets_decide_apart():
    t = RaggedTuner(TunerOptions(warmup=1, explore_every=1000), clock=FakeClock(10.0, 5.0))
    assert run(t, 1, 3) == [0, 1, 1]
    assert run(t, 16, 3) == [0, 1, 1]  # its own warm-up, not bucket 1's decision
    assert set(t.table()) == {"1, N 8", "16-31, N 8"}


class WidthClock(FakeClock):
    """A verify at width N takes ``ms[(N, path)]``."""

    def end(self, _, key):
        (_, n), path = key
        self.pending.append((key, self.ms[(n, path)]))


def test_verify_widths_decide_apart():
    """SGLang's adaptive speculation moves a chain server's N between rounds: at N 2 ragged wins, at N 8 padded
    does, and rounds alternating between the widths decide each on its own samples (one bucket for both would
    compare a ragged N 2 verify with a padded N 8 one and take ragged for both)."""
    clock = WidthClock(0.0, 0.0)
    clock.ms = {(2, 0): 4.0, (2, 1): 2.0, (8, 0): 10.0, (8, 1): 12.0}
    t = RaggedTuner(TunerOptions(warmup=2, explore_every=1000), clock=clock)
    paths = {2: [], 8: []}
    for _ in range(8):
        for n in (2, 8):
            paths[n] += run(t, 4, 1, n=n)
    assert paths == {2: [0, 1, 0, 1, 1, 1, 1, 1], 8: [0, 1, 0, 1, 0, 0, 0, 0]}
    table = t.table()
    assert set(table) == {"4-7, N 2", "4-7, N 8"} and table["4-7, N 2"]["ragged"] and not table["4-7, N 8"]["ragged"]
    assert table["4-7, N 8"]["padded_ms"] == 10.0 and table["4-7, N 2"]["ragged_ms"] == 2.0


def test_padded_until_the_samples_have_finished_on_the_device():
    clock = FakeClock(padded=10.0, ragged=5.0, held=True)
    t = RaggedTuner(TunerOptions(warmup=2, explore_every=1000), clock=clock)
    assert run(t, 4, 6) == [0, 1, 0, 1, 0, 0]  # no sample read back yet: undecided is padded
    clock.held = False
    assert run(t, 4, 2) == [1, 1]


class Bus:
    """A verify group's CPU channel across tuners called in turn, rank 0 first each round."""

    def __init__(self):
        self.sent, self.received = [], 0

    def member(self, rank):
        def broadcast_object(obj, src=0):  # rank 1's k-th call receives rank 0's k-th message
            assert src == 0
            if rank == 0:
                self.sent.append(obj)
                return obj
            self.received += 1
            return self.sent[self.received - 1]
        return SimpleNamespace(world_size=2, rank_in_group=rank, broadcast_object=broadcast_object)


def test_ranks_run_rank_0s_decisions_at_the_agreements_only():
    """Rank 1 measures the same times but proposes the opposite (a faulty rank): both ranks run the same path
    every verify; a decision takes effect at the next agreement (every 3 verifies), not before."""
    opts = TunerOptions(warmup=2, explore_every=6, agree_every=3)
    bus = Bus()
    ranks = [RaggedTuner(opts, clock=FakeClock(10.0, 5.0)),
             RaggedTuner(opts, clock=FakeClock(10.0, 5.0), contrary=True)]
    groups = [bus.member(0), bus.member(1)]
    paths = [[], []]
    for _ in range(14):
        for k in (0, 1):
            paths[k] += run(ranks[k], 4, 1, groups[k])
    assert paths[0] == paths[1]
    # warm-up 4 (rank 0 has both paths' samples after it, but alone it would decide at verify 5); padded with
    # ragged explored at verify 6, until the agreement before verify 7; then ragged, padded explored at verify 12
    assert paths[0] == [0, 1, 0, 1] + [0, 1] + [1, 1, 1, 1, 1, 0, 1, 1]
    assert ranks[1].proposal(ranks[1].buckets[(3, N)]) is False and ranks[0].proposal(ranks[0].buckets[(3, N)]) is True
    assert len(bus.sent) == bus.received == 5  # before verifies 1, 4, 7, 10, 13


def test_alone_a_rank_uses_its_own_proposal_at_once():
    t = RaggedTuner(TunerOptions(warmup=1, explore_every=1000), clock=FakeClock(10.0, 5.0), contrary=True)
    assert run(t, 1, 4) == [0, 1, 0, 0]  # its own (contrary) proposal, with no group to overrule it


def turns(t: RaggedTuner, bs: int, compacts: list) -> list:
    """The paths ``t`` chose for verifies whose batches can (True) or cannot (False) be compacted: a ragged verify
    of a batch that cannot ran padded, no sample (as :func:`ragged_verify_forward` marks it)."""
    out = []
    for can in compacts:
        r = t.choose(bs, N)
        with t.timed(bs, N, r, "cpu") as sample:
            sample.kept = can or not r
        out.append(int(r))
    return out


def test_a_ragged_turn_with_nothing_to_compact_passes_to_the_next_verify():
    """Warm-up 2: the ragged turns go to the first batches that compact, so the bucket decides on 2 ragged samples
    after its 4 turns instead of deciding padded with none."""
    t = RaggedTuner(TunerOptions(warmup=2, explore_every=100), clock=FakeClock(padded=10.0, ragged=5.0))
    assert turns(t, 4, [True, False, False, True, True, False, True]) == [0, 1, 1, 1, 0, 1, 1]
    assert t.table()["4-7, N 8"]["samples"] == [2, 2]
    assert turns(t, 4, [True, True]) == [1, 1] and t.table()["4-7, N 8"]["ragged"]


def test_a_load_that_never_compacts_passes_a_turn_on_at_most_warmup_times():
    """Nothing ever compacts: each warm-up ragged turn is tried on 1 + warmup verifies, then taken; once decided
    padded, each exploration turn too (explore_every 4: turns at the bucket's verifies 7, 11, ...)."""
    t = RaggedTuner(TunerOptions(warmup=2, explore_every=4), clock=FakeClock(padded=10.0, ragged=5.0))
    got = turns(t, 1, [False] * 20)
    assert got == [0, 1, 1, 1, 0, 1, 1, 1] + [0, 0, 0, 1, 1, 1] + [0, 0, 0, 1, 1, 1]
    assert t.table()["1, N 8"]["samples"] == [8, 0] and not t.table()["1, N 8"]["ragged"]


def test_a_decided_ragged_bucket_passes_nothing_on():
    """Decided ragged, a batch with nothing to compact runs padded on its ragged turn and the schedule moves on
    (the padded exploration comes at its place)."""
    t = RaggedTuner(TunerOptions(warmup=1, explore_every=3), clock=FakeClock(padded=10.0, ragged=5.0))
    assert turns(t, 2, [True, True, True]) == [0, 1, 0]  # warm-up, then ragged decided: verify 2 explores padded
    assert turns(t, 2, [False, False, True]) == [1, 1, 0]  # verifies 3, 4 ragged (ran padded), 5 explores


def test_a_failed_verify_is_no_sample_and_gives_its_clock_pair_back():
    """A verify forward that raises inside ``timed``: the error reaches the caller, the clock's pair is cancelled
    (a device clock's two events are used again) and no sample is ended."""
    class Recording(FakeClock):
        def __init__(self):
            super().__init__(padded=10.0, ragged=5.0)
            self.begun, self.cancelled = 0, []

        def begin(self):
            self.begun += 1
            return ("pair", self.begun)

        def cancel(self, pair):
            self.cancelled.append(pair)

    clock = Recording()
    t = RaggedTuner(TunerOptions(warmup=2), clock=clock)
    t.choose(2, N)
    with pytest.raises(RuntimeError, match="verify failed"):
        with t.timed(2, N, False, "cpu"):
            raise RuntimeError("verify failed")
    assert clock.cancelled == [("pair", 1)] and clock.pending == []
    with t.timed(2, N, False, "cpu"):
        pass
    assert clock.cancelled == [("pair", 1)] and len(clock.pending) == 1  # a forward that returns is a sample


def test_a_rank_out_of_step_raises_at_the_agreement():
    opts = TunerOptions(warmup=1, agree_every=2)
    bus = Bus()
    first, late = RaggedTuner(opts, clock=FakeClock(1.0, 1.0)), RaggedTuner(opts, clock=FakeClock(1.0, 1.0))
    run(first, 1, 3, bus.member(0))  # agreements before verifies 1 and 3
    run(late, 1, 1, bus.member(1))
    with pytest.raises(RuntimeError, match="this rank has run 0 tuned verifies, rank 0 2: the ranks are out of step"):
        late.verifies = 0  # restarted
        run(late, 1, 1, bus.member(1))


class DriftClock(FakeClock):
    """Both paths 1% slower every verify (a growing context); ragged stays 20% slower than padded."""

    def __init__(self):
        super().__init__(padded=10.0, ragged=12.0)
        self.t = 0

    def end(self, _, key):
        self.pending.append((key, self.ms[key[1]] * 1.01 ** self.t))
        self.t += 1


def test_a_growing_context_does_not_make_the_seldom_run_path_look_faster():
    """The other path is sampled once in ``explore_every`` verifies, so its own mean lags behind the context;
    each of its samples is compared with the current path's mean when it arrives, which keeps the 20% gap."""
    t = RaggedTuner(TunerOptions(warmup=2, explore_every=8), clock=DriftClock())
    paths = run(t, 4, 200)
    assert paths[4:] == [int(n % 8 == 7) for n in range(4, 200)]  # padded, ragged only explored
    assert t.table()["4-7, N 8"]["ratio"] == pytest.approx(1.2, rel=0.1)  # the current mean lags a few verifies


def test_after_a_switch_one_late_sample_of_the_old_path_does_not_switch_back():
    """On a GPU the verifies still in flight at a switch report after it: the decision waits for ``warmup``
    samples of the other path against the new one before switching again."""
    clock = FakeClock(padded=10.0, ragged=5.0)
    t = RaggedTuner(TunerOptions(warmup=2, explore_every=1000), clock=clock)
    assert run(t, 4, 5) == [0, 1, 0, 1, 1]  # ragged decided at the 5th verify
    clock.pending.append(((bucket(4, N), 0), 1.0))  # a padded verify's sample arriving late, far faster
    assert run(t, 4, 1) == [1]
    clock.pending.append(((bucket(4, N), 0), 1.0))  # a second one: now the ratio stands on warmup samples
    assert run(t, 4, 1) == [0]


# ---------------------------------------------------------------------------- gaps found by mutation (group tuner)
class ListClock(FakeClock):
    """Each timed forward of a path takes the next of ``times[path]``."""

    def __init__(self, padded, ragged):
        super().__init__(0.0, 0.0)
        self.times = {0: list(padded), 1: list(ragged)}

    def end(self, _, key):
        self.pending.append((key, self.times[key[1]].pop(0)))


def test_means_and_ratios_are_exponential_with_the_smoothing_weight():
    """Padded samples 10 then 20 (mean 0.75 * 10 + 0.25 * 20), ragged 5 then 7 against padded's mean when each
    arrives (ratios 0.5 then 0.7 / 12.5, their mean weighted alike)."""
    t = RaggedTuner(TunerOptions(warmup=10, smoothing=0.25), clock=ListClock([10.0, 20.0], [5.0, 7.0]))
    for path in (False, True, False, True):
        with t.timed(2, N, path, "cpu"):
            pass
    row = t.table()["2-3, N 8"]  # a bucket made from its samples alone (no verify chosen there)
    assert row["padded_ms"] == pytest.approx(12.5) and row["ragged_ms"] == pytest.approx(0.75 * 5 + 0.25 * 7)
    assert row["ratio"] == pytest.approx(0.75 * 0.5 + 0.25 * 7 / 12.5) and row["samples"] == [2, 2]
    assert row["verifies"] == 0 and t.verifies == 0


def test_a_ratio_exactly_at_the_margin_does_not_switch():
    t = RaggedTuner(TunerOptions(warmup=1, explore_every=100, margin=0.5, smoothing=1.0), clock=FakeClock(10.0, 5.0))
    assert run(t, 4, 4) == [0, 1, 0, 0]  # 5 / 10 = 1 - margin: not below it
    assert t.table()["4-7, N 8"]["verifies"] == 4 and t.verifies == 4


def test_a_group_without_a_world_size_is_one_rank():
    t = RaggedTuner(TunerOptions(warmup=1, explore_every=100, agree_every=1), clock=FakeClock(10.0, 5.0))
    assert run(t, 1, 3, group=SimpleNamespace()) == [0, 1, 1]  # no broadcast asked: it decides alone at once


def test_a_switch_is_logged_with_the_bucket_and_both_means(caplog):
    t = RaggedTuner(TunerOptions(warmup=1, explore_every=100), clock=FakeClock(10.0, 5.0))
    with caplog.at_level(logging.INFO, logger="treespec_sglang.plugin"):
        run(t, 4, 3)
        t._decide((4, 8), _Bucket(), True)  # a decision taken from rank 0 before this rank has any sample
        t._decide((4, 8), _Bucket(mean=[3.0, float("nan")], ragged=True), False)
    assert [r.getMessage() for r in caplog.records] == [
        "treespec ragged verify, batch size 4-7, N 8: ragged (padded 10.000 ms, ragged 5.000 ms a verify)",
        "treespec ragged verify, batch size 8-15, N 8: ragged (padded - ms, ragged - ms a verify)",
        "treespec ragged verify, batch size 8-15, N 8: padded (padded 3.000 ms, ragged - ms a verify)"]
