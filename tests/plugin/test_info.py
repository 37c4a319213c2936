"""``/server_info``'s ``treespec`` section (``plugin.info``): what it reports of the operator's settings."""

import pytest

from treespec_sglang.plugin.info import server_info
from treespec_sglang.plugin.ragged_support import ENV_RAGGED


@pytest.mark.parametrize("env, shown", [(None, "auto"), ("auto", "auto"), ("1", "on"), ("off", "off"),
                                        ("tuned", "tuned")])
def test_the_ragged_verify_setting_is_reported_as_the_server_reads_it(monkeypatch, env, shown):
    monkeypatch.delenv(ENV_RAGGED, raising=False) if env is None else monkeypatch.setenv(ENV_RAGGED, env)
    info = server_info()
    assert info["ragged_verify"] == shown
    assert set(info) == {"chain_stop_graph", "classifiers", "default_policy", "policies", "ragged_verify", "selection",
                         "sglang", "stats_max_rounds", "token_cap", "version"}
