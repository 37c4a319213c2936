"""The ragged verify tuner's options (``TREESPEC_RAGGED_TUNING``: each field and bound, refused naming the variable
and the field, checked at server start, part of the ranks' settings digest), its clocks (host and device: finished
samples read in order, without a sync) and the process's one tuner."""

import re
import time

import pytest
import torch

from treespec_sglang.plugin import ragged_tuner
from treespec_sglang.plugin.ragged_support import ENV_RAGGED
from treespec_sglang.plugin.ragged_tuner import (ENV_TUNING, DeviceClock, HostClock, RaggedTuner, TunerOptions,
                                                 clock_for)


@pytest.mark.parametrize("raw, field", [("warmup=0", "warmup"), ("explore_every=1", "explore_every"),
                                        ("agree_every=2000000", "agree_every"), ("margin=1", "margin"),
                                        ("smoothing=0", "smoothing"), ("warmup=x", "warmup"), ("depth=3", "name"),
                                        ("warmup", "name"), ("warmup=2,warmup=3", "warmup given twice")])
def test_bad_tuning_names_the_variable_and_the_field(raw, field):
    with pytest.raises(ValueError, match=rf"{ENV_TUNING}: .*{field}"):
        TunerOptions.parse(raw)


def test_tuning_parses_each_field_and_defaults_the_rest():
    o = TunerOptions.parse(" warmup=2 , margin=0.1,")
    assert (o.warmup, o.margin, o.explore_every) == (2, 0.1, TunerOptions().explore_every)
    assert TunerOptions.parse("") == TunerOptions()


def test_a_bad_tuning_stops_the_server_start(monkeypatch):
    from treespec_sglang.plugin.server_hooks import check_environment

    monkeypatch.setenv(ENV_TUNING, "warmup=-1")
    with pytest.raises(ValueError, match="TREESPEC_RAGGED_TUNING: warmup"):
        check_environment()


def test_the_ragged_setting_and_tuning_are_part_of_the_ranks_settings_digest(monkeypatch):
    from treespec_sglang.plugin.ranks import settings_digest

    base = settings_digest()
    monkeypatch.setenv(ENV_RAGGED, "tuned")
    tuned = settings_digest()
    monkeypatch.setenv(ENV_TUNING, "warmup=7")
    assert len({base, tuned, settings_digest()}) == 3


def test_clocks_by_device():
    assert isinstance(clock_for("cpu"), HostClock) and isinstance(clock_for(torch.device("cuda", 0)), DeviceClock)


def test_the_host_clock_times_the_block():
    t = RaggedTuner(TunerOptions())
    with t.timed(1, 8, True, "cpu"):
        time.sleep(0.02)
    ((key, ms),) = t.clock.finished()
    assert key == ((1, 8), 1) and 20.0 <= ms < 1000.0 and t.clock.finished() == []


def test_a_failed_forward_is_not_a_sample():
    t = RaggedTuner(TunerOptions(), clock=HostClock())
    with pytest.raises(RuntimeError):
        with t.timed(1, 8, True, "cpu"):
            raise RuntimeError("forward failed")
    assert t.clock.finished() == []


@pytest.mark.gpu
def test_the_device_clock_reads_finished_events_without_a_sync():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    c = DeviceClock()
    x = torch.randn(2048, 2048, device="cuda")
    pair = c.begin()
    for _ in range(20):
        x = x @ x / 2048
    c.end(pair, (1, 0))
    torch.cuda.synchronize()
    ((key, ms),) = c.finished()
    assert key == (1, 0) and ms > 0 and len(c.free) == 1
    again = c.begin()
    assert again[0] is pair[0] and again[1] is pair[1]  # the pair's events are reused


# ---------------------------------------------------------------------------- gaps found by mutation (group tuner)
@pytest.mark.parametrize("raw, message", [
    ("warmup=1000001", "warmup must be an integer in [1, 1000000], got 1000001"),
    ("agree_every=0", "agree_every must be an integer in [1, 1000000], got 0"),
    ("margin=-0.01", "margin must be in [0, 1), got -0.01"),
    ("smoothing=1.5", "smoothing must be in (0, 1], got 1.5"),
    ("warmup=2.5", "warmup must be an integer, got '2.5'"),
    ("margin=x", "margin must be a number, got 'x'"),
    ("warmup=4=5", "warmup must be an integer, got '4=5'"),
])
def test_each_tuning_bound_is_refused_to_the_letter(raw, message):
    with pytest.raises(ValueError, match=re.escape(f"{ENV_TUNING}: {message}")):
        TunerOptions.parse(raw)


def test_each_tuning_bound_itself_is_taken():
    o = TunerOptions.parse("warmup=1000000,agree_every=1,explore_every=2,margin=0,smoothing=1")
    assert (o.warmup, o.agree_every, o.explore_every, o.margin, o.smoothing) == (1000000, 1, 2, 0.0, 1.0)
    assert type(o.margin) is float and type(o.warmup) is int and TunerOptions.parse("margin=1e-1").margin == 0.1


def test_the_host_clock_reports_milliseconds(monkeypatch):
    now = iter([2.0, 2.5])
    monkeypatch.setattr(ragged_tuner.time, "perf_counter", lambda: next(now))
    c = HostClock()
    c.end(c.begin(), (3, 1))
    assert c.finished() == [((3, 1), 500.0)]


def test_the_process_tuner_is_made_once_and_honest_unless_asked(monkeypatch):
    monkeypatch.setenv(ENV_TUNING, "warmup=3")
    t = ragged_tuner.tuner()
    assert t.contrary is False and t.options.warmup == 3 and ragged_tuner.tuner(contrary=True) is t
    ragged_tuner._TUNER[0] = None
    assert ragged_tuner.tuner(contrary=True).contrary is True


class FakeEvent:
    """A CUDA event stand-in: ``query`` is what the test says; ``elapsed_time`` the difference of the stamps, refused
    (as CUDA refuses it) unless both events were made with timing on."""

    def __init__(self, enable_timing=False):
        self.stamp, self.done, self.records, self.timing = None, False, 0, enable_timing is True

    def record(self):
        self.records += 1

    def query(self):
        return self.done

    def elapsed_time(self, other):
        if not (self.timing and other.timing):
            raise RuntimeError("Both events must be created with argument 'enable_timing=True'.")
        return other.stamp - self.stamp


def test_the_device_clock_reads_finished_pairs_in_order_and_reuses_them(monkeypatch):
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    c = DeviceClock()
    a, b = c.begin(), c.begin()
    assert a[0] is not b[0] and a[0].records == 1 and a[1].records == 0
    for (start, stop), (t0, t1) in ((a, (1.0, 4.0)), (b, (5.0, 5.5))):
        start.stamp, stop.stamp = t0, t1
    c.end(a, (2, 0))
    c.end(b, (2, 1))
    assert a[1].records == 1 and c.finished() == []  # nothing done yet
    b[1].done = True
    assert c.finished() == []  # the older pair still runs: read in order
    a[1].done = True
    assert c.finished() == [((2, 0), 3.0), ((2, 1), 0.5)] and c.finished() == []
    assert c.free == [a, b] and c.begin()[0] is b[0] and c.begin()[0] is a[0]  # finished pairs used again
    d = c.begin()
    assert d[0].records == 1 and a[0].records == 2
    c.cancel(d)
    assert c.free == [d] and not c.pending
