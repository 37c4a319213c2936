"""The server defaults' deprecated names for the batch's token cap: each warns, naming the new one, and sets the
same value (``configure(batch_budget=...)``, ``TREESPEC_BATCH_BUDGET``, ``ServerDefaults.batch_budget``)."""

import os

import pytest

from treespec_sglang.plugin import config as C
from treespec_sglang.plugin.config import ServerDefaults, configure, server_defaults


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    for k in (C.ENV_POLICY, C.ENV_CONFIG, C.ENV_TOKEN_CAP, C.ENV_BATCH_BUDGET):
        monkeypatch.delenv(k, raising=False)
    C._parse_defaults.cache_clear()  # the environment's warning comes once per parsed setting
    yield
    configure(None)


def test_configure_token_cap_is_exported_and_read_back():
    assert configure(None, token_cap=6).token_cap == 6
    assert os.environ[C.ENV_TOKEN_CAP] == "6" and server_defaults().token_cap == 6
    assert configure(None).token_cap is None and C.ENV_TOKEN_CAP not in os.environ


def test_configure_batch_budget_keyword_warns_and_sets_the_token_cap():
    with pytest.warns(DeprecationWarning, match=r"configure\(token_cap=\.\.\.\)"):
        d = configure(None, batch_budget=6)
    assert d == configure(None, token_cap=6) and server_defaults().token_cap == 6
    with pytest.warns(DeprecationWarning), pytest.raises(ValueError, match=r"give configure\(token_cap=\.\.\.\) only"):
        configure(None, None, 5, batch_budget=6)


def test_the_deprecated_environment_variable_is_read_when_the_new_one_is_unset(monkeypatch):
    monkeypatch.setenv(C.ENV_BATCH_BUDGET, "5")
    with pytest.warns(DeprecationWarning, match=C.ENV_TOKEN_CAP):
        assert server_defaults().token_cap == 5
    with pytest.warns(DeprecationWarning), pytest.raises(ValueError, match=f"{C.ENV_BATCH_BUDGET} must be an integer"):
        monkeypatch.setenv(C.ENV_BATCH_BUDGET, "many")
        server_defaults()
    monkeypatch.setenv(C.ENV_TOKEN_CAP, "7")
    assert server_defaults().token_cap == 7  # the new name wins
    configure(None, token_cap=3)
    assert C.ENV_BATCH_BUDGET not in os.environ  # configure clears the old name: it never shadows a new setting


def test_server_defaults_batch_budget_attribute_warns_and_reads_the_token_cap():
    d = ServerDefaults(token_cap=4)
    with pytest.warns(DeprecationWarning, match=r"ServerDefaults\.token_cap"):
        assert d.batch_budget == 4
    with pytest.raises(ValueError, match=r"--treespec-token-cap must be an integer in \[1, 1024\]"):
        ServerDefaults(token_cap=0)
