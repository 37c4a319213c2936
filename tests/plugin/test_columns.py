"""``columns.batch_columns``: a decode batch's per-request policy columns, built once and reused while the batch holds
the same requests in the same order under the same defaults; carried over when it changes by a few runs."""

from types import SimpleNamespace

import pytest
import torch

from treespec_sglang.plugin import columns
from treespec_sglang.plugin.config import ServerDefaults
from treespec_sglang.policies import parse_spec
from treespec_sglang.utils.bounded import Bounded

SPECS = [None, {"policy": "talon", "budget": 8}, {"policy": "none"}, {"policy": "salf", "budget": 8}]


def req(spec):
    params = parse_spec(spec) if spec else None
    return SimpleNamespace(_treespec_params=params, _treespec_shares=bool(spec) and spec["policy"] == "talon")


@pytest.fixture
def built(monkeypatch):
    """Counts the per-request parses (``_req_params``) behind ``batch_columns``; no columns from another test."""
    monkeypatch.setattr(columns, "_COLUMNS", [None])
    calls = []
    real = columns._req_params
    monkeypatch.setattr(columns, "_req_params", lambda r, d: calls.append(r) or real(r, d))
    return calls


def test_the_same_requests_reuse_the_columns_and_any_change_rebuilds_them(built):
    d = ServerDefaults()
    reqs = [req(s) for s in SPECS]
    first = columns.batch_columns(reqs, d)
    assert [p is None for p in first.params] == [True, False, False, False] and first.any_policy
    assert first.shares == (False, True, False, False)  # "none" never shares
    assert len(built) == 4
    assert columns.batch_columns(list(reqs), d) is first and len(built) == 4  # another list, same requests
    cases = [reqs[:3],  # one left the batch (SGLang filters the list in place)
             [reqs[1], reqs[0]] + reqs[2:],  # reordered
             reqs[:3] + [req(SPECS[3])],  # one replaced by another with the same policy
             reqs]
    for case in cases:
        cols = columns.batch_columns(case, d)
        assert cols.reqs == tuple(case) and [p is None for p in cols.params] == [r._treespec_params is None
                                                                                 for r in case]
    n = len(built)
    assert columns.batch_columns(reqs, ServerDefaults("salf", {"budget": 8})) is not columns.batch_columns(reqs, d)
    # new defaults: the columns rebuilt (twice: there and back), each request's entry read, not resolved again
    # (a request's parameters are parsed once, on arrival: the defaults a server starts with never change)
    assert len(built) == n == 5


def test_an_empty_batch_has_empty_columns_and_a_native_round(built):
    cols = columns.batch_columns([], ServerDefaults())
    assert (cols.reqs, cols.params, cols.shares, cols.any_policy) == ((), (), (), False)
    assert cols.selection(8, 3) == (None, []) and cols.drafted() == () and not built


def test_names_mark_the_requests_drafted_once(built):
    reqs = [req(s) for s in SPECS]
    cols = columns.batch_columns(reqs, ServerDefaults())
    assert not any(hasattr(r, columns.DRAFTED) for r in reqs)  # nothing marked before a draft
    assert cols.drafted() == (None, "talon", "none", "salf")
    assert [getattr(r, columns.DRAFTED, None) for r in reqs] == [None, "talon", "none", "salf"]
    assert cols.drafted() is cols.drafted()


def test_a_native_batch_has_no_policy_unless_the_server_has_a_default(built):
    def fresh():  # a request whose custom_params carry no policy, not parsed yet
        return SimpleNamespace(sampling_params=SimpleNamespace(custom_params=None))

    assert not columns.batch_columns([fresh(), fresh()], ServerDefaults()).any_policy
    cols = columns.batch_columns([fresh()], ServerDefaults("talon", {"budget": 8}))
    assert cols.any_policy and cols.drafted() == ("talon",)


def test_a_rounds_policy_names_come_from_the_batchs_columns_while_it_holds_the_same_requests(built):
    """The stats hooks' ``_policies``: the columns' names for the batch's requests (no per-request read), a
    native batch's Nones at once, and each request's own mark for any other list."""
    d = ServerDefaults()
    reqs = [req(s) for s in SPECS]
    cols = columns.batch_columns(reqs, d)
    names = cols.drafted()
    held, got = columns._policies(list(reqs))
    assert got is names and held is cols.reqs  # the columns' tuple: the stats check it by identity
    other = reqs[:3]
    held, got = columns._policies(other)
    assert got == [None, "talon", "none"] and got is not names and held is other
    native = [req(None) for _ in range(3)]
    native_cols = columns.batch_columns(native, d)
    assert not native_cols.any_policy
    setattr(native[0], columns.DRAFTED, "stale")  # never read while the columns say no request has a policy
    assert columns._policies(native) == (native_cols.reqs, (None, None, None))
    assert columns._policies(native[:2])[1] == ["stale", None]  # another list: read off each request


def test_a_chain_batch_builds_its_stopper_once(built, monkeypatch):
    """Chain mode: the batch's ChainStopper (betas, lengths, classifiers) is built with its columns' first draft
    and reused while the batch holds the same requests; a changed batch gets its own."""
    from treespec_sglang.plugin import chain_stop

    made = []
    real = chain_stop.ChainStopper
    monkeypatch.setattr(columns, "ChainStopper", lambda *a: made.append(a) or real(*a))
    d = ServerDefaults()
    reqs = [req(s) for s in [None, {"policy": "chain", "length": 2}, {"policy": "none"}]]
    first = columns.batch_columns(reqs, d).chain_stopper(4, "cpu")
    assert columns.batch_columns(list(reqs), d).chain_stopper(4, "cpu") is first and len(made) == 1
    assert first.cut().tolist() == [4, 2, 0]
    other = columns.batch_columns(reqs[1:], d).chain_stopper(4, "cpu")
    assert len(made) == 2 and other.cut().tolist() == [2, 0]


# ---------------------------------------------------------------------------- requests whose tree is SGLang's own
K, S, N = 4, 3, 8
NATIVE_TREES = [{"policy": "eagle2", "budget": N}, {"policy": "eagle2", "budget": 60},
                {"policy": "eagle2", "budget": N, "topk": K, "depth": S},
                {"policy": "salf", "budget": 16, "th": 0.0}, {"policy": "salf", "budget": N, "th": 0.0, "max_depth": S}]
OWN_TREES = [{"policy": "eagle2", "budget": N - 1}, {"policy": "eagle2", "budget": N, "depth": S - 1}, {"policy": "salf", "budget": 16, "th": 0.0, "max_depth": S - 1},
             {"policy": "salf", "budget": 16, "th": 0.1}, {"policy": "talon", "budget": N}, {"policy": "none"},
             {"policy": "c2t", "budget": N}, {"policy": "chain", "length": S}]


@pytest.mark.parametrize("spec", NATIVE_TREES + OWN_TREES)
def test_a_policy_keeps_the_native_tree_only_where_its_selection_is_sglangs(spec):
    """``keeps_native_tree`` against the selection itself (``select_on_pool``, the torch oracle) on random pools
    without ties: where it says so, the policy's tree is SGLang's top N-1 with every node kept, on every pool. (A
    policy of its own may pick the same tree on some pools: SALF's search often does; it is decided per request,
    before any pool, so only the rules that always do are served natively.)"""
    from tests.plugin.kernel_cases import make_pool
    from treespec_sglang.plugin.pool import keeps_native_tree, select_on_pool

    p = parse_spec(spec)
    assert keeps_native_tree(p, N, S) == (spec in NATIVE_TREES)
    same = []
    for seed in range(4):
        pool = make_pool(K, S, 6, seed=seed)
        native = select_on_pool(pool, N, [None] * 6)
        own = select_on_pool(pool, N, [p] * 6)
        same.append(torch.equal(own[1], native[1]) and bool(own[3].all()))
    assert all(same) or spec in OWN_TREES, same


def test_a_batch_of_native_trees_is_served_as_sglangs_own_round(built):
    """``selection``: the requests whose tree is SGLang's own are native rows of the selection; with no other
    policy left the round is SGLang's (params None) and each tree is N nodes; a sharing request under a token
    cap keeps its policy (the cap may cut it); another shape is decided again."""
    eagle2, talon = {"policy": "eagle2", "budget": N}, {"policy": "talon", "budget": N}
    reqs = [req(s) for s in (None, eagle2, talon)]
    mixed = columns.batch_columns(reqs, ServerDefaults())
    params, tokens = mixed.selection(N, S)
    assert params[:2] == (None, None) and params[2] is not None and tokens is None
    assert mixed.selection(N, S)[0] is params  # built once per (N, S) while the batch lives
    cols = columns.batch_columns(reqs[:2], ServerDefaults())
    params, tokens = cols.selection(N, S)
    assert params is None and tokens == [N, N]
    assert cols.selection(N, S)[1] is tokens  # kept while the batch lives
    assert cols.whole_trees(N) is tokens and cols.whole_trees(N + 2) == [N + 2] * 2  # built again at another N
    assert cols.whole_trees(N + 2) is cols.whole_trees(N + 2)
    assert cols.selection(N + 1, S)[0] == (None, cols.params[1])  # budget N < N + 1: its own tree there
    shared = [SimpleNamespace(_treespec_params=parse_spec(eagle2), _treespec_shares=True)]
    capped = ServerDefaults(token_cap=16)
    assert columns.batch_columns(shared, capped).selection(N, S)[0] == (parse_spec(eagle2),)
    assert columns.batch_columns(shared, ServerDefaults()).selection(N, S)[0] is None
    # under the cap a request that does not share it keeps SGLang's tree: with a native one, SGLang's own round
    unshared = [SimpleNamespace(_treespec_params=parse_spec(eagle2), _treespec_shares=False), req(None)]
    assert columns.batch_columns(unshared, capped).selection(N, S) == (None, [N, N])


def test_a_native_tree_round_drafts_natively_and_records_the_policies_stats(built, series):
    """The draft hook on a batch of native-tree requests: SGLang's draft runs untouched (no draft step, so no
    selection and no unlink), each request with a policy gets N as its tree size and verified tokens, and the
    round's verify forward counts as padded."""
    from treespec_sglang.plugin import hooks
    from treespec_sglang.plugin.round import current, opened

    reqs = [SimpleNamespace(_treespec_params=parse_spec({"policy": "eagle2", "budget": 60}), _treespec_shares=False,
                            customized_info=None),
            SimpleNamespace(_treespec_params=None, _treespec_shares=False, customized_info=None)]
    seen = []
    worker = SimpleNamespace(topk=K, speculative_num_steps=S, speculative_num_draft_tokens=N)
    with opened(reqs):
        out = hooks._draft(lambda w, b: seen.append(current().step) or "drafted", worker, SimpleNamespace(reqs=reqs))
    hooks._PENDING.flush()
    assert out == "drafted" and seen == [None]
    info = reqs[0].customized_info
    assert info["treespec_policy"] == ["eagle2"] and info["treespec_tree_sizes"] == [N]
    assert info["treespec_verify_tokens"] == [N] and reqs[1].customized_info is None
    forwards = {path: series[1].get_sample_value("treespec:verify_forwards_total",
                                                  {"model_name": "m", "tp_rank": "0", "path": path})
                for path in ("padded", "ragged")}
    assert forwards == {"padded": 1.0, "ragged": None}


def test_an_unbounded_ranking_row_keeps_the_native_tree(monkeypatch):
    """A pool rule's None is unbounded (as the row table reads it): a registered ranking policy whose ``top`` or
    ``rank_depth`` is None keeps SGLang's tree; an unbounded SALF threshold does not."""
    from treespec_sglang.plugin import pool, rows

    # three requests (budgets 2, 3, 4) whose registered rules give these rows
    rule = {2: {"top": None}, 3: {"top": N - 1, "rank_depth": None}, 4: {"top": None, "th": None}}
    monkeypatch.setattr(pool, "_NATIVE_TREES", Bounded(4096))  # decided under these rules only, forgotten after
    monkeypatch.setattr(pool, "pool_rule_of", lambda p: SimpleNamespace(stage="rank" if p.budget < 4 else "salf"))
    monkeypatch.setattr(rows, "_rule_row", lambda p: rule[p.budget])
    params = [parse_spec({"policy": "eagle2", "budget": b}) for b in rule]
    assert [pool.keeps_native_tree(p, N, S) for p in params] == [True, True, False]


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("cap", [None, 16])
def test_selection_and_names_equal_a_row_by_row_reading(built, seed, cap):
    """``selection`` and ``drafted`` work once per parameter set and map the result over the rows by id: on
    random batches (requests sharing one parameter object, equal parameters in separate objects, natives, rows
    sharing the token cap or not) they equal the row-by-row reading of each request."""
    import random

    rng = random.Random(seed)
    specs = NATIVE_TREES + OWN_TREES + [None]
    shared = {i: parse_spec(s) for i, s in enumerate(specs) if s is not None}
    reqs, names, native = [], [], []
    for _ in range(rng.randint(1, 24)):
        i = rng.randrange(len(specs))
        p = None if specs[i] is None else shared[i] if rng.random() < 0.5 else parse_spec(specs[i])
        reqs.append(SimpleNamespace(_treespec_params=p, _treespec_shares=rng.random() < 0.5))
        names.append(None if specs[i] is None else specs[i]["policy"])
        native.append(specs[i] in NATIVE_TREES)  # SGLang's own tree (checked against the selection above)
    cols = columns.batch_columns(reqs, ServerDefaults(token_cap=cap))
    capped = cap is not None
    want = tuple(None if p is None or (n and not (capped and s)) else p
                 for p, s, n in zip(cols.params, cols.shares, native))
    params, tokens = cols.selection(N, S)
    if all(p is None for p in want):
        assert params is None and tokens == [N] * len(reqs)
    else:
        assert tokens is None and all(a is b for a, b in zip(params, want)) and len(params) == len(want)
    assert cols.drafted() == tuple(names)
    assert [getattr(r, columns.DRAFTED) for r in reqs] == names


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("cap", [None, 16])
def test_a_changing_batch_carries_its_columns_as_a_row_by_row_reading(built, monkeypatch, seed, cap):
    """Over 80 rounds of a batch SGLang's way (finished requests filtered out, new ones appended, now and then a
    reorder or a long run of rounds without change), the columns equal each request's own reading, the names
    drafted (and set on every request) and the selection at one or another N carried over from the batch before
    when it was asked for them; no request is parsed twice."""
    import random

    from treespec_sglang.plugin import batch_diff

    monkeypatch.setattr(batch_diff, "FEWEST", 4)  # batches of up to 40 requests carried (FEWEST 32 would rebuild most)
    changes, real = [], columns.diff
    monkeypatch.setattr(columns, "diff", lambda *a: changes.append(real(*a)) or changes[-1])
    named, real_name = [], columns.policy_name
    monkeypatch.setattr(columns, "policy_name", lambda p: named.append(p) or real_name(p))
    rng = random.Random(seed)
    specs = NATIVE_TREES + OWN_TREES + [None, {"policy": "none"}]
    shared = {i: parse_spec(s) for i, s in enumerate(specs) if s is not None}

    def arrival():
        i = rng.randrange(len(specs))
        p = None if specs[i] is None else shared[i] if rng.random() < 0.5 else parse_spec(specs[i])
        r = SimpleNamespace(_treespec_params=p, _treespec_shares=rng.random() < 0.5)
        r.want = (None if specs[i] is None else specs[i]["policy"], specs[i] in NATIVE_TREES)
        return r

    d = ServerDefaults(token_cap=cap)
    batch = [arrival() for _ in range(rng.randint(0, 40))]
    for _ in range(80):
        if rng.random() < 0.8:
            batch = [r for r in batch if rng.random() > 0.1] + [arrival() for _ in range(rng.choice([0, 1, 1, 3]))]
            if rng.random() < 0.1 and len(batch) > 1:
                rng.shuffle(batch)
        last = columns._COLUMNS[0]
        cols = columns.batch_columns(batch, d)
        assert cols.reqs == tuple(batch) and cols.ids in (None, tuple(map(id, batch)))
        assert all(p is r._treespec_params for p, r in zip(cols.params, batch)) and len(cols.params) == len(batch)
        shares = [r._treespec_params is not None and r.want[0] != "none" and r._treespec_shares for r in batch]
        assert cols.shares == tuple(shares) and cols.any_policy == any(r._treespec_params is not None for r in batch)
        if last is not None and len(batch) == len(last.reqs) and all(map(lambda a, b: a is b, batch, last.reqs)):
            assert cols is last
        for n in rng.sample([N, N + 1], rng.randint(0, 2)):  # asked at one N, both, or not at all this round
            want = tuple(None if r._treespec_params is None or (r.want[1] and not (cap is not None and s))
                         else r._treespec_params for r, s in zip(batch, shares))
            if n == N + 1:  # another shape: built for it (and the next batch's carried from it or not)
                assert cols.selection(n, S)[0] is cols.selection(n, S)[0]
                continue
            params, tokens = cols.selection(n, S)
            if all(w is None for w in want):
                assert params is None and tokens == [n] * len(batch)
            else:
                assert tokens is None and len(params) == len(want) and all(a is b for a, b in zip(params, want))
        if rng.random() < 0.7:
            before, base = len(named), cols._last is not None and cols._last[2] is not None
            assert cols.drafted() == tuple(r.want[0] for r in batch)
            if base and changes and changes[-1] is not None:  # carried: only the new requests' names worked out
                fresh = sum(j - i for i, j in changes[-1].fresh())
                assert len(named) - before <= fresh
            assert [getattr(r, columns.DRAFTED) for r in batch] == [r.want[0] for r in batch]
    assert sum(c is not None for c in changes) > 20 and len(built) == len({id(r) for r in built})


def test_new_defaults_build_the_columns_again_not_carry_them(built, monkeypatch):
    """A batch that changed under other defaults (another token cap) is built, not carried over: a native-tree
    request that shares the cap keeps its selection under a cap, and is SGLang's own without one."""
    from treespec_sglang.plugin import batch_diff

    monkeypatch.setattr(batch_diff, "FEWEST", 2)
    eagle2 = parse_spec(NATIVE_TREES[0])
    reqs = [SimpleNamespace(_treespec_params=eagle2, _treespec_shares=True) for _ in range(5)]
    plain, capped = ServerDefaults(), ServerDefaults(token_cap=16)
    assert columns.batch_columns(reqs, plain).selection(N, S)[0] is None
    cols = columns.batch_columns(reqs[1:], capped)
    assert cols.defaults is capped and cols.selection(N, S)[0] == (eagle2,) * 4
    back = columns.batch_columns(reqs[2:], plain)
    assert back.defaults is plain and back.selection(N, S) == (None, [N] * 3)
    # a request not parsed yet joins a carried batch: resolved under the server's defaults
    talon = ServerDefaults("talon", {"budget": 8})
    columns.batch_columns(reqs, talon).drafted()
    late = SimpleNamespace(sampling_params=SimpleNamespace(custom_params=None))
    cols = columns.batch_columns(reqs[1:] + [late], talon)
    assert cols.params[-1] == parse_spec({"policy": "talon", "budget": 8}) and cols.drafted()[-1] == "talon"
