"""``hooks.batch_columns``: a decode batch's per-request policy columns, built once and reused while the batch holds
the same requests in the same order under the same defaults; rebuilt on any change."""

from types import SimpleNamespace

import pytest

from treespec_sglang.plugin import hooks
from treespec_sglang.plugin.config import ServerDefaults
from treespec_sglang.policies import parse_spec

SPECS = [None, {"policy": "talon", "budget": 8}, {"policy": "none"}, {"policy": "salf", "budget": 8}]


def req(spec):
    params = parse_spec(spec) if spec else None
    return SimpleNamespace(_treespec_params=params, _treespec_shares=bool(spec) and spec["policy"] == "talon")


@pytest.fixture
def built(monkeypatch):
    """Counts the per-request parses (``_req_params``) behind ``batch_columns``; no columns from another test."""
    monkeypatch.setattr(hooks, "_COLUMNS", [None])
    calls = []
    real = hooks._req_params
    monkeypatch.setattr(hooks, "_req_params", lambda r, d: calls.append(r) or real(r, d))
    return calls


def test_the_same_requests_reuse_the_columns_and_any_change_rebuilds_them(built):
    d = ServerDefaults()
    reqs = [req(s) for s in SPECS]
    first = hooks.batch_columns(reqs, d)
    assert [p is None for p in first.params] == [True, False, False, False] and first.any_policy
    assert first.shares == [False, True, False, False]  # "none" never shares
    assert len(built) == 4
    assert hooks.batch_columns(list(reqs), d) is first and len(built) == 4  # another list, same requests
    cases = [reqs[:3],  # one left the batch (SGLang filters the list in place)
             [reqs[1], reqs[0]] + reqs[2:],  # reordered
             reqs[:3] + [req(SPECS[3])],  # one replaced by another with the same policy
             reqs]
    for case in cases:
        cols = hooks.batch_columns(case, d)
        assert cols.reqs == tuple(case) and [p is None for p in cols.params] == [r._treespec_params is None
                                                                                 for r in case]
    n = len(built)
    assert hooks.batch_columns(reqs, ServerDefaults("salf", {"budget": 8})) is not hooks.batch_columns(reqs, d)
    assert len(built) == n + 8  # new defaults: rebuilt (twice: there and back)


def test_names_mark_the_requests_drafted_once(built):
    reqs = [req(s) for s in SPECS]
    cols = hooks.batch_columns(reqs, ServerDefaults())
    assert not any(hasattr(r, hooks.DRAFTED) for r in reqs)  # nothing marked before a draft
    assert cols.drafted() == [None, "talon", "none", "salf"]
    assert [getattr(r, hooks.DRAFTED, None) for r in reqs] == [None, "talon", "none", "salf"]
    assert cols.drafted() is cols.drafted()


def test_a_native_batch_has_no_policy_unless_the_server_has_a_default(built):
    def fresh():  # a request whose custom_params carry no policy, not parsed yet
        return SimpleNamespace(sampling_params=SimpleNamespace(custom_params=None))

    assert not hooks.batch_columns([fresh(), fresh()], ServerDefaults()).any_policy
    cols = hooks.batch_columns([fresh()], ServerDefaults("talon", {"budget": 8}))
    assert cols.any_policy and cols.drafted() == ["talon"]


def test_a_rounds_policy_names_come_from_the_batchs_columns_while_it_holds_the_same_requests(built):
    """The stats hooks' ``_policies``: the columns' names for the batch's requests (no per-request read), a
    native batch's Nones at once, and each request's own mark for any other list."""
    d = ServerDefaults()
    reqs = [req(s) for s in SPECS]
    cols = hooks.batch_columns(reqs, d)
    names = cols.drafted()
    assert hooks._policies(list(reqs)) is names
    other = reqs[:3]
    assert hooks._policies(other) == [None, "talon", "none"] and hooks._policies(other) is not names
    native = [req(None) for _ in range(3)]
    assert not hooks.batch_columns(native, d).any_policy
    setattr(native[0], hooks.DRAFTED, "stale")  # never read while the columns say no request has a policy
    assert hooks._policies(native) == [None, None, None]
    assert hooks._policies(native[:2]) == ["stale", None]  # another list: read off each request


def test_a_chain_batch_builds_its_stopper_once(built, monkeypatch):
    """Chain mode: the batch's ChainStopper (betas, lengths, classifiers) is built with its columns' first draft
    and reused while the batch holds the same requests; a changed batch gets its own."""
    from treespec_sglang.plugin import chain_stop

    made = []
    real = chain_stop.ChainStopper
    monkeypatch.setattr(hooks, "ChainStopper", lambda *a: made.append(a) or real(*a))
    d = ServerDefaults()
    reqs = [req(s) for s in [None, {"policy": "chain", "length": 2}, {"policy": "none"}]]
    first = hooks.batch_columns(reqs, d).chain_stopper(4, "cpu")
    assert hooks.batch_columns(list(reqs), d).chain_stopper(4, "cpu") is first and len(made) == 1
    assert first.cut().tolist() == [4, 2, 0]
    other = hooks.batch_columns(reqs[1:], d).chain_stopper(4, "cpu")
    assert len(made) == 2 and other.cut().tolist() == [2, 0]
