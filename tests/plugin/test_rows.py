"""``plugin.rows``: each request's policy parameters as one float32 row, column by column; the caches that keep a
row per parameter set, a table per batch composition and a classifier number per classifier (built once: a steady
batch costs the host neither the walk nor the op), each checked for the answer it gives and for what it skips."""

import math
import os

import pytest
import torch

from treespec_sglang.plugin import rows as rows_module
from treespec_sglang.plugin.classifiers import registered
from treespec_sglang.plugin.pool import BatchPlan
from treespec_sglang.plugin.rows import COLUMNS, by_id, classifier_ids, kind_id, per_batch, policy_rows, request_row
from treespec_sglang.policies import parse_spec
from treespec_sglang.policies.classifier import C2TClassifier
from treespec_sglang.policies.registry import REGISTRY
from treespec_sglang.utils.bounded import Bounded


def test_request_rows_hold_every_column_of_each_policy():
    """The row table, column by column (COLUMNS), written out by hand for each kind: the parameters a
    kind reads, and the neutral values of the ones it does not (BIG = 2^20: no cap; beta / clf -1: none)."""
    B, inf = float(1 << 20), float("inf")
    half = C2TClassifier(hidden=4).eval()
    cases = [  # (spec, shares, kind budget top rank_depth topk log_mu th batch max_depth beta clf shares)
        (None, False, [0, B, B, B, B, 0, 0, 1, B, -1, -1, 0]),
        (None, True, [0, B, B, B, B, 0, 0, 1, B, -1, -1, 1]),
        ({"policy": "none"}, False, [1, 1, 0, B, B, 0, 0, 1, B, -1, -1, 0]),
        ({"policy": "eagle2", "budget": 5, "topk": 3, "depth": 3}, True, [2, 5, 4, 3, B, 0, 0, 1, B, -1, -1, 1]),
        ({"policy": "talon", "budget": 9, "topk": 3, "mu": 0.05}, False,
         [3, 9, 0, B, 3, math.log(0.05), 0, 1, B, -1, -1, 0]),
        ({"policy": "talon", "budget": 9, "topk": 2, "mu": 0.0}, False, [3, 9, 0, B, 2, -inf, 0, 1, B, -1, -1, 0]),
        ({"policy": "salf", "budget": 12, "batch": 3, "th": 0.2, "max_depth": 2}, False,  # the search's depth,
         [4, 12, 0, B, B, 0, 0.2, 3, 2, -1, -1, 0]),  # not the ranking's (it only pads: never masked)
        ({"policy": "salf", "budget": 7, "th": 0.0}, False, [4, 7, 6, B, B, 0, 0, 7, B, -1, -1, 0]),
        ({"policy": "salf", "budget": 7, "batch": 2, "th": 0.0, "max_depth": 3}, False,
         [4, 7, 6, 3, B, 0, 0, 2, 3, -1, -1, 0]),
        ({"policy": "c2t", "budget": 10, "topk": 4, "beta": 0.3, "max_depth": 5}, False,
         [5, 10, 0, B, 4, 0, 0, 1, 5, 0.3, registered()["default"], 0]),  # none named: the server's default
        ({"policy": "c2t", "budget": 11, "topk": 2, "beta": 0.6, "classifier": half}, False,
         [5, 11, 0, B, 2, 0, 0, 1, 10, 0.6, half, 0]),
        ({"policy": "chain", "length": 3}, False, [6, 4, 0, B, B, 0, 0, 1, B, -1, -1, 0]),
        ({"policy": "chain", "length": 4, "beta": 0.4, "classifier": half}, False,
         [6, 5, 0, B, B, 0, 0, 1, B, 0.4, half, 0]),
    ]
    clf = COLUMNS.index("clf")
    old_kinds = {0: "native", 1: "none", 2: "eagle2", 3: "talon", 4: "salf", 5: "c2t", 6: "chain"}
    for spec, shares, want in cases:
        want = [kind_id(old_kinds[want[0]])] + want[1:]  # the kind column numbers the registry
        assert want[0] == (0 if spec is None else 1 + list(REGISTRY).index(spec["policy"]))
        row = request_row(None if spec is None else parse_spec(spec), "cpu", shares=shares)
        assert row.shape == (1, len(COLUMNS)) and row.dtype == torch.float32
        got = row[0].tolist()
        if not isinstance(want[clf], int):  # a classifier: the row names its entry of the registry
            assert got[clf] >= 0 and rows_module._CLF_SPECS[int(got[clf])] is want[clf], spec
            want = want[:clf] + [got[clf]] + want[clf + 1:]
        assert got == torch.tensor(want, dtype=torch.float32).tolist(), spec
    rows = policy_rows([parse_spec(cases[9][0]), parse_spec(cases[10][0]), parse_spec(cases[12][0])], "cpu")
    ids = rows[:, clf].tolist()
    assert ids[1] == ids[2] != ids[0]  # one id per classifier, shared by the rows that name it


def test_policy_rows_carry_each_requests_shares_flag():
    p = parse_spec({"policy": "talon", "budget": 9})
    rows = policy_rows([p, None, p], "cpu", shares=[True, False, False])
    assert rows[:, COLUMNS.index("shares")].tolist() == [1.0, 0.0, 0.0]
    assert policy_rows([p, None], "cpu")[:, COLUMNS.index("shares")].tolist() == [0.0, 0.0]
    assert request_row(None, "cpu")[0, -1] == request_row(p, "cpu")[0, -1] == 0.0  # no flag: no share


@pytest.mark.parametrize("empty", [[], ()])
def test_an_empty_batch_gets_a_table_of_no_rows(empty):
    """An idle rank's batch: ``[0, F]`` float32 on the device asked for, the shape a batch's rows concatenate to."""
    rows = policy_rows(empty, "cpu")
    assert rows.shape == (0, len(COLUMNS)) and rows.dtype == torch.float32 and rows.device.type == "cpu"
    assert policy_rows(empty, "cpu", shares=[]).shape == (0, len(COLUMNS))


def test_row_tables_and_plans_are_kept_per_batch_composition():
    """A steady batch (the same request objects in the same order) gets its row table and plan back without a
    walk; another order, other objects of equal value, other shares or another N each get their own, correct."""
    a, b = parse_spec({"policy": "talon", "budget": 9}), parse_spec({"policy": "salf", "budget": 12, "th": 0.2})
    rows = policy_rows([a, None, b], "cpu")
    assert policy_rows([a, None, b], "cpu") is rows
    assert torch.equal(policy_rows([b, None, a], "cpu"), rows[[2, 1, 0]])
    twin = parse_spec({"policy": "talon", "budget": 9})
    assert torch.equal(policy_rows([twin, None, b], "cpu"), rows)
    shared = policy_rows([a, None, b], "cpu", shares=[True, False, True])
    assert shared[:, COLUMNS.index("shares")].tolist() == [1.0, 0.0, 1.0]
    assert rows[:, COLUMNS.index("shares")].tolist() == [0.0, 0.0, 0.0]
    plan = BatchPlan.of([a, None, b], 8, 3)
    assert BatchPlan.of([a, None, b], 8, 3) is plan and plan.salf is not None
    assert BatchPlan.of([a, None], 8, 3).salf is None  # b left the batch
    assert BatchPlan.of([a, None, b], 8, 3).salf != BatchPlan.of([a, None, b], 16, 3).salf


@pytest.mark.parametrize("spec, mask_depth, search", [
    ({"policy": "eagle2", "budget": 8, "depth": 3}, False, False),  # its depth bound is S: nothing to mask
    ({"policy": "eagle2", "budget": 8, "depth": 2}, True, False),
    ({"policy": "salf", "budget": 8, "th": 0.0}, False, False),  # th 0: SGLang's ranking (Thm. 2-3), no search
    ({"policy": "salf", "budget": 8, "th": 0.0, "max_depth": 2}, True, False),
    ({"policy": "salf", "budget": 8, "th": 0.2}, False, True),
    ({"policy": "talon", "budget": 8}, False, False)])
def test_a_plan_masks_depths_and_searches_only_where_a_row_needs_it(spec, mask_depth, search):
    """The selection's extra work per batch (S = 3): the depth mask only for a row bounded above S's depth, the
    best-first search only for a SALF row with th > 0."""
    plan = BatchPlan.of([parse_spec(spec), None], 8, 3)
    assert plan.mask_depth is mask_depth and (plan.salf is not None) is search
    assert plan.stages["native"] == {"native"}


def test_a_steady_batchs_params_tuple_hits_by_identity_and_a_list_never_does(monkeypatch):
    """The batch columns' params tuple passed again is the last entry's without the ids' pass (the entry table
    may even be gone); other shares or another N are built anew; a list edited in place is never taken for the
    one cached (only an immutable tuple hits by identity)."""
    a, b = parse_spec({"policy": "talon", "budget": 9}), parse_spec({"policy": "salf", "budget": 12, "th": 0.2})
    steady = (a, None, b)
    table, plan = policy_rows(steady, "cpu"), BatchPlan.of(steady, 8, 3)
    monkeypatch.setattr(rows_module, "_BATCHES", Bounded(256))  # only the identity fast path can answer now
    assert policy_rows(steady, "cpu") is table and BatchPlan.of(steady, 8, 3) is plan
    assert torch.equal(policy_rows((b, None, a), "cpu"), table[[2, 1, 0]])  # another tuple, the same extra
    assert BatchPlan.of((a, None), 8, 3).salf is None
    assert policy_rows(steady, "cpu") is not table  # its entry went with the table: built again, equal
    shared = policy_rows(steady, "cpu", shares=(True, False, True))
    assert shared is not table and shared[:, COLUMNS.index("shares")].tolist() == [1.0, 0.0, 1.0]
    assert BatchPlan.of(steady, 16, 3) is not plan
    edited = [a, None, b]
    first = policy_rows(edited, "cpu")
    edited[2] = a  # the same list object, another batch
    assert torch.equal(policy_rows(edited, "cpu"), torch.cat([first[:2], first[:1]]))
    assert BatchPlan.of(edited, 8, 3).salf is None


def test_a_row_is_built_once_per_parameter_set_shares_and_device(monkeypatch):
    """One pool-rule call per parameter set, whatever asks for its rows (with and without shares, on two devices, a
    batch's table); one float32 tensor per (parameters, shares, device), whatever the process's default dtype,
    the same object for equal parameters."""
    monkeypatch.setattr(rows_module, "_RULE_ROWS", Bounded(4096))
    monkeypatch.setattr(rows_module, "_ROWS", Bounded(4096))
    calls, real = [], rows_module.pool_rule_of
    monkeypatch.setattr(rows_module, "pool_rule_of", lambda p: calls.append(p) or real(p))
    p, twin = parse_spec({"policy": "talon", "budget": 9}), parse_spec({"policy": "talon", "budget": 9})
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        row = request_row(p, "cpu")
    finally:
        torch.set_default_dtype(default)
    assert row.dtype == torch.float32 and row.device.type == "cpu" and request_row(twin, "cpu") is row
    shared = request_row(p, "cpu", shares=True)
    assert shared is not row and shared[0, :-1].tolist() == row[0, :-1].tolist() and shared[0, -1] == 1.0
    assert request_row(p, "meta").device.type == "meta" and request_row(p, "cpu") is row
    assert request_row(p, torch.device("meta")) is request_row(p, "meta")  # a device object names the same row
    table = policy_rows([p, None, twin], "cpu", shares=[False, False, True])
    assert torch.equal(table, torch.cat([row, request_row(None, "cpu"), shared]))
    assert calls == [p] and calls[0] is p  # the rule asked once, for the first of the equal parameter sets


def test_each_classifier_gets_one_number_in_first_seen_order(tmp_path):
    """The ``clf`` column numbers classifiers per process as first seen: a module by identity, a file by its path
    (two equal path strings are one classifier), a request naming none the server's default; the number maps back
    to the spec (what the selection loads), and ``classifier_ids`` lists a batch's numbers once each, ascending."""
    a, b = C2TClassifier(hidden=4).eval(), C2TClassifier(hidden=4).eval()
    a.save(tmp_path / "c.pt")
    path, same = "".join([str(tmp_path), "/c.pt"]), os.path.join(str(tmp_path), "c.pt")
    assert path == same and path is not same
    specs = [{"policy": "c2t", "budget": 9, "classifier": a}, {"policy": "talon", "budget": 9},
             {"policy": "c2t", "budget": 9, "classifier": b}, {"policy": "chain", "length": 3, "beta": 0.4,
                                                               "classifier": path},
             {"policy": "c2t", "budget": 8, "classifier": same}, {"policy": "c2t", "budget": 9}, None,
             {"policy": "c2t", "budget": 7, "classifier": a}]
    params = [None if s is None else parse_spec(s) for s in specs]
    first = len(rows_module._CLF_SPECS)
    ids = classifier_ids(params)
    default = next(i for i, spec in enumerate(rows_module._CLF_SPECS) if spec is registered()["default"])
    assert rows_module._CLF_SPECS[first:first + 2] == [a, b] and rows_module._CLF_SPECS[first + 2] == path
    assert ids == sorted({first, first + 1, first + 2, default}) and len(rows_module._CLF_SPECS) == first + 3
    col = policy_rows(params, "cpu")[:, COLUMNS.index("clf")].tolist()
    assert col == [first, -1, first + 1, first + 2, first + 2, default, -1, first]
    assert classifier_ids([params[1], None]) == []


def test_by_id_reads_an_iterator_once_and_keeps_a_tuples_answer_only():
    """Each row's ``id(params)`` and the map back, from any iterable (an iterator is read once); a tuple asked
    again gets its kept answer, a list edited in place is read anew."""
    a = parse_spec({"policy": "talon", "budget": 9})
    ids, of = by_id(iter([a, None, a]))
    assert ids == (id(a), id(None), id(a)) and of == {id(a): a, id(None): None}
    held = (a, None)
    answer = by_id(held)
    assert by_id(held) is answer and answer[0] == (id(a), id(None))
    batch = [a, None]
    assert by_id(batch)[0] == (id(a), id(None))
    batch[1] = a
    assert by_id(batch)[0] == (id(a), id(a))


def test_per_batch_builds_once_per_composition_name_and_extra(monkeypatch):
    """``build()`` runs once per (name, the objects in order, extra): another tuple or a list of the same objects
    gets the value back; another order, extra or name builds anew; a steady tuple is answered by identity."""
    monkeypatch.setattr(rows_module, "_BATCHES", Bounded(256))
    monkeypatch.setattr(rows_module, "_LAST", {})
    built = []

    def build():
        built.append(object())
        return built[-1]

    a, b = object(), object()
    steady, swapped = (a, b), (b, a)
    x = per_batch("t", steady, (1,), build)
    assert per_batch("t", (a, b), (1,), build) is x and per_batch("t", [a, b], (1,), build) is x
    assert per_batch("t", steady, (2,), build) is built[1] and per_batch("t", swapped, (1,), build) is built[2]
    assert per_batch("u", steady, (1,), build) is built[3] and len(built) == 4
    monkeypatch.setattr(rows_module, "_BATCHES", Bounded(256))  # only the identity fast path can answer now
    assert per_batch("t", swapped, (1,), build) is built[2] and per_batch("u", steady, (1,), build) is built[3]
    assert per_batch("t", (b, a), (1,), build) is built[4]  # equal, not the same tuple: the ids' pass, built anew


@pytest.mark.parametrize("seed", range(4))
def test_a_changed_batchs_table_and_plan_are_carried_as_built_afresh(monkeypatch, seed):
    """Rounds of a batch SGLang's way (requests leave, new ones join with parameter sets seen or not, now and
    then one set's last row leaves): the selection's params carried over by the columns carry the row table and
    the plan with them, and each equals the one built afresh: the table row by row (``request_row``), the plan
    from the batch's sets. Carried (no table built) whenever the table was the last batch's; planned again when
    a set joins or leaves."""
    import random
    from types import SimpleNamespace

    from treespec_sglang.plugin import batch_diff, columns
    from treespec_sglang.plugin.config import ServerDefaults

    monkeypatch.setattr(batch_diff, "FEWEST", 4)
    monkeypatch.setattr(columns, "_COLUMNS", [None])
    monkeypatch.setattr(rows_module, "_LAST", {})
    monkeypatch.setattr(rows_module, "_BATCHES", Bounded(256))
    built, plans = [], []
    real_cat, real_of = torch.cat, BatchPlan._of
    monkeypatch.setattr(BatchPlan, "_of", classmethod(lambda cls, *a: plans.append(1) or real_of.__func__(cls, *a)))
    rng = random.Random(seed)
    N, S = 8, 3
    specs = [None, {"policy": "talon", "budget": 6}, {"policy": "salf", "budget": 6, "th": 0.1},
             {"policy": "eagle2", "budget": 5}, {"policy": "c2t", "budget": 6}, {"policy": "talon", "budget": 7}]
    sets = {i: parse_spec(s) for i, s in enumerate(specs) if s}
    arrive = lambda: SimpleNamespace(_treespec_params=sets.get(rng.randrange(len(specs) - rng.randint(0, 1))),
                                     _treespec_shares=rng.random() < 0.5)
    batch, d, carried = [arrive() for _ in range(24)], ServerDefaults(token_cap=32), 0
    for _ in range(60):
        batch = [r for r in batch if rng.random() > 0.1] + [arrive() for _ in range(rng.choice([0, 1, 2]))]
        cols = columns.batch_columns(batch, d)
        params, _ = cols.selection(N, S)
        if params is None:
            continue
        came = batch_diff.carried_from(params)
        last_rows = rows_module._LAST.get("rows")
        monkeypatch.setattr(torch, "cat", lambda t, *a, **k: built.append(len(t)) or real_cat(t, *a, **k))
        n_built, n_plans = len(built), len(plans)
        table = policy_rows(params, "cpu", cols.shares)
        plan = BatchPlan.of(params, N, S)
        monkeypatch.setattr(torch, "cat", real_cat)
        want = torch.cat([request_row(p, "cpu", s) for p, s in zip(params, cols.shares)])
        assert torch.equal(table, want)
        fresh = BatchPlan._of(params, N, S)
        plans.pop()
        assert (plan.stages, plan.clf_ids, plan.mask_depth, plan.salf) == (
            fresh.stages, fresh.clf_ids, fresh.mask_depth, fresh.salf)
        if came is not None and last_rows is not None and came[0] is last_rows[0]:
            carried += 1  # the table came from the last one's slices and the new rows: no table of bs rows
            assert all(n < len(batch) for n in built[n_built:]) or len(batch) < 2
            old_sets = {id(p) for p in came[0]}
            if {id(p) for p in params} == old_sets:
                assert len(plans) == n_plans  # the same sets: the plan carried over
    assert carried > 10


def test_a_carry_takes_only_the_last_tables_own_change_on_its_device_and_shape(monkeypatch):
    """``per_batch``'s carry is the last value's: a tuple carried over from another than the last one, a table
    asked on another device, a plan at another (N, S) are built afresh; each answer equals the one built."""
    from treespec_sglang.plugin import batch_diff

    monkeypatch.setattr(batch_diff, "FEWEST", 1)
    monkeypatch.setattr(rows_module, "_LAST", {})
    monkeypatch.setattr(rows_module, "_BATCHES", Bounded(256))
    talon, salf = parse_spec({"policy": "talon", "budget": 6}), parse_spec({"policy": "salf", "budget": 6, "th": 0.1})
    reqs = tuple(object() for _ in range(6))
    old = (talon, salf, None, talon, salf, None)
    change = batch_diff.diff(reqs, reqs[1:] + (object(),))
    new = change.apply(old, lambda i, j: [salf] * (j - i), noted=True)
    fresh = lambda params, device: torch.cat([request_row(p, device) for p in params])
    policy_rows(old, "cpu")
    on_meta = policy_rows(new, "meta")  # another device: built there (a carry would mix the devices)
    assert on_meta.is_meta and on_meta.shape == (6, len(COLUMNS))
    policy_rows(old, "cpu")
    other = (None,) * 6
    policy_rows(other, "cpu")  # the last table is another batch's: the change from old says nothing of it
    assert torch.equal(policy_rows(new, "cpu"), fresh(new, "cpu"))
    plans, real_of = [], BatchPlan._of
    monkeypatch.setattr(BatchPlan, "_of", classmethod(lambda cls, *a: plans.append(a[1:]) or real_of.__func__(cls, *a)))
    BatchPlan.of(old, 8, 3)
    assert BatchPlan.of(new, 9, 3).salf == real_of(new, 9, 3).salf and plans == [(8, 3), (9, 3)]
    BatchPlan.of(old, 8, 3)
    BatchPlan.of(new, 8, 3)
    assert plans == [(8, 3), (9, 3)]  # the same sets, the same shape: carried
