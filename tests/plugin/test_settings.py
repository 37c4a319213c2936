"""``plugin.settings``: the ``TREESPEC_*`` environment read live until the draft worker starts, then from one
snapshot; the hooks' per-round reads go through it, and the start's checks bind what the rounds read."""

import os
from types import SimpleNamespace

import pytest

from treespec_sglang.plugin import config, draft_select, hooks, ragged_support, ranks, settings, stats


def test_reads_are_live_until_frozen_then_the_snapshot_until_thawed(monkeypatch):
    monkeypatch.setenv("TREESPEC_TEST_SETTING", "a")
    assert settings.env("TREESPEC_TEST_SETTING") == "a" and not settings.frozen()
    monkeypatch.setenv("TREESPEC_TEST_SETTING", "b")
    assert settings.env("TREESPEC_TEST_SETTING") == "b"  # live
    settings.freeze()
    monkeypatch.setenv("TREESPEC_TEST_SETTING", "c")
    monkeypatch.setenv("TREESPEC_TEST_LATE", "x")
    assert settings.frozen()
    assert settings.env("TREESPEC_TEST_SETTING") == "b" and settings.env("TREESPEC_TEST_LATE", "unset") == "unset"
    settings.thaw()
    assert settings.env("TREESPEC_TEST_SETTING") == "c" and settings.env("TREESPEC_TEST_LATE") == "x"


@pytest.mark.parametrize("freeze", [False, True])
def test_only_treespec_variables_are_read_frozen_or_not(freeze):
    if freeze:
        settings.freeze()
    with pytest.raises(KeyError, match="TREESPEC_\\* variables only, not 'HOME'"):
        settings.env("HOME")


def test_the_draft_workers_start_freezes_what_every_round_reads(monkeypatch):
    """The hook that checks the settings at start (``init_lm_head``) freezes them: a later edit of the
    environment, even to a value the start would refuse, reaches no round."""
    monkeypatch.setenv(draft_select.ENV_SELECT, "torch")
    monkeypatch.setenv(stats.ENV_MAX_ROUNDS, "7")
    monkeypatch.setenv(config.ENV_POLICY, "talon")
    monkeypatch.delenv(config.ENV_CONFIG, raising=False)
    monkeypatch.delenv(config.ENV_TOKEN_CAP, raising=False)
    hooks._draft_head(lambda self: None, SimpleNamespace())
    assert settings.frozen()
    digest = ranks.settings_digest()
    for var, value in [(draft_select.ENV_SELECT, "sometimes"), (stats.ENV_MAX_ROUNDS, "-1"),
                       (config.ENV_POLICY, "salf"), (ragged_support.ENV_RAGGED, "maybe"), (ranks.ENV_DIGESTS, "/tmp")]:
        monkeypatch.setenv(var, value)
    assert draft_select.selection_mode() == "torch" and stats.max_rounds() == 7
    assert config.server_defaults().policy == "talon" and ragged_support.ragged_setting() == "auto"
    assert ranks.settings_digest() == digest
    settings.thaw()  # live again: the same reads see the edits (and refuse the bad ones)
    assert config.server_defaults().policy == "salf"
    with pytest.raises(ValueError, match=draft_select.ENV_SELECT):
        draft_select.selection_mode()


def test_configure_refuses_once_the_process_serves(monkeypatch):
    """In a process whose draft worker started, ``configure`` would change nothing the rounds read: it raises."""
    monkeypatch.delenv(config.ENV_POLICY, raising=False)
    settings.freeze()
    with pytest.raises(RuntimeError, match="call configure before starting the server"):
        config.configure("salf")
    assert config.ENV_POLICY not in os.environ  # nothing exported
    settings.thaw()
    assert config.configure("salf").policy == "salf" and os.environ[config.ENV_POLICY] == "salf"
    config.configure(None)


def test_a_round_reads_no_environment_once_frozen(monkeypatch):
    """One selecting eagle2 round through every hook (``bench/round_host_cost.py``'s stand-in round): no ``os.environ`` read
    after the freeze (about 1 us each on the host; a round read ten)."""
    from bench import round_host_cost

    a = round_host_cost.parser().parse_args(["--repeats", "1"])
    _, _, _, _, one = round_host_cost.measure("eagle2-small", 2, a)  # built, frozen while measured, thawed after
    reads = []
    real_get = type(os.environ).__getitem__
    monkeypatch.setattr(type(os.environ), "__getitem__", lambda self, k: reads.append(k) or real_get(self, k))
    with round_host_cost.patched(a):  # (entering and leaving it reads the whole environment)
        settings.freeze()
        reads.clear()
        one()
        assert reads == []
        settings.thaw()
        one()
        assert {draft_select.ENV_SELECT, config.ENV_POLICY, stats.ENV_MAX_ROUNDS} <= set(reads)  # live: read again


def test_a_derived_value_is_parsed_once_per_snapshot_and_every_call_while_live(monkeypatch):
    parsed = []

    @settings.derived
    def cap(scale=1):
        parsed.append(scale)
        raw = settings.env("TREESPEC_TEST_CAP", "4")
        if not raw.isdigit():
            raise ValueError(f"TREESPEC_TEST_CAP must be an integer, got {raw!r}")
        return int(raw) * scale

    monkeypatch.setenv("TREESPEC_TEST_CAP", "5")
    assert (cap(), cap(), len(parsed)) == (5, 5, 2)  # live: parsed each call
    settings.freeze()
    monkeypatch.setenv("TREESPEC_TEST_CAP", "6")
    assert (cap(), cap(), cap(2), cap(2), len(parsed)) == (5, 5, 10, 10, 4)  # once per snapshot and arguments
    settings.freeze()  # a new snapshot: parsed again
    assert (cap(), cap(), len(parsed)) == (6, 6, 5)
    monkeypatch.setenv("TREESPEC_TEST_CAP", "x")
    settings.freeze()
    for _ in range(2):  # a value that raises is not kept: it raises again
        with pytest.raises(ValueError, match="TREESPEC_TEST_CAP must be an integer, got 'x'"):
            cap()
    assert len(parsed) == 7
    settings.thaw()
    monkeypatch.setenv("TREESPEC_TEST_CAP", "7")
    assert cap() == 7


def test_a_frozen_round_parses_no_setting_after_its_first(monkeypatch):
    """After the first round under a snapshot, a round's settings (server defaults, selection, stats cap, ragged
    switch, debug switches) are kept values: ``settings.env`` is not called at all."""
    from bench import round_host_cost

    a = round_host_cost.parser().parse_args(["--repeats", "1"])
    _, _, _, _, one = round_host_cost.measure("eagle2-small", 2, a)
    calls = []
    real = settings.env
    with round_host_cost.patched(a):
        settings.freeze()
        one()
        monkeypatch.setattr(settings, "env", lambda *k: calls.append(k) or real(*k))
        for m in (config, draft_select, ragged_support, ranks, stats):
            monkeypatch.setattr(m, "env", settings.env)
        one()
        assert calls == []
        settings.thaw()
        one()
        assert {(draft_select.ENV_SELECT,), (config.ENV_POLICY,), (stats.ENV_MAX_ROUNDS,)} <= set(calls)
