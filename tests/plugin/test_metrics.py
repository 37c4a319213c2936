"""The plugin's Prometheus series and the bounded per-request stats (no server: a private registry)."""

from types import SimpleNamespace

import pytest
import torch

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
    # a label names a registered policy and its field, never a client's string (the series stay bounded)
    ("custom_params['treespec']: zzz123.abc: a client's own text", "other"),
    ("custom_params['treespec']: talon.zzz must be", "talon"),
    ("custom_params['treespec']: policy.budget must be", "other"),
])
def test_refused_field(message, field):
    assert M.refused_field(message) == field


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
    S.summary_of(a)  # what the output hook does when the request finishes
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
    assert S.summary_of(req) is info["treespec_summary"][0]
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
    assert S.summary_of(b) is None
    assert [S.summary_of(c)] == c.customized_info["treespec_summary"] == [{"rounds": 2, "tree_nodes": 9, "verified_tokens": 0,
                                                      "accepted_tokens": 4, "lists_truncated": False}]
    assert _sample(reg, "treespec:requests_total", "talon") == 1 == _sample(reg, "treespec:requests_total", "salf")
    assert _sample(reg, "treespec:accepted_draft_tokens_total", "salf") == 4
    assert _sample(reg, "treespec:tree_size_sum", "talon") == 9 and _sample(reg, "treespec:rounds_total", "talon") == 2
    S.record_rounds([_req()], ["c2t"], "treespec_tree_sizes", [4])  # a series appears with its first value only
    labels = {"model_name": "m", "tp_rank": "0", "policy": "c2t"}
    assert reg.get_sample_value("treespec:tree_size_count", labels) == 1
    assert reg.get_sample_value("treespec:rounds_total", labels) is None


def _buckets(reg, name, labels):
    """``{le: cumulative count}``, the count and the sum of histogram ``name`` as the registry exports them."""
    out = {}
    for metric in reg.collect():
        for smp in metric.samples:
            if smp.name.startswith(name) and not smp.name.endswith("_created") and \
                    all(smp.labels.get(k) == v for k, v in labels.items()):
                out[(smp.name[len(name):], smp.labels.get("le"))] = smp.value
    return out


@pytest.mark.parametrize("seed", range(3))
def test_bulk_observe_equals_observing_one_value_at_a_time(seed):
    """``observe_all`` against the library's own ``observe`` per value on a twin histogram: every bucket (values on
    the bounds, between them, above the last, repeated), the count and the sum."""
    import random

    import prometheus_client

    rng = random.Random(seed)
    reg = prometheus_client.CollectorRegistry()
    ours, twin = (prometheus_client.Histogram(n, "h", ["policy"], buckets=M.TREE_SIZE_BUCKETS, registry=reg)
                  for n in ("ours", "twin"))
    child = ours.labels(policy="p")
    assert M.bulk_observable(child)
    for _ in range(4):  # rounds
        values = [rng.choice([0, 1, 2, 3, 8, 9, 64, 100, 1024, 1025, 5000]) for _ in range(rng.randint(0, 70))]
        M.observe_all(child, values)
        for v in values:
            twin.labels(policy="p").observe(v)
    got, want = _buckets(reg, "ours", {"policy": "p"}), _buckets(reg, "twin", {"policy": "p"})
    assert got == want and got[("_count", None)] > 0


def test_an_unknown_histogram_layout_observes_one_value_at_a_time_and_says_so(series, caplog):
    s, reg = series

    class Observed:  # a histogram child without the layout the bulk path writes into
        def __init__(self):
            self.values = []

        def observe(self, v):
            self.values.append(v)

    child = Observed()
    assert not M.bulk_observable(child)
    s._children[(s.tree_size, "talon")] = child
    with caplog.at_level("WARNING", logger="treespec_sglang.plugin"):
        s.drafted("talon", [4, 8, 4])
    assert child.values == [4, 8, 4] and s.bulk is False
    assert [r.getMessage() for r in caplog.records] == [
        "treespec: prometheus_client's histogram layout is not the one known here: the treespec:tree_size / "
        "accept_length histograms observe one value at a time"]


def test_bulk_observe_in_multiprocess_mode_as_sglang_runs_it(tmp_path):
    """SGLang's ``--enable-metrics`` runs prometheus_client in multiprocess mode (mmapped values, aggregated by the
    HTTP server's collector): a scheduler process's bulk rounds aggregate to the per-value twin's buckets."""
    import subprocess
    import sys

    code = """
import prometheus_client
from treespec_sglang.plugin import metrics as M
s = M.SchedulerSeries({"model_name": "m"})
twin = prometheus_client.Histogram("twin", "h", ["model_name", "policy"], buckets=M.ACCEPT_LENGTH_BUCKETS)
for values in ([0, 1, 1, 7, 64, 65], [3, 3, 3], []):
    s.accepted_round("salf", values)
    for v in values:
        twin.labels(model_name="m", policy="salf").observe(v)
assert s.bulk is True, s.bulk
"""
    env = dict(__import__("os").environ, PROMETHEUS_MULTIPROC_DIR=str(tmp_path))
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    import prometheus_client
    from prometheus_client import multiprocess

    reg = prometheus_client.CollectorRegistry()
    multiprocess.MultiProcessCollector(reg, path=str(tmp_path))
    got = _buckets(reg, "treespec:accept_length", {"policy": "salf"})
    want = _buckets(reg, "twin", {"policy": "salf"})
    assert got == want and got[("_count", None)] == 9 and got[("_sum", None)] == 147


def test_verify_forwards_are_counted_by_the_path_the_target_ran(series, monkeypatch):
    """``hooks._runner_forward`` on a treespec round's verify: ``ragged`` when any request ran fewer than N
    tokens, ``padded`` when every one ran N; one increment per forward (the batch's, no policy label)."""
    from treespec_sglang.plugin import hooks
    from treespec_sglang.plugin.round import DraftStep, opened

    s, reg = series
    seen = iter([[3, 8], [8, 8], [2, 2]])  # what the verify forward reports per request
    monkeypatch.setattr(hooks, "ragged_verify_forward", lambda *a, **k: ("out", next(seen)))
    monkeypatch.setattr(hooks, "_record_verify_tokens", lambda reqs, verified: None)
    fb = SimpleNamespace(forward_mode=SimpleNamespace(is_target_verify=lambda: True))
    for _ in range(3):
        with opened([]) as r:
            r.step = DraftStep([None, None], 4, [False, False], None)
            r.step.keep = torch.ones(2, 8, dtype=torch.bool)
            assert hooks._runner_forward(None, None, fb) == "out"
    value = lambda path: reg.get_sample_value("treespec:verify_forwards_total",  # noqa: E731
                                              {"model_name": "m", "tp_rank": "0", "path": path})
    assert (value("ragged"), value("padded")) == (2.0, 1.0)


def test_values_past_the_batchs_last_request_are_not_counted(series):
    """A host list longer than the batch (rows of a padded replay) records and counts the batch's own values only."""
    s, reg = series
    a = _req()
    S.record_rounds([a], ["talon"], "treespec_tree_sizes", [5, 99, 99])
    assert a.customized_info["treespec_tree_sizes"] == [5]
    assert _sample(reg, "treespec:tree_size_count", "talon") == 1 and _sample(reg, "treespec:tree_size_sum", "talon") == 5


def test_an_unknown_policy_naming_a_classifier_is_refused_as_an_unknown_policy():
    """Refused for its policy, by the field ``policy``: the client's string never becomes a label (it was
    ``qx7z9.classifier``, one new series per name a client sends)."""
    from treespec_sglang.plugin.request import diagnose

    msg = diagnose({"treespec": {"policy": "qx7z9", "classifier": "/etc/passwd"}})
    assert "policy must be one of" in msg and "/etc/passwd" not in msg and M.refused_field(msg) == "policy"


def test_none_label_values_are_exported_empty(private_registry):
    """SGLang's labels may hold None (an unset model name): exported as ``""``, never as the string ``"None"``."""
    reg = private_registry
    s = M.SchedulerSeries({"model_name": None, "tp_rank": 0})
    assert s.labels == {"model_name": "", "tp_rank": "0"}
    s.new_request("talon")
    assert reg.get_sample_value("treespec:requests_total", {"model_name": "", "tp_rank": "0", "policy": "talon"}) == 1


class _Inc:
    def inc(self, n=1):
        pass


@pytest.mark.parametrize("bounds, buckets, has_sum, want", [
    ((1.0, 2.0), [_Inc(), _Inc()], True, True),  # prometheus_client's layout (its bounds are a list or a tuple)
    ([1.0], [_Inc()], True, True),  # one bucket (+Inf alone) is a layout too
    ((1.0, 2.0), (_Inc(), _Inc()), True, False),  # buckets not a list
    ([1.0, 2.0], [_Inc()], True, False),  # one value per bound, or not the layout
    ([], [], True, False),  # no bucket at all
    ("12", [_Inc(), _Inc()], True, False),  # bounds of another kind
    ((1.0, 2.0), [_Inc(), _Inc()], False, False),  # no sum
    ((1.0, 2.0), [_Inc(), object()], True, False),  # a bucket value that cannot be incremented
])
def test_the_bulk_layout_is_recognised_only_when_every_part_is_there(bounds, buckets, has_sum, want):
    child = SimpleNamespace(_upper_bounds=bounds, _buckets=buckets, **({"_sum": _Inc()} if has_sum else {}))
    assert M.bulk_observable(child) is want


def test_a_known_layout_is_observed_in_bulk_never_value_by_value(series, caplog):
    """The library's histogram is written in bulk by default (``observe_all``'s default and the series' first
    decision): its own ``observe`` is never called, and nothing is logged."""
    s, reg = series
    child = s._child(s.tree_size, "talon")

    def no_observe(v):
        raise AssertionError("observe called: not the bulk path")

    child.observe = no_observe
    with caplog.at_level("WARNING", logger="treespec_sglang.plugin"):
        s.drafted("talon", [4, 8, 4])
        M.observe_all(child, [1, 2])
    assert s.bulk is True and caplog.text == ""
    assert _sample(reg, "treespec:tree_size_count", "talon") == 5 and _sample(reg, "treespec:tree_size_sum",
                                                                                 "talon") == 19


def test_a_refused_request_is_counted_by_field_under_the_tokenizers_labels(monkeypatch, private_registry):
    """``enable_tokenizer`` (once per tokenizer process) then ``count_refused`` per refusal: one counter,
    SGLang's labels + ``field`` (None labels exported empty); a second enable keeps the first counter."""
    import prometheus_client

    reg = private_registry
    monkeypatch.setattr(M, "_refused", None)
    M.enable_tokenizer({"model_name": "m", "tokenizer": None})
    first = M._refused
    M.enable_tokenizer({"model_name": "other"})  # a second call: no new counter (it would be a duplicate series)
    assert M._refused is first
    for msg in ("custom_params['treespec']: salf.budget must be in [1, 1024], got 0",
                "custom_params['treespec']: salf.budget must be in [1, 1024], got 9999", "garbage"):
        M.count_refused(msg)
    value = lambda field: reg.get_sample_value("treespec:refused_requests_total",  # noqa: E731
                                               {"model_name": "m", "tokenizer": "", "field": field})
    assert (value("salf.budget"), value("other")) == (2.0, 1.0)
    text = prometheus_client.generate_latest(reg).decode()
    assert "# HELP treespec:refused_requests_total Requests refused for a bad custom_params['treespec']" in text


def test_enable_scheduler_makes_the_process_series_once(monkeypatch, private_registry):
    monkeypatch.setattr(M, "_scheduler", None)
    s = M.enable_scheduler({"model_name": "m"})
    assert M.scheduler_series() is s and s.labels == {"model_name": "m"}
    assert M.enable_scheduler({"model_name": "x"}) is s


# what /metrics shows of each scheduler series: its HELP text and its TYPE (the exposition operators and dashboards
# read; docs/plugin.md's table names the same series with the same types)
EXPOSITION = {
    "treespec:requests": ("counter", "Requests drafted with a treespec policy"),
    "treespec:rounds": ("counter", "Verify rounds committed for treespec requests"),
    "treespec:accepted_draft_tokens": ("counter", "Accepted draft tokens (bonus excluded)"),
    "treespec:verified_tokens": ("counter", "Tokens the target's verify forward ran"),
    "treespec:tree_size": ("histogram", "Verified nodes per round (root included)"),
    "treespec:accept_length": ("histogram", "Accepted draft tokens per round"),
    "treespec:verify_forwards": ("counter", "Target verify forwards of treespec rounds, by path (ragged: kept nodes "
                                            "only; padded: N per request)"),
}


def test_the_exposition_shows_each_series_help_and_type_as_documented(series):
    import os
    import re

    import prometheus_client

    s, reg = series
    s.new_request("talon")
    s.drafted("talon", [3])
    s.verified_tokens("talon", [3])
    s.accepted_round("talon", [1])
    s.verify_forward(True)
    text = prometheus_client.generate_latest(reg).decode()
    shown = {}
    for m in re.finditer(r"^# (HELP|TYPE) (\S+) (.*)$", text, re.M):
        shown.setdefault(m.group(2), {})[m.group(1)] = m.group(3)
    want = {}
    for name, (kind, help_text) in EXPOSITION.items():
        key = name + "_total" if kind == "counter" else name
        want[key] = {"HELP": help_text, "TYPE": kind}
    assert {k: v for k, v in shown.items() if k.startswith("treespec:") and not k.endswith("_created")} == want
    docs = open(os.path.join(os.path.dirname(__file__), "..", "..", "docs", "plugin.md")).read()
    documented = dict(re.findall(r"^\| `(treespec:\w+)` \| (counter|histogram)", docs, re.M))
    assert {k: v["TYPE"] for k, v in want.items()} == {k: v for k, v in documented.items() if k in want}
    assert set(documented) == set(want) | {"treespec:refused_requests_total"}
