"""``plugin/hooks.py`` beyond a round's bodies (``test_sglang_rounds.py``, ``test_chain_stop.py``): the selection and
chain-cut graphs captured after SGLang's draft graphs at start, the label a round gives the CUDA-graph counter, and
the module docstring's table of hooks."""

import logging
from types import SimpleNamespace

import pytest

from treespec_sglang.plugin import hooks
from treespec_sglang.plugin.round import opened


@pytest.fixture
def captures(monkeypatch):
    """What each capture was asked for (``("select", topk, N)`` / ``("cut", steps, N)``); each reports ``made``
    graphs."""
    seen, made = [], {"select": 3, "cut": 2}
    monkeypatch.setattr(hooks, "capture_selections", lambda topk, n: seen.append(("select", topk, n)) or made["select"])
    monkeypatch.setattr(hooks, "capture_cuts", lambda steps, n: seen.append(("cut", steps, n)) or made["cut"])
    return seen, made


def worker(topk):
    return SimpleNamespace(topk=str(topk), speculative_num_steps=5, speculative_num_draft_tokens=6)


@pytest.mark.parametrize("topk, want", [(1, [("select", 1, 6), ("cut", 5, 6)]), (2, [("select", 2, 6)]),
                                        (4, [("select", 4, 6)])])
def test_a_chain_server_also_captures_its_cut_graphs(captures, caplog, topk, want):
    with caplog.at_level(logging.INFO, logger="treespec_sglang.plugin"):
        assert hooks._capture_selections("out", worker(topk)) == "out"
    assert captures[0] == want
    lines = ["treespec-sglang: captured the selection graph of 3 draft graph shapes",
             "treespec-sglang: captured the chain cut graph of 2 draft graph shapes"]
    assert [r.getMessage() for r in caplog.records] == lines[:len(want)]


def test_nothing_captured_logs_nothing(captures, caplog):
    captures[1].update(select=0, cut=0)
    with caplog.at_level(logging.INFO, logger="treespec_sglang.plugin"):
        hooks._capture_selections(None, worker(1))
    assert len(captures[0]) == 2 and caplog.records == []


def test_the_graph_counter_labels_a_round_treespec_only_when_a_request_carries_a_policy():
    assert hooks._treespec_round() is False  # no round open
    with opened([SimpleNamespace(_treespec_params=None)]):
        assert hooks._treespec_round() is False
    with opened([SimpleNamespace(), SimpleNamespace(_treespec_params="talon")]):
        assert hooks._treespec_round() is True


def test_the_docstring_table_has_one_row_per_hook_in_the_order_they_run():
    table = hooks.hooks_table()
    lines = table.split("\n")
    assert lines[:2] == ["| target | type | what it does |", "|---|---|---|"]
    assert len(lines) == 2 + len(hooks.HOOKS_IN_ORDER)
    for line, h in zip(lines[2:], hooks.HOOKS_IN_ORDER):
        cls_or_module, name = h.target.split(".")[-2:]
        assert line == f"| ``{cls_or_module}.{name}`` | {h.kind} | {h.does} |"
    assert table in hooks.__doc__ and "{table}" not in hooks.__doc__


@pytest.fixture
def registry(monkeypatch):
    """A stand-in for SGLang's ``HookRegistry`` module: the registrations in order, ``(target, body, kind)``; the
    graph log's labels are put back after the test."""
    import sys
    import types

    from treespec_sglang.plugin import graph_log

    got = []
    fake = types.ModuleType("sglang.srt.plugins.hook_registry")
    fake.HookType = types.SimpleNamespace(BEFORE="BEFORE", AFTER="AFTER", AROUND="AROUND")
    fake.HookRegistry = types.SimpleNamespace(register=lambda target, body, kind: got.append((target, body, kind)))
    monkeypatch.setitem(sys.modules, "sglang.srt.plugins.hook_registry", fake)
    monkeypatch.setattr(graph_log, "_LABEL", dict(graph_log._LABEL))
    for var in ("TREESPEC_GRAPH_LOG", "TREESPEC_PROFILE"):
        monkeypatch.delenv(var, raising=False)
    return got


@pytest.mark.parametrize("graph_log, profile, tail", [
    (False, False, ""), (True, False, " and CUDA-graph counting"), (False, True, ", each timed (TREESPEC_PROFILE)"),
    (True, True, " and CUDA-graph counting, each timed (TREESPEC_PROFILE)")])
def test_register_hooks_registers_the_table_then_the_graph_counters_and_says_so(registry, monkeypatch, tmp_path,
                                                                                caplog, graph_log, profile, tail):
    from treespec_sglang.plugin import graph_log as G

    timed = []
    monkeypatch.setattr(hooks, "profiled", lambda *a: timed.append(a) or ("timed", a[3]))
    if graph_log:
        monkeypatch.setenv("TREESPEC_GRAPH_LOG", str(tmp_path / "graphs"))
    if profile:
        monkeypatch.setenv("TREESPEC_PROFILE", str(tmp_path / "profile"))
    with caplog.at_level(logging.INFO, logger="treespec_sglang.plugin"):
        hooks.register_hooks()
    table = [(h.target, ("timed", h.body) if profile else h.body, h.kind) for h in hooks.HOOKS_IN_ORDER]
    counters = [(t, body, "AFTER") for t, body in G.RUNNERS.items()] if graph_log else []
    assert registry == table + counters
    if profile:  # each body timed as its target and kind, labelled by the round's treespec test
        assert [a[1:] for a in timed] == [(h.target, h.kind, h.body, hooks._treespec_round)
                                          for h in hooks.HOOKS_IN_ORDER]
    assert [r.getMessage() for r in caplog.records] == [f"treespec-sglang: registered {len(hooks.HOOKS)} hooks{tail}"]
    if graph_log:  # the counters label a round by the plugin's own tests
        assert G._LABEL["treespec_round"] is hooks._treespec_round and G._LABEL["in_round"]() is False
        with opened([]):
            assert G._LABEL["in_round"]() is True


def test_a_draft_loop_of_a_worker_without_topk_runs_sglangs_loop_alone():
    seen = []
    hooks._draft_loop(lambda self, fb, *a, **k: seen.append((self, fb, a, k)), "worker", "fb", 1, x=2)
    assert seen == [("worker", "fb", (1,), {"x": 2})]
