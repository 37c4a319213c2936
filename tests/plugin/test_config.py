"""The server defaults: the token cap exported and read back, its range, and the operator's policy modules
(``TREESPEC_POLICY_MODULES``)."""

import os

import pytest

from tests.helpers import cli_flags
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


def test_a_flag_sets_its_own_setting_and_the_environment_keeps_the_others(monkeypatch):
    """``--treespec-policy`` beside ``TREESPEC_TOKEN_CAP`` (and the other way round): each flag replaces its own
    variable only; before, any flag cleared every variable it did not name."""
    import os

    from treespec_sglang.plugin.server_hooks import _from_cli_args

    for var in (C.ENV_POLICY, C.ENV_CONFIG, C.ENV_TOKEN_CAP):  # configure exports: restored (unset) at teardown
        monkeypatch.setenv(var, "")
    monkeypatch.setenv(C.ENV_TOKEN_CAP, "8")
    _from_cli_args(None, None, cli_flags(policy="talon"))
    assert (os.environ[C.ENV_POLICY], os.environ[C.ENV_TOKEN_CAP]) == ("talon", "8")
    monkeypatch.setenv(C.ENV_POLICY, "salf")
    monkeypatch.setenv(C.ENV_CONFIG, '{"th": 0.3}')
    _from_cli_args(None, None, cli_flags(token_cap=16))
    d = C.server_defaults()
    assert (d.policy, d.config, d.token_cap) == ("salf", {"th": 0.3}, 16)
    _from_cli_args(None, None, cli_flags(config='{"th": 0.5}'))  # the environment's policy, the flag's parameters
    assert C.server_defaults().config == {"th": 0.5} and C.server_defaults().policy == "salf"


@pytest.mark.parametrize("config,match", [
    ([["budget", 8]], "--treespec-config must be a JSON object of the policy's parameters, got list"),
    ({"policy": "salf", "budget": 8}, "--treespec-config must not name the policy .*got 'policy': 'salf'"),
])
def test_a_config_that_is_not_a_parameter_object_is_refused(config, match):
    with pytest.raises(ValueError, match=match):
        C.configure("talon", config)


@pytest.mark.parametrize("raw", ["null", "[]", "0", '"x"'])
def test_a_flag_or_variable_config_that_is_not_an_object_is_refused_by_name(monkeypatch, raw):
    from treespec_sglang.plugin.server_hooks import _from_cli_args

    for var in (C.ENV_POLICY, C.ENV_CONFIG, C.ENV_TOKEN_CAP):  # restored at teardown, should configure export
        monkeypatch.setenv(var, "")
    with pytest.raises(ValueError, match="--treespec-config must be a JSON object of the policy's parameters"):
        _from_cli_args(None, None, cli_flags(policy="talon", config=raw))
    monkeypatch.setenv(C.ENV_POLICY, "talon")
    monkeypatch.setenv(C.ENV_CONFIG, raw)
    with pytest.raises(ValueError, match="TREESPEC_POLICY/TREESPEC_CONFIG/TREESPEC_TOKEN_CAP: must be a JSON object"):
        C.server_defaults()


def test_defaults_set_in_the_environment_are_checked_at_start_on_one_rank(monkeypatch):
    """Without flags nothing parsed ``TREESPEC_*`` before the first request, and a single rank compares no
    digest: a bad token cap then aborted every request, and a tree policy on a chain server every request
    that had none. The draft worker's start refuses both."""
    from types import SimpleNamespace

    from treespec_sglang.plugin import hooks

    monkeypatch.setenv(C.ENV_TOKEN_CAP, "0")
    with pytest.raises(ValueError, match=r"--treespec-token-cap must be an integer in \[1, 1024\]"):
        hooks._draft_head(lambda self: None, SimpleNamespace())
    monkeypatch.delenv(C.ENV_TOKEN_CAP)
    monkeypatch.setenv(C.ENV_POLICY, "talon")
    chain = SimpleNamespace(server_args=SimpleNamespace(speculative_algorithm="EAGLE", speculative_eagle_topk=1))
    with pytest.raises(ValueError, match=r"the default policy \(TREESPEC_POLICY\): talon needs a draft tree"):
        hooks._draft_head(lambda self: None, chain)
    tree = SimpleNamespace(server_args=SimpleNamespace(speculative_algorithm="EAGLE", speculative_eagle_topk=4))
    assert hooks._draft_head(lambda self: "built", tree) == "built"


def test_relaxed_accept_thresholds_are_warned_about_without_treespec_flags_too(caplog):
    """Requests can carry policies on a server started without any ``--treespec-*`` flag."""
    import logging

    from treespec_sglang.plugin.server_hooks import _from_cli_args

    args = cli_flags(speculative_accept_threshold_single=0.5, speculative_accept_threshold_acc=1.0)
    with caplog.at_level(logging.WARNING, logger="treespec_sglang.plugin"):
        _from_cli_args(None, None, args)
    assert "relaxes verification" in caplog.text


def test_a_token_cap_on_a_chain_server_is_refused_at_start(monkeypatch):
    """A chain has no nodes to choose among: the cap would do nothing, silently."""
    from types import SimpleNamespace

    from treespec_sglang.plugin import hooks

    monkeypatch.setenv(C.ENV_TOKEN_CAP, "8")
    with pytest.raises(ValueError, match=r"--treespec-token-cap \(TREESPEC_TOKEN_CAP\) selects among a draft tree"):
        hooks._draft_head(lambda self: None, SimpleNamespace(topk=1))
    assert hooks._draft_head(lambda self: "built", SimpleNamespace()) == "built"  # a tree server: fine



def test_an_explicit_ragged_verify_on_a_sliding_window_target_is_refused_at_start(monkeypatch):
    """The draft worker's start reads its target's runner: TREESPEC_RAGGED_VERIFY=1 with a sliding-window target
    refuses to start, naming the reason; the same target starts under auto (it verifies padded)."""
    from types import SimpleNamespace

    from treespec_sglang.plugin import hooks

    worker = SimpleNamespace(target_worker=SimpleNamespace(model_runner=SimpleNamespace(sliding_window_size=4096)))
    monkeypatch.setenv("TREESPEC_RAGGED_VERIFY", "1")
    with pytest.raises(ValueError, match="TREESPEC_RAGGED_VERIFY=1 cannot verify ragged with a sliding-window"):
        hooks._draft_head(lambda self: None, worker)
    monkeypatch.delenv("TREESPEC_RAGGED_VERIFY")
    assert hooks._draft_head(lambda self: "built", worker) == "built"


@pytest.mark.parametrize("cap,ok", [(1, True), (1024, True), (0, False), (1025, False), (True, False), (2.0, False),
                                    ("8", False)])
def test_the_token_cap_is_an_int_from_1_to_1024_never_a_bool(cap, ok):
    if ok:
        assert ServerDefaults(token_cap=cap).token_cap == cap
        return
    with pytest.raises(ValueError) as e:
        ServerDefaults(token_cap=cap)
    assert str(e.value) == ("--treespec-token-cap must be an integer in [1, 1024] (verified tokens per request per "
                            f"round, on average over the batch), got {cap!r}")


def test_a_config_without_a_policy_and_configure_while_serving_are_refused_with_the_way_out():
    with pytest.raises(ValueError) as e:
        ServerDefaults(None, {"budget": 8})
    assert str(e.value) == "--treespec-config needs --treespec-policy"
    settings.freeze()
    with pytest.raises(RuntimeError) as e:
        configure("talon")
    assert str(e.value) == ("treespec.configure: this process already serves with the settings it started with "
                            "(frozen when its draft worker started); call configure before starting the server")


def test_configure_keeps_its_own_copy_of_the_config():
    mine = {"budget": 9}
    d = configure("talon", mine)
    mine["budget"] = 3  # the caller's dict edited afterwards
    assert d.config == {"budget": 9} and server_defaults().config == {"budget": 9}


def test_a_config_that_is_not_json_names_its_source():
    with pytest.raises(ValueError) as e:
        C.load_config("{", "--treespec-config")
    assert str(e.value).startswith("--treespec-config must be a JSON object: Expecting property name")


def test_an_unset_switch_is_off_unless_a_default_is_given(monkeypatch):
    monkeypatch.delenv("TREESPEC_EXAMPLE", raising=False)
    assert C.env_switch("TREESPEC_EXAMPLE") is False and C.env_switch("TREESPEC_EXAMPLE", "auto") == "auto"
    monkeypatch.setenv("TREESPEC_EXAMPLE", " ")
    assert C.env_switch("TREESPEC_EXAMPLE") is False
