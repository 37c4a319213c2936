"""The server defaults: the token cap exported and read back, its range, and the operator's policy modules
(``TREESPEC_POLICY_MODULES``)."""

import os

import pytest

from treespec_sglang.plugin import config as C, settings
from treespec_sglang.plugin.config import ServerDefaults, configure, import_policy_modules, server_defaults


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    for k in (C.ENV_POLICY, C.ENV_CONFIG, C.ENV_TOKEN_CAP, C.ENV_POLICY_MODULES):
        monkeypatch.delenv(k, raising=False)
    C._parse_defaults.cache_clear()
    yield
    settings.thaw()  # a test that ran the draft worker's start froze them (configure would refuse)
    configure(None)


def test_configure_token_cap_is_exported_and_read_back():
    assert configure(None, token_cap=6).token_cap == 6
    assert os.environ[C.ENV_TOKEN_CAP] == "6" and server_defaults().token_cap == 6
    assert configure(None).token_cap is None and C.ENV_TOKEN_CAP not in os.environ


def test_a_bad_token_cap_names_the_flag_or_the_variable_and_the_range(monkeypatch):
    with pytest.raises(ValueError, match=r"--treespec-token-cap must be an integer in \[1, 1024\]"):
        ServerDefaults(token_cap=0)
    monkeypatch.setenv(C.ENV_TOKEN_CAP, "many")
    with pytest.raises(ValueError, match=r"TREESPEC_TOKEN_CAP must be an integer in \[1, 1024\], got 'many'"):
        server_defaults()


def test_the_names_removed_in_0_2_are_refused_not_read(monkeypatch):
    """``configure(batch_budget=)`` and ``TREESPEC_BATCH_BUDGET`` are gone (CHANGELOG): the keyword is a TypeError
    and the old variable no longer sets a cap."""
    with pytest.raises(TypeError, match="batch_budget"):
        configure(None, batch_budget=6)
    monkeypatch.setenv("TREESPEC_BATCH_BUDGET", "5")
    assert server_defaults().token_cap is None


def test_policy_modules_are_imported_and_a_missing_one_names_the_variable(monkeypatch):
    monkeypatch.setenv(C.ENV_POLICY_MODULES, " json , treespec_sglang.policies.talon ")
    assert import_policy_modules() == ["json", "treespec_sglang.policies.talon"]
    monkeypatch.setenv(C.ENV_POLICY_MODULES, "treespec_sglang.no_such_policies")
    with pytest.raises(ImportError, match="TREESPEC_POLICY_MODULES: cannot import 'treespec_sglang.no_such_policies'"):
        import_policy_modules()
    monkeypatch.delenv(C.ENV_POLICY_MODULES)
    assert import_policy_modules() == []


@pytest.mark.parametrize("raw,want", [(None, "dflt"), ("", "dflt"), ("  ", "dflt"), ("1", True), (" YES", True),
                                      ("On", True), ("true", True), ("0", False), ("no", False), ("OFF ", False),
                                      ("False", False), ("Auto", "auto")])
def test_every_operator_switch_reads_the_same_words(monkeypatch, raw, want):
    """One parser for the plugin's on/off variables (chain stop graph, ragged verify, profile ops / sync)."""
    if raw is None:
        monkeypatch.delenv("TREESPEC_TEST_SWITCH", raising=False)
    else:
        monkeypatch.setenv("TREESPEC_TEST_SWITCH", raw)
    assert C.env_switch("TREESPEC_TEST_SWITCH", "dflt", extra=("auto",)) == want


@pytest.mark.parametrize("raw", ["2", "enabled", "auto"])
def test_any_other_word_is_refused_naming_the_variable_and_the_words(monkeypatch, raw):
    monkeypatch.setenv("TREESPEC_TEST_SWITCH", raw)
    with pytest.raises(ValueError, match=r"TREESPEC_TEST_SWITCH must be one of 1 / 0 / true / false / on / off / "
                                         r"yes / no, got '" + raw + "'"):
        C.env_switch("TREESPEC_TEST_SWITCH")


@pytest.mark.parametrize("var", ["TREESPEC_CHAIN_STOP_GRAPH", "TREESPEC_RAGGED_VERIFY"])
def test_a_bad_switch_stops_the_server_at_start_on_one_rank_too(monkeypatch, var):
    """The draft worker's start (the ``init_lm_head`` hook) parses every switch, alone as in a TP group: a bad
    value stops the start instead of the first round that reads it."""
    from types import SimpleNamespace

    from treespec_sglang.plugin import hooks

    monkeypatch.setenv(var, "sometimes")
    with pytest.raises(ValueError, match=f"{var} must be one of"):
        hooks._draft_head(lambda self: None, SimpleNamespace())
