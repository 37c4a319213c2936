"""The plugin's Prometheus series and the bounded per-request stats (no server: a private registry)."""

from types import SimpleNamespace

import pytest

import treespec_sglang.plugin.metrics as M
import treespec_sglang.plugin.stats as S

pytest.importorskip("prometheus_client")


@pytest.mark.parametrize("message,field", [
    ("custom_params['treespec']: salf.budget must be in [1, 1024], got 0", "salf.budget"),
    ("custom_params['treespec']: policy must be one of ['c2t'], got 'x'", "policy"),
    ("custom_params['treespec']: talon: unknown parameter(s) ['z']; allowed: ['budget']", "talon"),
    ("custom_params['treespec']: c2t.classifier must be one of the server's registered classifiers", "c2t.classifier"),
    ("custom_params['treespec']: token_cap must be true or false, got 3", "token_cap"),
    ("something else entirely", "other"),
])
def test_refused_field(message, field):
    assert M.refused_field(message) == field


@pytest.fixture
def series(monkeypatch):
    """Fresh series on a private registry, installed as this process's scheduler series."""
    import prometheus_client

    reg = prometheus_client.CollectorRegistry()
    for cls in ("Counter", "Histogram"):
        real = getattr(prometheus_client, cls)
        monkeypatch.setattr(prometheus_client, cls, lambda *a, _r=real, **k: _r(*a, registry=reg, **k))
    s = M.SchedulerSeries({"model_name": "m", "tp_rank": 0})
    monkeypatch.setattr(M, "_scheduler", s)
    return s, reg


def _sample(reg, name, policy):
    return reg.get_sample_value(name, {"model_name": "m", "tp_rank": "0", "policy": policy}) or 0.0


def _req():
    return SimpleNamespace(customized_info=None, stream=False, finished=lambda: False)


def test_rounds_feed_lists_summary_and_series_alike(series):
    s, reg = series
    a, b = _req(), _req()
    rounds = {"a": [(5, 5, 2), (3, 3, 0), (8, 8, 4)], "b": [(1, 1, 0)]}
    for req, pol, key in ((a, "talon", "a"), (b, "none", "b")):
        for size, verified, accepted in rounds[key]:
            S.record_round(req, pol, "treespec_tree_sizes", size)
            S.record_round(req, pol, "treespec_verify_tokens", verified)
            S.record_round(req, pol, "treespec_accept_lengths", accepted)
    info = a.customized_info
    assert info["treespec_policy"] == ["talon"] and info["treespec_tree_sizes"] == [5, 3, 8]
    assert info["treespec_accept_lengths"] == [2, 0, 4] and info["treespec_verify_tokens"] == [5, 3, 8]
    assert info["treespec_summary"] == [{"rounds": 3, "tree_nodes": 16, "verified_tokens": 16,
                                         "accepted_tokens": 6, "lists_truncated": False}]
    assert _sample(reg, "treespec:requests_total", "talon") == 1 == _sample(reg, "treespec:requests_total", "none")
    assert _sample(reg, "treespec:rounds_total", "talon") == 3
    assert _sample(reg, "treespec:accepted_draft_tokens_total", "talon") == 6
    assert _sample(reg, "treespec:verified_tokens_total", "talon") == 16
    assert _sample(reg, "treespec:tree_size_count", "talon") == 3
    assert _sample(reg, "treespec:tree_size_sum", "talon") == 16
    assert reg.get_sample_value("treespec:tree_size_bucket", {"model_name": "m", "tp_rank": "0", "policy": "talon",
                                                             "le": "4.0"}) == 1
    assert reg.get_sample_value("treespec:accept_length_bucket", {"model_name": "m", "tp_rank": "0",
                                                                 "policy": "talon", "le": "2.0"}) == 2
    assert _sample(reg, "treespec:rounds_total", "none") == 1


def test_lists_are_capped_but_the_summary_counts_every_round(monkeypatch, series):
    monkeypatch.setenv(S.ENV_MAX_ROUNDS, "2")
    req = _req()
    for n in (4, 5, 6, 7):
        S.record_round(req, "salf", "treespec_accept_lengths", n)
    info = req.customized_info
    assert info["treespec_accept_lengths"] == [4, 5]
    assert info["treespec_summary"][0]["rounds"] == 4 and info["treespec_summary"][0]["accepted_tokens"] == 22
    assert info["treespec_summary"][0]["lists_truncated"]
    _, reg = series
    assert _sample(reg, "treespec:accepted_draft_tokens_total", "salf") == 22  # the metrics see every round


@pytest.mark.parametrize("raw", ["-1", "x"])
def test_bad_cap_names_the_variable(monkeypatch, raw):
    monkeypatch.setenv(S.ENV_MAX_ROUNDS, raw)
    with pytest.raises(ValueError, match="TREESPEC_STATS_MAX_ROUNDS must be an integer >= 0"):
        S.max_rounds()


def test_no_series_where_metrics_are_off(monkeypatch):
    monkeypatch.setattr(M, "_scheduler", None)
    req = _req()
    S.record_round(req, "talon", "treespec_tree_sizes", 3)  # no error, stats still recorded
    assert req.customized_info["treespec_tree_sizes"] == [3]
    M.count_refused("custom_params['treespec']: policy must be one of")  # metrics off: a no-op


def test_a_batch_round_records_each_request_under_its_own_policy(series):
    """``record_rounds``: one call per round for the whole batch; requests without a policy (None) are skipped, a
    request's other ``customized_info`` keys stay, and the series count each policy's requests apart."""
    s, reg = series
    a, b, c = _req(), _req(), _req()
    c.customized_info = {"someone_else": [1]}
    reqs, policies = [a, b, c], ["talon", None, "salf"]
    for sizes, accepted in (([5, 9, 3], [2, 7, 1]), ([4, 9, 6], [0, 7, 3])):
        S.record_rounds(reqs, policies, "treespec_tree_sizes", sizes)
        S.record_rounds(reqs, policies, "treespec_accept_lengths", accepted)
    assert b.customized_info is None
    assert a.customized_info["treespec_tree_sizes"] == [5, 4] and a.customized_info["treespec_accept_lengths"] == [2, 0]
    assert c.customized_info["someone_else"] == [1] and c.customized_info["treespec_policy"] == ["salf"]
    assert c.customized_info["treespec_summary"] == [{"rounds": 2, "tree_nodes": 9, "verified_tokens": 0,
                                                      "accepted_tokens": 4, "lists_truncated": False}]
    assert _sample(reg, "treespec:requests_total", "talon") == 1 == _sample(reg, "treespec:requests_total", "salf")
    assert _sample(reg, "treespec:accepted_draft_tokens_total", "salf") == 4
    assert _sample(reg, "treespec:tree_size_sum", "talon") == 9 and _sample(reg, "treespec:rounds_total", "talon") == 2
    S.record_rounds([_req()], ["c2t"], "treespec_tree_sizes", [4])  # a series appears with its first value only
    labels = {"model_name": "m", "tp_rank": "0", "policy": "c2t"}
    assert reg.get_sample_value("treespec:tree_size_count", labels) == 1
    assert reg.get_sample_value("treespec:rounds_total", labels) is None
