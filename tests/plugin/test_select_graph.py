"""The fused selection's captured launch (``TREESPEC_SELECT=graph``): batch-independent runtime ints and static
buffers select the trees a launch planned for the batch selects, which ``run_both`` checks against the torch
selection (the oracle). On the CPU nothing is captured: the same static-buffer launch runs in Triton's
interpreter; the ``gpu`` test captures and replays."""

import random

import pytest
import torch

from tests.plugin.kernel_cases import DEVICES, OTHER, SHAPES, STAGES, THIRD, make_pool, native_of, random_spec, run_both
from treespec_sglang.plugin.pool import BatchPlan, policy_rows, request_row
from treespec_sglang.policies import parse_spec

pytest.importorskip("triton")
from treespec_sglang.plugin.pool_kernels import _launch_plan, graph_args  # noqa: E402
from treespec_sglang.plugin import select_graph  # noqa: E402
from treespec_sglang.plugin.select_graph import SelectionGraph  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")


def stash_of(pool, rows):
    """The draft stash of a ``rows``-row replay whose first ``bs`` rows are ``pool``; the padding rows hold
    another pool (a padded replay computes on dummy rows)."""
    bs, P = pool.scores.shape
    pad = make_pool(pool.k, pool.steps, rows - bs, seed=99, kind="invalid") if rows > bs else None
    cat = (lambda a, b: a if pad is None else torch.cat([a, b.to(a.device)]))
    return (cat(pool.scores, None if pad is None else pad.scores).contiguous(),
            cat(pool.tokens, None if pad is None else pad.tokens).contiguous(),
            cat(pool.parent_list, None if pad is None else pad.parent_list).contiguous())


def batch(k, S, N, n, seed, kind="random", device="cpu"):
    rng = random.Random(seed)
    stages = (STAGES * (n // len(STAGES) + 1))[:n] if n >= len(STAGES) else rng.choices(STAGES, k=n)
    rng.shuffle(stages)
    pool = make_pool(k, S, n, seed=rng.randint(0, 10 ** 6), kind=kind, device=device)
    params = [None if s is None else parse_spec(s) for s in (random_spec(st, rng, k, S, N) for st in stages)]
    assert len(params) == n == pool.scores.shape[0], (len(params), n)
    return pool, params


def graph_select(g, pool, params, N):
    native = native_of(pool, N)
    return g.run(policy_rows(params, pool.scores.device), native[1])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", ["random", "ties", "invalid"])
@pytest.mark.parametrize("k,S,N", SHAPES)
def test_one_graph_serves_changing_batches_with_the_planned_trees(k, S, N, kind, device):
    """One graph of 12 rows, three rounds of 9, 12 and 5 requests (every stage, random parameters, classifiers
    chosen per request): each round equals the launch planned for that batch, itself checked against torch."""
    first, _ = batch(k, S, N, 12, seed=0, device=device)
    stash = stash_of(first, 12)
    g = SelectionGraph(stash, k, N, clf_ids=_clf_ids(OTHER, THIRD), capture=False)
    for r, n in enumerate((9, 12, 5)):
        pool, params = batch(k, S, N, n, seed=100 * k + 10 * S + r, kind=kind, device=device)
        for buf, src in zip(stash, (pool.scores, pool.tokens, pool.parent_list)):
            buf[:n].copy_(src)  # this round's replay wrote its n rows
        want = run_both(pool, N, params, native_of(pool, N), margins=kind != "ties")
        got = graph_select(g, pool, params, N)
        for name, a, b in zip(("top_scores_index", "draft_tokens", "node_keep", "sizes"), want[1:] + (
                want[3].sum(-1),), got):
            assert torch.equal(a, b), (name, r, (a != b).nonzero()[:4].tolist())


def _clf_ids(*mods):
    """The row-table classifier ids of the default classifier and ``mods`` (numbered on first sight)."""
    params = [parse_spec({"policy": "c2t", "classifier": m}) for m in (None,) + mods]
    return BatchPlan.of(params, 8, 3).clf_ids


@pytest.mark.parametrize("k,S,N", SHAPES)
def test_graph_args_cover_every_planned_launch(k, S, N):
    """The batch-independent ints are a superset of every planned launch's: its flags (but the stand-ins'),
    SALF's pops, B and G's bound at least the batch's."""
    P = k + (S - 1) * k * k
    for seed in range(20):
        _, params = batch(k, S, N, 8, seed=seed)
        plan = _launch_plan(params, N, S, P)
        g = graph_args(N, S, P, scored=True)
        assert plan["flags"] & ~g["flags"] == 0
        assert g["pops"] >= plan["pops"] and g["b_max"] >= plan["b_max"] and g["kth"] >= plan["kth"]
    assert graph_args(N, S, P, scored=False)["flags"] & 16 == 0  # no classifier table: no confidences


def test_a_custom_rule_keep_is_read_for_its_round_only():
    """A custom pool rule's keep goes into the graph's extra input for its round; the next round has none."""
    k, S, N = 4, 3, 8
    pool, _ = batch(k, S, N, 4, seed=5)
    g = SelectionGraph(stash_of(pool, 6), k, N, capture=False)
    params = [parse_spec({"policy": "eagle2", "budget": 3})] * 4
    rows, native = policy_rows(params, "cpu"), native_of(pool, N)[1]
    kept = lambda out: [t.clone() for t in out]  # noqa: E731 (a run's outputs are views until the next run)
    plain = kept(g.run(rows, native))
    extra = torch.zeros(4, pool.scores.shape[1], dtype=torch.bool)
    extra[:, -1] = True  # the last pool node, never in a budget-3 tree of the best nodes
    marked = kept(g.run(rows, native, extra))
    again = g.run(rows, native)
    assert not torch.equal(marked[2], plain[2]) and (marked[2].sum(-1) == plain[2].sum(-1) + 1).all()
    assert all(torch.equal(a, b) for a, b in zip(plain, again))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("k,S,N", [(4, 3, 8), (4, 5, 16)])
def test_the_graphs_share_one_scratch_and_never_read_what_it_held(k, S, N, device):
    """Selection graphs of one pool width share the kernel's scratch (one buffer, where a graph per captured batch
    size held its own), grown by a larger graph; each round, with the scratch poisoned before it (another graph's
    leftovers, or garbage), equals the launch planned for its batch. Captured as CUDA graphs where there is CUDA
    (off CUDA nothing is captured: the same static-buffer launch)."""
    select_graph._WORKSPACE.clear()
    small, _ = batch(k, S, N, 5, seed=1, device=device)
    g5 = SelectionGraph(stash_of(small, 5), k, N, clf_ids=_clf_ids(OTHER, THIRD), capture=True)
    big, _ = batch(k, S, N, 12, seed=2, device=device)
    g12 = SelectionGraph(stash_of(big, 12), k, N, clf_ids=_clf_ids(OTHER, THIRD), capture=True)
    (shared,) = select_graph._WORKSPACE.values()
    assert shared[0].shape[0] == 12 and g12.out[3].data_ptr() == shared[0].data_ptr()
    g3 = SelectionGraph(stash_of(small, 5), k, N, clf_ids=_clf_ids(OTHER, THIRD), capture=True)  # no growth
    assert len(select_graph._WORKSPACE) == 1 and next(iter(select_graph._WORKSPACE.values())) is shared
    assert g3.out[3].data_ptr() == shared[0].data_ptr() and g3.out[3].shape[0] == 5
    gen = torch.Generator().manual_seed(k * S)
    for r, (g, n) in enumerate([(g12, 9), (g3, 5), (g5, 5), (g12, 12), (g3, 2), (g5, 3)]):
        for t in g.out[3:]:  # the scratch this graph reads (g5 still holds the buffer before the growth), poisoned
            t.copy_(torch.randint(-2 ** 30, 2 ** 30, t.shape, generator=gen).to(t.dtype))
        g.out[4][:, ::3] = float("nan")
        pool, params = batch(k, S, N, n, seed=50 + r, device=device)
        for buf, src in zip(g.stash, (pool.scores, pool.tokens, pool.parent_list)):
            buf[:n].copy_(src)
        want = run_both(pool, N, params, native_of(pool, N))
        got = graph_select(g, pool, params, N)
        for name, a, b in zip(("top_scores_index", "draft_tokens", "node_keep", "sizes"), want[1:] + (
                want[3].sum(-1),), got):
            assert torch.equal(a, b), (name, r, (a != b).nonzero()[:4].tolist())


def test_padding_rows_return_to_native_after_a_bigger_batch():
    """Rows a bigger batch filled are native rows again when a smaller batch follows (their pool rows are a
    padded replay's); the graph's input table shows it."""
    k, S, N = 4, 3, 8
    pool, params = batch(k, S, N, 6, seed=7)
    g = SelectionGraph(stash_of(pool, 6), k, N, capture=False)
    g.run(policy_rows(params, "cpu"), native_of(pool, N)[1])
    g.run(policy_rows(params[:2], "cpu"), native_of(pool, N)[1][:2])
    assert torch.equal(g.rows_in[2:], request_row(None, "cpu").expand(4, -1))


def test_a_round_costs_a_handful_of_ops_whatever_the_batch():
    """Steady state on the CPU: the same ATen ops at 3 and 12 requests, none read back (on CUDA the launch is one
    replay; here the uncaptured launch's own plumbing is counted too, the same at both sizes)."""
    from treespec_sglang.utils.syncs import count_ops

    counts = []
    for n in (3, 12):
        pool, params = batch(4, 3, 8, n, seed=3)
        g = SelectionGraph(stash_of(pool, 12), 4, 8, clf_ids=_clf_ids(OTHER), capture=False)
        rows, native = policy_rows(params, "cpu"), native_of(pool, 8)[1]
        g.run(rows, native)
        with count_ops() as c:
            g.run(rows, native)
        assert (c.reads, c.copies) == (0, 0), c.names
        counts.append(c.ops)
    assert counts[0] == counts[1], counts


def test_a_steady_batch_does_not_copy_its_rows_again():
    """The row table of a steady batch (the same cached tensor as last round) is already in the graph's input: one
    copy fewer than for a new table of the same values; a table between two uses of another is copied again."""
    from treespec_sglang.utils.syncs import count_ops

    k, S, N = 4, 3, 8
    pool, params = batch(k, S, N, 6, seed=11)
    g = SelectionGraph(stash_of(pool, 6), k, N, capture=False)
    rows, native = policy_rows(params, "cpu"), native_of(pool, N)[1]
    want = [t.clone() for t in g.run(rows, native)]
    copies = []
    for table in (rows, rows.clone(), rows):  # the cached table again, an equal new one, the first one again
        with count_ops() as c:
            got = g.run(table, native)
        copies.append(c.names["aten::copy_"])
        assert all(torch.equal(a, b) for a, b in zip(want, got))
    assert copies[0] + 1 == copies[1] == copies[2], copies
    eagle = [parse_spec({"policy": "eagle2", "budget": 3})] * 6  # other values in a new table: read this round
    got = g.run(policy_rows(eagle, "cpu"), native)
    assert (got[2].sum(-1) == 3).all() and torch.equal(g.rows_in, policy_rows(eagle, "cpu"))


def test_a_graph_reads_sglangs_selection_where_the_replay_stashed_it():
    """With the stash of SGLang's own selection (``native``) the graph reads it in place: no copy in a steady round,
    the native rows follow what the replay wrote there, and a graph without that stash needs it passed."""
    from treespec_sglang.utils.syncs import count_ops

    k, S, N = 4, 3, 8
    pool, params = batch(k, S, N, 6, seed=13)
    params[0] = params[3] = None  # native rows: they take SGLang's selection verbatim
    stash, rows, native = stash_of(pool, 6), policy_rows(params, "cpu"), native_of(pool, N)[1]
    want = [t.clone() for t in SelectionGraph(stash, k, N, capture=False).run(rows, native)]
    buf = native.clone()  # [rows, N-1], what the draft replay writes beside the pool
    g, own = SelectionGraph(stash, k, N, capture=False, native=buf), SelectionGraph(stash, k, N, capture=False)
    assert all(torch.equal(a, b) for a, b in zip(want, g.run(rows)))
    own.run(rows, native)
    with count_ops() as c:
        got = g.run(rows)
    assert all(torch.equal(a, b) for a, b in zip(want, got))
    with count_ops() as c_own:
        own.run(rows, native)
    assert c.names["aten::copy_"] + 1 == c_own.names["aten::copy_"]  # the copy of SGLang's selection, gone
    buf[0] = buf[0].flip(0)  # the next replay's selection for row 0
    assert torch.equal(g.run(rows)[0][0], buf[0]) and not torch.equal(buf[0], want[0][0])
    with pytest.raises(ValueError, match="native_top is required"):
        SelectionGraph(stash, k, N, capture=False).run(rows)


def test_a_round_returns_the_documented_dtypes_as_views_built_once_per_batch_size():
    """``(top int64, tokens as the pool's, keep bool, sizes int64)``, the first ``bs`` rows of the static outputs: the
    same view objects every round of a batch size (no view built per round)."""
    k, S, N = 4, 3, 8
    pool, params = batch(k, S, N, 6, seed=17)
    g = SelectionGraph(stash_of(pool, 6), k, N, capture=False)
    rows, native = policy_rows(params, "cpu"), native_of(pool, N)[1]
    out = g.run(rows, native)
    assert [t.dtype for t in out] == [torch.int64, pool.tokens.dtype, torch.bool, torch.int64]
    assert [tuple(t.shape) for t in out] == [(6, N - 1), (6, N - 1), (6, N), (6,)]
    assert all(a is b for a, b in zip(out, g.run(rows, native)))
    small = g.run(rows[:4], native[:4])
    assert small[2].shape == (4, N) and all(a is b for a, b in zip(small, g.run(rows[:4], native[:4])))
    with pytest.raises(ValueError) as e:
        g.run(rows)
    assert str(e.value) == "SelectionGraph.run: native_top is required when the graph has no stashed selection"


def test_a_graph_of_the_scratchs_rows_shares_it_and_a_larger_one_at_least_doubles_it(monkeypatch):
    """A graph of as many rows as the shared scratch reuses it; one row more reallocates it at twice the rows (a
    batch growing a request at a time reallocates log2(bs) times)."""
    monkeypatch.setattr(select_graph, "_WORKSPACE", {})
    k, S, N = 4, 3, 8
    five, _ = batch(k, S, N, 5, seed=1)
    g5 = SelectionGraph(stash_of(five, 5), k, N, capture=False)
    again = SelectionGraph(stash_of(five, 5), k, N, capture=False)
    (scratch,) = select_graph._WORKSPACE.values()
    assert scratch[0].shape[0] == 5 and again.out[3].data_ptr() == g5.out[3].data_ptr() == scratch[0].data_ptr()
    six, _ = batch(k, S, N, 6, seed=2)
    g6 = SelectionGraph(stash_of(six, 6), k, N, capture=False)
    (scratch,) = select_graph._WORKSPACE.values()
    assert [t.shape[0] for t in scratch] == [10, 10] and g6.out[3].data_ptr() == scratch[0].data_ptr()


def test_a_graph_is_captured_again_with_the_union_of_its_classifiers_for_one_it_lacks(monkeypatch):
    monkeypatch.setattr(select_graph, "GRAPHS", {})
    k, S, N = 4, 3, 8
    pool, _ = batch(k, S, N, 6, seed=19)
    stash = stash_of(pool, 6)
    key = (6, pool.scores.shape[1], pool.parent_list.shape[1], "cpu")
    one, two = _clf_ids(OTHER), _clf_ids(THIRD)
    g = select_graph.graph_for(stash, key, k, N, one)
    assert select_graph.graph_for(stash, key, k, N, one) is g and g.native is None
    both = select_graph.graph_for(stash, key, k, N, two)
    assert both is not g and set(both.clf_ids) == set(one) | set(two) and list(both.clf_ids) == sorted(both.clf_ids)
    assert select_graph.graph_for(stash, key, k, N, one) is both and len(select_graph.GRAPHS) == 1


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_captured_graph_replays_the_planned_trees_on_cuda():
    """Captured once, replayed for three batches of other sizes and policies: each equals the planned launch."""
    k, S, N = 8, 4, 32
    first, _ = batch(k, S, N, 16, seed=0, device="cuda")
    stash = stash_of(first, 16)
    g = SelectionGraph(stash, k, N, clf_ids=_clf_ids(OTHER, THIRD), capture=True)  # every classifier batch() names
    assert g.graph is not None
    for r, n in enumerate((16, 9, 3)):
        pool, params = batch(k, S, N, n, seed=r, device="cuda")
        for buf, src in zip(stash, (pool.scores, pool.tokens, pool.parent_list)):
            buf[:n].copy_(src)
        want = run_both(pool, N, params, native_of(pool, N))
        got = graph_select(g, pool, params, N)
        assert all(torch.equal(a, b) for a, b in zip(want[1:] + (want[3].sum(-1),), got)), r
