"""Per-request policies inside SGLang's captured draft pool (sglang-free parts of the plugin)."""

import math
import random

import pytest
import torch

from tests.helpers import PathDraft, random_batch
from tests.plugin.pools import MIXED_SPECS, OTHER_CLF, chain_oracle, expected_paths, kept_paths, pool, reachable
from tests.policies import oracles
from treespec_sglang.plugin.pool import COLUMNS, policy_rows, request_row, select_from_pool, share_token_cap, \
    unlink_filler
from treespec_sglang.policies import parse_spec
from treespec_sglang.policies.classifier import load_classifier
from treespec_sglang.tree import DraftTree, sglang_retrive
from treespec_sglang.utils.cuda_graphs import capture
from treespec_sglang.utils.syncs import count_ops


def test_native_rows_equal_organize_draft_results():
    _, sl, tl, pl, _ = pool()
    N = 12
    parent_list, top, toks, keep = select_from_pool(sl, tl, pl, N, 4, [None] * 3)
    scores = torch.cat(sl, 1).flatten(1)
    ref = torch.sort(torch.topk(scores, N - 1, dim=-1).indices).values
    assert torch.equal(top, ref) and keep.all()
    assert torch.equal(toks, torch.gather(torch.cat(tl, 1), 1, ref))
    assert torch.equal(parent_list, torch.cat(pl[:-1], 1))


@pytest.mark.parametrize("spec", [{"policy": "talon", "budget": 9, "topk": 3, "mu": 0.05},
                                  {"policy": "talon", "budget": 12, "topk": 4, "mu": 0.01},
                                  {"policy": "salf", "budget": 10, "batch": 3, "th": 0.0},
                                  {"policy": "chain", "length": 3},
                                  {"policy": "c2t", "budget": 10, "topk": 4, "beta": 0.2},
                                  {"policy": "eagle2", "budget": 6, "topk": 4, "depth": 4},
                                  {"policy": "eagle2", "budget": 9, "topk": 4, "depth": 2},
                                  {"policy": "eagle2", "budget": 6, "topk": 6, "depth": 1}])
def test_policy_rows_select_the_policy_tree_on_the_beam(spec):
    draft, sl, tl, pl, paths = pool(seed=3)
    roots = [3, 5, 7]
    N, k = 12, 4
    params = [parse_spec(spec), None, parse_spec(spec)]
    native = select_from_pool(sl, tl, pl, N, k, [None] * 3)[:3]
    parent_list, top, toks, keep = select_from_pool(sl, tl, pl, N, k, params, native=native)
    assert top.shape == (3, N - 1) and keep[1].all()
    assert torch.equal(top[1], native[1][1])
    beam = oracles.BeamDraft(draft, sl, paths, 30)
    for b in (0, 2):
        got = kept_paths(top, keep, paths, roots, b)
        if spec["policy"] == "talon":
            ref = oracles.talon(beam, roots[b], spec["budget"], spec["topk"], spec["mu"])
            expect = {ref.path(i) for i in range(len(ref.tok))}
        elif spec["policy"] == "salf":
            expect = oracles.salf(beam, roots[b], spec["budget"], spec["batch"], spec["th"])
        elif spec["policy"] == "c2t":
            ref = oracles.c2t(beam, roots[b], spec["budget"], spec["topk"], spec["beta"], 10, load_classifier(None))
            expect = {ref.path(i) for i in range(len(ref.tok))}
        elif spec["policy"] == "chain":
            expect, p = {(roots[b],)}, (roots[b],)
            for _ in range(spec["length"]):
                lp = beam.logprobs(p)
                if not torch.isfinite(lp).any():
                    break
                p = p + (int(lp.argmax()),)
                expect.add(p)
        else:  # eagle2 budget < N: SGLang's budget - 1 best of the levels down to its depth (level 1: f < k)
            scores = torch.cat(sl, 1).flatten(1)[b].tolist()
            level = [1 if f < k else 2 + (f - k) // (k * k) for f in range(len(scores))]
            ranked = sorted((f for f in range(len(scores)) if level[f] <= spec["depth"]), key=lambda f: (-scores[f], f))
            expect = {(roots[b],)} | {paths[b][f] for f in ranked[:spec["budget"] - 1]}
        assert got == expect, spec
        # the filler is unlinked: verification can only walk the policy's tree
        tree = DraftTree.from_lists([[roots[b]] + toks[b].tolist()],
                                    [oracles_parents(parent_list[b], top[b], k, N)])
        r = sglang_retrive(tree)
        nt, ns = unlink_filler(r.retrive_next_token, r.retrive_next_sibling, keep[b:b + 1])
        assert reachable(nt, ns, 0) == [i for i in range(N) if keep[b, i]]


@pytest.mark.parametrize("seed", range(12))
def test_mixed_batches_select_each_policy_tree_as_its_plain_oracle_alone(seed):
    """Random pools (k, S, N) and batches mixing every policy, native rows and two classifiers: each
    row's kept nodes are its policy's tree from the plain one-request oracle over the beam."""
    rng = random.Random(seed)
    k, steps, bs = rng.choice([2, 3, 4]), rng.choice([2, 3, 4]), 8
    N = rng.choice([n for n in (5, 8, 12, 20) if n - 1 <= k + (steps - 1) * k * k])  # SGLang: N - 1 <= pool
    roots = rng.sample(range(30), bs)
    draft, sl, tl, pl, paths = pool(topk=k, steps=steps, seed=seed, roots=roots)
    specs = [rng.choice(MIXED_SPECS) for _ in range(bs)]
    params = [None if s is None else parse_spec(s) for s in specs]
    native = select_from_pool(sl, tl, pl, N, k, [None] * bs)[:3]
    _, top, toks, keep = select_from_pool(sl, tl, pl, N, k, params, native=native)
    beam = oracles.BeamDraft(draft, sl, paths, 30)
    scores = torch.cat(sl, 1).flatten(1)
    for b, p in enumerate(params):
        got = kept_paths(top, keep, paths, roots, b)
        assert got == expected_paths(p, beam, roots[b], N, scores[b], paths[b]), (k, steps, N, specs[b])


@pytest.mark.parametrize("seed", range(3))
def test_a_batch_of_early_stopping_chains_alone_uses_the_classifier(seed):
    """Chains with a C2T stop and no c2t row in the batch: the classifier still scores them."""
    roots = [4, 9, 13]
    draft, sl, tl, pl, paths = pool(topk=3, steps=4, seed=seed, roots=roots)
    specs = [{"policy": "chain", "length": 3, "beta": b} for b in (0.2, 0.5, 0.8)]
    _, top, _, keep = select_from_pool(sl, tl, pl, 10, 3, [parse_spec(x) for x in specs])
    beam = oracles.BeamDraft(draft, sl, paths, 30)
    got = [kept_paths(top, keep, paths, roots, b) for b in range(3)]
    assert got == [chain_oracle(beam, r, 3, x["beta"], load_classifier(None)) for r, x in zip(roots, specs)]
    assert len({len(g) for g in got}) > 1 or any(len(g) < 4 for g in got), "no chain was cut: the test cannot fail"


@pytest.mark.parametrize("seed", range(3))
def test_each_c2t_row_is_scored_by_its_own_classifier(seed):
    """Two classifiers in one batch, the same beta: each row's tree is its own classifier's (oracle), and
    the two trees differ for at least one pool, so a row scored by the other classifier would show."""
    roots = [2, 6, 11, 17]
    draft, sl, tl, pl, paths = pool(topk=3, steps=4, seed=seed, roots=roots)
    specs = [{"policy": "c2t", "budget": 12, "topk": 3, "beta": 0.3, "classifier": c}
             for c in (None, OTHER_CLF, None, OTHER_CLF)]
    _, top, _, keep = select_from_pool(sl, tl, pl, 14, 3, [parse_spec(x) for x in specs])
    beam = oracles.BeamDraft(draft, sl, paths, 30)
    for b, x in enumerate(specs):
        own = oracles.c2t(beam, roots[b], 12, 3, 0.3, 10, load_classifier(x["classifier"]))
        assert kept_paths(top, keep, paths, roots, b) == {own.path(i) for i in range(len(own.tok))}


def test_the_two_classifiers_give_different_trees():
    draft, sl, tl, pl, paths = pool(topk=3, steps=4, seed=0, roots=[2])
    beam = oracles.BeamDraft(draft, sl, paths, 30)
    trees = [oracles.c2t(beam, 2, 12, 3, 0.3, 10, load_classifier(c)).tok for c in (None, OTHER_CLF)]
    assert trees[0] != trees[1]


@pytest.mark.parametrize("seed", [84, 154, 234, 245])
def test_salf_where_g_is_full_early_matches_its_oracle(seed):
    """Small SALF budgets and low th, where G fills within a few pops and line 12's ``pr > eps`` decides
    which popped nodes count toward the stop (found by searching seeds where dropping it changes a tree)."""
    rng = random.Random(seed)
    k, steps = rng.choice([2, 3, 4]), rng.choice([3, 4])
    N = 20 if k + (steps - 1) * k * k >= 19 else 8
    roots = rng.sample(range(30), 4)
    draft = PathDraft(30, seed=seed, sharpness=rng.choice([1.0, 2.0, 3.0]))
    sl, tl, pl, paths = oracles.sglang_pool_lists(draft, roots, k, steps)
    specs = [{"policy": "salf", "budget": rng.randint(3, 8), "batch": rng.randint(1, 3),
              "th": rng.choice([0.02, 0.05, 0.1, 0.2])} for _ in roots]
    _, top, _, keep = select_from_pool(sl, tl, pl, N, k, [parse_spec(x) for x in specs])
    beam = oracles.BeamDraft(draft, sl, paths, 30)
    for b, x in enumerate(specs):
        assert kept_paths(top, keep, paths, roots, b) == oracles.salf(beam, roots[b], x["budget"], x["batch"], x["th"])


OP_BUDGETS = [  # (policy specs cycled over the batch, most ATen ops per round)
    ([{"policy": "eagle2", "budget": 48}], 300), ([{"policy": "talon", "budget": 48}], 300),
    ([{"policy": "salf", "budget": 48}], 300), ([{"policy": "c2t", "budget": 48}], 300),
    ([{"policy": "chain", "length": 6}], 300),
    ([{"policy": "talon", "budget": 48}, {"policy": "salf", "budget": 48}, {"policy": "c2t", "budget": 48},
      {"policy": "eagle2", "budget": 48}], 900)]


@pytest.fixture(scope="module")
def big_pools():
    """SGLang-shaped pools at topk 8, steps 6 (P = 328) for 16 and 64 requests."""
    draft = PathDraft(30, seed=11, sharpness=1.5)
    return {bs: oracles.sglang_pool_lists(draft, list(range(bs)), 8, 6)[:3] for bs in (16, 64)}


@pytest.mark.parametrize("specs,max_ops", OP_BUDGETS)
def test_selection_reads_nothing_back_and_its_op_count_does_not_grow_with_the_batch(big_pools, specs, max_ops):
    """Steady state (the requests' rows built, second call): no host read, no host->device list copy,
    and the same number of ATen ops at bs 16 and 64, within the budget (N 48)."""
    counts = []
    for bs, lists in big_pools.items():
        params = [parse_spec(specs[i % len(specs)]) for i in range(bs)]
        rows = policy_rows(params, "cpu")
        first = select_from_pool(*lists, 48, 8, params, rows=rows)
        with count_ops() as c:
            again = select_from_pool(*lists, 48, 8, params, rows=rows)
        assert (c.reads, c.copies) == (0, 0), c.names
        assert all(torch.equal(x, y) for x, y in zip(first, again))
        counts.append(c.ops)
    assert counts[0] == counts[1] <= max_ops, counts


def test_rows_are_built_once_per_parameter_set():
    """A request's parameter row is copied to the device once; later batches reuse it (no list copy)."""
    from treespec_sglang.plugin import rows as rows_module

    p = parse_spec({"policy": "talon", "budget": 23, "mu": 0.07})
    rows_module._ROWS.clear()  # the cache is per process: start from an empty one
    with count_ops() as first:
        a = request_row(p, "cpu")
        request_row(None, "cpu")
    with count_ops() as again:
        b = policy_rows([p, None, p], "cpu")
    assert first.copies == 2 and again.copies == 0
    assert b[0].data_ptr() != a.data_ptr() and torch.equal(b[0], a[0]) and torch.equal(b[2], a[0])
    assert a[0, COLUMNS.index("budget")] == 23 and a[0, COLUMNS.index("log_mu")] == pytest.approx(math.log(0.07))


@pytest.mark.parametrize("seed", range(3))
def test_a_batchs_row_table_is_each_requests_row_in_order(seed):
    """``policy_rows`` builds each (parameter set, shares) row once and maps them over the batch by id: on random
    batches (one object shared by several requests, equal parameters in separate objects, natives, rows sharing
    the token cap or not) it equals the requests' own rows stacked in batch order."""
    rng = random.Random(seed)
    specs = [None, {"policy": "talon", "budget": 9}, {"policy": "salf", "th": 0.2}, {"policy": "eagle2", "budget": 5}]
    shared = [None if s is None else parse_spec(s) for s in specs]
    params, shares = [], []
    for _ in range(rng.randint(1, 20)):
        i = rng.randrange(len(specs))
        params.append(shared[i] if rng.random() < 0.5 or specs[i] is None else parse_spec(specs[i]))
        shares.append(rng.random() < 0.5)
    want = torch.stack([request_row(p, "cpu", s)[0] for p, s in zip(params, shares)])
    assert torch.equal(policy_rows(params, "cpu", shares), want)


def test_by_id_reads_each_rows_parameters_and_keeps_a_tuples_answer():
    """``rows.by_id``: each row's id and the id -> parameters map; a tuple's answer is kept (asked again: the same
    answer), a list's or another tuple's (equal in value) is worked out again, and each answer is its own."""
    from treespec_sglang.plugin.rows import by_id

    a, b = parse_spec({"policy": "talon", "budget": 9}), parse_spec({"policy": "talon", "budget": 9})
    rows = (a, None, b, a)
    ids, of = by_id(rows)
    assert ids == (id(a), id(None), id(b), id(a)) and of == {id(a): a, id(None): None, id(b): b}
    assert by_id(rows) == (ids, of) and by_id(rows)[1] is of
    again = tuple([a, None, a, a])
    assert by_id(again)[0] == (id(a), id(None), id(a), id(a)) and by_id(list(rows))[1] is not of
    assert by_id(rows)[1] is of  # the two last tuples are kept


def oracles_parents(parent_list, top, k, N):
    sel = top.tolist()
    parents = [-1]
    for i in range(1, N):
        tb = sel[i - 1] // k
        parents.append(0 if tb == 0 else sel.index(int(parent_list[tb])) + 1)
    return parents


@pytest.mark.parametrize("seed", range(6))
def test_unlink_filler_keeps_exactly_the_kept_subtree(seed):
    rng = random.Random(seed)
    t = random_batch(rng, [14, 9, 20], vocab=50, max_children=4)
    keep = torch.zeros(t.tokens.shape, dtype=torch.bool)
    for b in range(t.bs):  # random ancestor-closed subsets
        keep[b, 0] = True
        for i in range(1, int(t.size[b])):
            keep[b, i] = bool(keep[b, t.parents[b, i]]) and rng.random() < 0.7
    r = sglang_retrive(t)
    nt, ns = unlink_filler(r.retrive_next_token, r.retrive_next_sibling, keep)
    for b in range(t.bs):
        assert reachable(nt, ns, b) == [i for i in range(t.n_nodes) if keep[b, i]]
        for u in range(t.n_nodes):  # kept children in index order along the new chains
            if keep[b, u]:
                kids, c = [], int(nt[b, u])
                while c >= 0:
                    kids.append(c)
                    c = int(ns[b, c])
                assert kids == [j for j in range(1, int(t.size[b])) if t.parents[b, j] == u and keep[b, j]]


def best_closed_value(parents, vals, cand, count):
    """Brute force: the best sum of ``vals`` over ancestor-closed subsets of ``cand`` (root implied) of size <= count."""
    nodes = [i for i in range(1, len(parents)) if cand[i]]
    best = 0.0
    for mask in range(1 << len(nodes)):
        pick = {nodes[j] for j in range(len(nodes)) if mask >> j & 1}
        if len(pick) <= count and all(parents[i] == 0 or parents[i] in pick for i in pick):
            best = max(best, sum(vals[i] for i in pick))
    return best


@pytest.mark.parametrize("seed,per_request,shares", [(0, 2, (1, 1, 1)), (1, 3, (1, 0, 1)), (2, 4, (1, 1, 0)),
                                                     (3, 1, (1, 1, 1)), (4, 9, (0, 1, 1))])
def test_token_cap_on_the_pool_is_optimal_and_closed(seed, per_request, shares):
    """--treespec-token-cap on SGLang's verify layout: the sharing rows keep the best ancestor-closed
    set of (per_request - 1) x sharing nodes of the batch (brute force over 2^candidates), the other rows
    their whole policy tree, and the unlinked chains reach exactly the kept nodes."""
    draft, sl, tl, pl, paths = pool(topk=2, steps=3, seed=seed)
    N, k = 7, 2
    params = [parse_spec({"policy": "talon", "budget": 5, "topk": 2, "mu": 0.05}), parse_spec(
        {"policy": "eagle2", "budget": 7, "topk": 2, "depth": 3}), parse_spec({"policy": "salf", "budget": 6, "th": 0.0})]
    parent_list, top, toks, keep = select_from_pool(sl, tl, pl, N, k, params)
    scores = torch.cat(sl, 1).flatten(1).float()
    share = torch.tensor(shares, dtype=torch.bool)
    got = share_token_cap(scores, top, keep, share, per_request)
    assert torch.equal(got[~share], keep[~share]) and not (got & ~keep).any() and got[:, 0].all()
    parents = [oracles_parents(parent_list[b], top[b], k, N) for b in range(3)]
    vals = [[0.0] + torch.gather(scores[b], 0, top[b]).tolist() for b in range(3)]
    left = (per_request - 1) * int(share.sum())
    # the joint optimum over the sharing rows: a knapsack of each row's best closed value per size
    rows = [b for b in range(3) if shares[b]]
    per_size = {b: [best_closed_value(parents[b], vals[b], keep[b].tolist(), c) for c in range(N)] for b in rows}
    best = {0: 0.0}
    for b in rows:
        nxt = {}
        for used, v in best.items():
            for c in range(N):
                if used + c <= left:
                    nxt[used + c] = max(nxt.get(used + c, -1.0), v + per_size[b][c])
        best = nxt
    got_value = sum(vals[b][i] for b in rows for i in range(1, N) if got[b, i])
    assert int(got[rows][:, 1:].sum()) <= left
    assert got_value == pytest.approx(max(best.values()), abs=1e-6)
    for b in range(3):
        assert all(parents[b][i] == 0 or bool(got[b, parents[b][i]]) for i in range(1, N) if got[b, i])
        tree = DraftTree.from_lists([[0] + toks[b].tolist()], [parents[b]])
        r = sglang_retrive(tree)
        nt, ns = unlink_filler(r.retrive_next_token, r.retrive_next_sibling, got[b:b + 1])
        assert reachable(nt, ns, 0) == [i for i in range(N) if got[b, i]]


@pytest.mark.gpu
@pytest.mark.parametrize("bs", [1, 16, 64])
def test_selection_replays_in_a_cuda_graph_as_it_runs_eagerly(big_pools, bs):
    """A mixed batch's selection captured in a torch CUDA graph: the replay equals the eager call on the
    GPU and on the CPU, and a replay on new pool values (copied into the captured inputs) equals eager."""
    lists = big_pools[64]
    specs = [s for specs, _ in OP_BUDGETS for s in specs]
    params = [parse_spec(specs[i % len(specs)]) if i % 7 else None for i in range(bs)]
    cpu = [[t[:bs] for t in part] for part in lists]
    dev = [[t.cuda() for t in part] for part in cpu]
    rows = policy_rows(params, "cuda")
    call = lambda: select_from_pool(*dev, 48, 8, params, rows=rows)  # noqa: E731
    eager = call()
    graph, captured = capture(call)
    graph.replay()
    torch.cuda.synchronize()
    on_cpu = select_from_pool(*cpu, 48, 8, params)
    for e, c, h in zip(eager, captured, on_cpu):
        assert torch.equal(e, c) and torch.equal(e.cpu(), h)
    # new values through the same graph: the pool of other requests (rows flipped)
    other = [[t.flip(0)[:bs] for t in part] for part in lists]
    for part_dst, part_src in zip(dev, other):
        for d, s in zip(part_dst, part_src):
            d.copy_(s)
    graph.replay()
    torch.cuda.synchronize()
    again = select_from_pool(*[[t.cuda() for t in part] for part in other], 48, 8, params, rows=rows)
    for c, a in zip(captured, again):
        assert torch.equal(c, a)


def test_a_c2t_row_naming_no_classifier_takes_the_servers_default_registration(tmp_path, monkeypatch):
    """``--treespec-classifier default=PATH``: a request naming no classifier is scored by the operator's file
    (as one naming ``default`` is, and as ``/server_info``'s digest says), not by the shipped classifier."""
    import json

    from treespec_sglang.plugin import classifiers

    path = tmp_path / "mine.pt"
    OTHER_CLF.save(str(path))
    monkeypatch.setenv(classifiers.ENV_CLASSIFIERS, json.dumps({"default": str(path)}))
    roots = [2]
    draft, sl, tl, pl, paths = pool(topk=3, steps=4, seed=0, roots=roots)
    spec = {"policy": "c2t", "budget": 12, "topk": 3, "beta": 0.3}
    _, top, _, keep = select_from_pool(sl, tl, pl, 14, 3, [parse_spec(spec)])
    beam = oracles.BeamDraft(draft, sl, paths, 30)
    mine = oracles.c2t(beam, 2, 12, 3, 0.3, 10, classifiers.registered()["default"])
    shipped = oracles.c2t(beam, 2, 12, 3, 0.3, 10, load_classifier(None))
    assert {mine.path(i) for i in range(len(mine.tok))} != {shipped.path(i) for i in range(len(shipped.tok))}
    assert kept_paths(top, keep, paths, roots, 0) == {mine.path(i) for i in range(len(mine.tok))}
