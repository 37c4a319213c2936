"""The selection after the draft, on the pool SGLang's draft loop wrote (eager, or a CUDA graph replay)."""

import pytest
import torch

from tests.helpers import PathDraft, Rank1Of2, flat
from tests.policies import oracles
from treespec_sglang.plugin import draft_select, pool_kernels
from treespec_sglang.plugin.draft_select import read_pool, select_after_draft, stash_pool
from treespec_sglang.plugin.hooks import DraftStep
from treespec_sglang.plugin.pool import select_from_pool
from treespec_sglang.policies import parse_spec
from treespec_sglang.utils.cuda_graphs import capture
from treespec_sglang.utils.syncs import count_ops

K, S, N = 4, 4, 16
SPECS = [{"policy": "talon", "budget": 10}, None, {"policy": "salf", "budget": 12, "th": 0.3},
         {"policy": "c2t", "budget": 9, "beta": 0.3}, {"policy": "none"}, {"policy": "chain", "length": 3},
         {"policy": "eagle2", "budget": 5}, None]


def pools(bs, seed):
    return oracles.sglang_pool_lists(PathDraft(30, seed=seed, sharpness=1.5), list(range(bs)), K, S)[:3]


def test_the_stash_holds_what_the_draft_loop_built_and_a_padded_batch_reads_its_own_rows():
    sl, tl, pl = pools(8, 1)
    stash_pool(sl, tl, pl)
    pool = read_pool(8, 5, K, S, "cpu")
    assert torch.equal(pool.scores, torch.cat(sl, 1).flatten(1)[:5]) and torch.equal(pool.tokens, torch.cat(tl, 1)[:5])
    assert torch.equal(pool.parent_list, torch.cat(pl[:-1], 1)[:5])
    sl2 = [s.flip(0) for s in sl]
    stash_pool(sl2, tl, pl)
    assert not torch.equal(read_pool(8, 5, K, S, "cpu").scores, pool.scores)  # a clone: the next round writes anew
    with pytest.raises(RuntimeError, match="no draft pool of shape"):
        read_pool(7, 5, K, S, "cpu")


@pytest.mark.parametrize("mode", [None, "auto", "triton", "graph"])
def test_selection_after_the_draft_equals_the_selection_on_the_pool_lists(monkeypatch, mode):
    """Whichever selection ``TREESPEC_SELECT`` picks (unset: auto; auto: torch on the CPU; triton: the fused
    kernel, here in Triton's interpreter; graph: the kernel launched, as after any eager draft), the trees are
    the torch selection's on the pool lists."""
    if mode is None:
        monkeypatch.delenv(draft_select.ENV_SELECT, raising=False)
    else:
        monkeypatch.setenv(draft_select.ENV_SELECT, mode)
    calls = []
    for name in ("select_on_pool", "select_on_pool_fused"):
        fn = getattr(draft_select, name)
        monkeypatch.setattr(draft_select, name, lambda *a, _f=fn, _n=name, **k: calls.append(_n) or _f(*a, **k))
    sl, tl, pl = pools(8, 2)
    params = [parse_spec(s) if s else None for s in SPECS]
    native = select_from_pool(sl, tl, pl, N, K, [None] * 8)[:3]
    stash_pool(sl, tl, pl)
    step = DraftStep(params, K)
    top, toks, _ = select_after_draft(step, None, native[1], native[2], N, S)
    ref = select_from_pool(sl, tl, pl, N, K, params, native=native)
    assert torch.equal(top, ref[1]) and torch.equal(toks, ref[2]) and torch.equal(step.keep, ref[3])
    assert calls == ["select_on_pool_fused" if mode in ("triton", "graph") else "select_on_pool"]


def test_graph_mode_after_a_replayed_draft_runs_one_selection_graph_per_draft_shape(monkeypatch):
    """``TREESPEC_SELECT=graph`` after a replayed draft of 8 rows: two rounds of 5 and 3 requests (other
    pools, other policies) go through the one selection graph of that stash (uncaptured on the CPU) and
    equal the torch selection of their own rows."""
    from treespec_sglang.plugin import select_graph

    monkeypatch.setenv(draft_select.ENV_SELECT, "graph")
    monkeypatch.setattr(select_graph, "GRAPHS", {})
    made = []
    real = select_graph.SelectionGraph
    monkeypatch.setattr(select_graph, "SelectionGraph", lambda *a, **k: made.append(a[3]) or real(*a, **k))
    for seed, bs in ((5, 5), (6, 3)):
        sl, tl, pl = pools(8, seed)
        # what the replay's captured copies write: the pool and SGLang's own selection beside it
        stash_pool(sl, tl, pl, select_from_pool(sl, tl, pl, N, K, [None] * 8)[1])
        params = [parse_spec(s) if s else None for s in SPECS[seed - 5:seed - 5 + bs]]
        mine = [[t[:bs] for t in part] for part in (sl, tl, pl)]
        native = select_from_pool(*mine, N, K, [None] * bs)[:3]
        step = DraftStep(params, K)
        stale = torch.zeros_like(native[1])  # the graph reads SGLang's selection from the stash, not this
        top, toks, _ = select_after_draft(step, 8, stale, native[2], N, S)
        ref = select_from_pool(*mine, N, K, params, native=native)
        assert torch.equal(top, ref[1]) and torch.equal(toks, ref[2]) and torch.equal(step.keep, ref[3]), seed
        with count_ops() as c:  # the tree sizes the graph computed beside its keep: no op of their own
            sizes = step.sizes
        assert c.ops == 0 and torch.equal(sizes, ref[3].sum(-1)), (c.names, seed)
    assert len(made) == 1 and len(select_graph.GRAPHS) == 1  # captured once (the c2t row's classifier in it)


def test_graph_mode_under_the_token_cap_counts_the_capped_tree(monkeypatch):
    """The selection graph's sizes count its own keep; the token cap then cuts the sharing rows' trees, and the
    round's sizes are the capped trees' (what the verify runs), not the graph's."""
    from treespec_sglang.plugin import select_graph

    monkeypatch.setenv(draft_select.ENV_SELECT, "graph")
    monkeypatch.setattr(select_graph, "GRAPHS", {})
    sl, tl, pl = pools(8, 5)
    stash_pool(sl, tl, pl, select_from_pool(sl, tl, pl, N, K, [None] * 8)[1])
    params = [parse_spec({"policy": "talon", "budget": 10})] * 4
    mine = [[t[:4] for t in part] for part in (sl, tl, pl)]
    native = select_from_pool(*mine, N, K, [None] * 4)[:3]
    step = DraftStep(params, K, [True] * 4, 2)  # every row shares a cap of 2 verified tokens a request
    select_after_draft(step, 8, native[1], native[2], N, S)
    uncapped = select_from_pool(*mine, N, K, params, native=native)[3].sum(-1)
    assert torch.equal(step.sizes, step.keep.sum(-1)) and step.sizes.sum() <= 2 * 4 < uncapped.sum()


def test_tree_sizes_follow_the_keep_a_round_holds_last():
    """Sizes given with a keep count that keep; a keep set again after the selection (chain mode's cut, rank 0's
    tree) is counted anew, and a keep set with no sizes too."""
    step = DraftStep([None, None], K)
    assert step.sizes is None
    keep = torch.tensor([[True, True, False], [True, False, False]])
    step.selected(keep, torch.tensor([2, 1]))
    assert step.sizes.tolist() == [2, 1]
    step.keep = torch.ones(2, 3, dtype=torch.bool)
    assert step.sizes.tolist() == [3, 3]
    step.selected(keep)
    assert step.sizes.tolist() == [2, 1]


def test_eager_stashes_do_not_pile_up_per_batch_size_and_captured_ones_stay(monkeypatch):
    """SGLang drafts eagerly above its largest captured batch: each batch size stashed its own pool, kept for the
    process's life (GBs over a day of varying batch sizes, outside SGLang's memory budget). An eager stash is
    read in its round: one is kept at a time; a stash a captured graph writes is never freed; a selection graph
    over a freed stash is captured again over the new one."""
    from treespec_sglang.plugin import select_graph

    monkeypatch.setattr(draft_select, "_STASH", {})
    monkeypatch.setattr(draft_select, "_NATIVE", {})
    monkeypatch.setattr(draft_select, "_CAPTURED", set())
    monkeypatch.setattr(select_graph, "GRAPHS", {})
    monkeypatch.setattr(draft_select, "capturing", lambda t=None: True)  # SGLang captures the 8-row draft graph
    sl, tl, pl = pools(8, 1)
    stash_pool(sl, tl, pl)
    monkeypatch.setattr(draft_select, "capturing", lambda t=None: False)
    shape = lambda rows: (rows, K + (S - 1) * K * K, 1 + (S - 1) * K, "cpu")  # noqa: E731
    for bs in (5, 6, 7, 6):
        sl, tl, pl = pools(bs, bs)
        stash_pool(sl, tl, pl, torch.zeros(bs, N - 1, dtype=torch.long))
        assert set(draft_select._STASH) == {shape(8), shape(bs)} and set(draft_select._NATIVE) == {shape(bs)}
        assert torch.equal(read_pool(bs, bs, K, S, "cpu").scores, torch.cat(sl, 1).flatten(1))  # this round's
    sl, tl, pl = pools(8, 2)  # an eager draft of a captured shape writes the captured buffers: nothing freed
    stash_pool(sl, tl, pl)
    assert set(draft_select._STASH) == {shape(8), shape(6)}
    # a selection graph over an uncaptured stash (the CPU's "replays") follows the stash when it is freed
    key, stash = draft_select._stash_of(6, K, S, "cpu")
    g = select_graph.graph_for(stash, key, K, N, [])
    assert select_graph.graph_for(stash, key, K, N, []) is g
    stash_pool(*pools(5, 3))
    stash_pool(*pools(6, 4))
    key, fresh = draft_select._stash_of(6, K, S, "cpu")
    assert fresh is not stash and select_graph.graph_for(fresh, key, K, N, []).stash is fresh


@pytest.mark.parametrize("env,device,want,replayed", [
    (None, "cuda", "select_on_pool_fused", True), ("", "cuda", "select_on_pool_fused", True),
    (None, "cpu", "select_on_pool", False), ("", "cpu", "select_on_pool", False),
    ("auto", "cpu", "select_on_pool", False), (" AUTO", "cuda", "select_on_pool_fused", True),
    (" Torch ", "cuda", "select_on_pool", False), ("triton", "cpu", "select_on_pool_fused", False),
    ("triton", "cuda", "select_on_pool_fused", False), ("graph", "cpu", "select_on_pool_fused", True)])
def test_the_selection_follows_treespec_select(monkeypatch, env, device, want, replayed):
    """Unset is ``auto``: the kernel on CUDA, replayed after a replayed draft (as ``graph``); torch elsewhere."""
    if env is None:
        monkeypatch.delenv(draft_select.ENV_SELECT, raising=False)
    else:
        monkeypatch.setenv(draft_select.ENV_SELECT, env)
    assert draft_select.selection(torch.device(device)).__name__ == want
    assert draft_select.replays_selection(torch.device(device)) is replayed


def test_a_bad_or_unloadable_selection_is_refused_at_start(monkeypatch):
    shape = (K, S, N)
    monkeypatch.setenv(draft_select.ENV_SELECT, "fused")
    with pytest.raises(ValueError, match=r"TREESPEC_SELECT must be one of \['torch', 'auto', 'triton', 'graph'\], "
                                         r"got 'fused'"):
        draft_select.check_selection("cpu", *shape)
    monkeypatch.setenv(draft_select.ENV_SELECT, "triton")
    launches = []
    fused = pool_kernels.select_on_pool_fused
    monkeypatch.setattr(pool_kernels, "select_on_pool_fused", lambda *a, **k: launches.append(a[1]) or fused(*a, **k))
    assert draft_select.check_selection("cpu", *shape) == "triton" and launches == [N]  # loaded and launched
    monkeypatch.setattr(pool_kernels, "_KERNELS", {})
    monkeypatch.setitem(__import__("sys").modules, "triton", None)  # triton not importable
    with pytest.raises(RuntimeError, match="needs the 'triton' package"):
        draft_select.check_selection("cpu", *shape)
    with pytest.raises(RuntimeError, match="needs the 'triton' package"):  # a chain server unlinks with the kernel
        draft_select.check_selection("cpu", 1, S, S + 1)
    monkeypatch.setenv(draft_select.ENV_SELECT, "auto")
    assert draft_select.check_selection("cpu", *shape) == "auto"  # torch on the CPU: triton is not needed
    with pytest.raises(RuntimeError, match="needs the 'triton' package"):
        draft_select.check_selection("cuda", *shape)  # the kernel on CUDA


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["torch", "graph"])
def test_a_replayed_draft_graph_feeds_the_selection_the_new_pool(monkeypatch, mode):
    """A stand-in draft loop (pool from input buffers, SGLang's selection, both stashed as the hooked
    organize_draft_results does) captured for 8 rows, replayed for 5 requests on new inputs: the
    selection after the replay (torch, or the captured selection graph, which reads SGLang's selection from the
    stash) equals the selection on those 5 requests' pool computed eagerly."""
    monkeypatch.setenv(draft_select.ENV_SELECT, mode)
    lists = [pools(8, seed) for seed in (3, 4)]
    inputs = [[t.cuda() for t in part] for part in lists[0]]

    def draft_loop():
        sl, tl, pl = ([t * 1 for t in part] for part in inputs)  # computed from the graph's input buffers
        out = select_from_pool(sl, tl, pl, N, K, [None] * 8)[:3]  # SGLang's own selection
        stash_pool(sl, tl, pl, out[1])
        return out

    graph, outs = capture(draft_loop)
    for dst, src in zip(inputs, lists[1]):  # the next round's draft inputs
        for d, s in zip(dst, src):
            d.copy_(s)
    graph.replay()
    params = [parse_spec(s) if s else None for s in SPECS[:5]]
    step = DraftStep(params, K)
    top, toks, _ = select_after_draft(step, 8, outs[1][:5], outs[2][:5], N, S)
    fresh = [[t[:5].cuda() for t in part] for part in lists[1]]
    native = select_from_pool(*fresh, N, K, [None] * 5)[:3]
    ref = select_from_pool(*fresh, N, K, params, native=native)
    assert torch.equal(top, ref[1]) and torch.equal(toks, ref[2]) and torch.equal(step.keep, ref[3])


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # the interpreter on -inf logs
def test_graph_mode_gives_a_faulty_test_rank_its_own_scores(monkeypatch):
    """The test-only faulty rank (``ranks.perturbed``) reaches the selection graph: its scores are written into the
    stash the graph reads, so its own tree is the selection on the reversed scores (which ``agree`` then replaces
    with rank 0's in a real group)."""
    from treespec_sglang.plugin import select_graph

    monkeypatch.setenv(draft_select.ENV_SELECT, "graph")
    monkeypatch.setattr(select_graph, "GRAPHS", {})
    monkeypatch.setattr(draft_select, "perturbed", lambda lists, group: [-s for s in lists])
    monkeypatch.setattr(draft_select, "perturbed_rank", lambda group: True)
    sl, tl, pl = pools(8, 9)
    stash_pool(sl, tl, pl)
    params = [parse_spec(s) if s else None for s in SPECS[:6]]
    mine = [[t[:6] for t in part] for part in (sl, tl, pl)]
    native = select_from_pool(*mine, N, K, [None] * 6)[:3]
    step = DraftStep(params, K)
    top, toks, _ = select_after_draft(step, 8, native[1], native[2], N, S)
    ref = select_from_pool([-s for s in mine[0]], mine[1], mine[2], N, K, params, native=native)
    assert torch.equal(top, ref[1]) and torch.equal(toks, ref[2]) and torch.equal(step.keep, ref[3])
    assert not torch.equal(step.keep, select_from_pool(*mine, N, K, params, native=native)[3])


@pytest.mark.parametrize("mode,topk,want", [("graph", K, 2), ("torch", K, 0), ("graph", 1, 0)])
def test_the_server_start_captures_a_selection_graph_per_captured_draft_shape(monkeypatch, mode, topk, want):
    """After SGLang captured its draft graphs (here two shapes, 8 and 4 rows, "captured" on the CPU): one selection
    graph per shape, with every registered classifier and SGLang's stashed selection, so the rounds after (a C2T
    request naming the default classifier among them) capture nothing; an uncaptured stash gets none; the buffers a
    GPU's captured copies never wrote are zeroed first. Nothing where the selection is not replayed, or in chain
    mode."""
    from treespec_sglang.plugin import select_graph

    for name, value in (("_STASH", {}), ("_NATIVE", {}), ("_CAPTURED", set())):
        monkeypatch.setattr(draft_select, name, value)
    monkeypatch.setattr(select_graph, "GRAPHS", {})
    monkeypatch.setenv(draft_select.ENV_SELECT, mode)
    monkeypatch.setattr(draft_select, "capturing", lambda t=None: True)
    for rows in (8, 4):
        sl, tl, pl = pools(rows, rows)
        stash_pool(sl, tl, pl, select_from_pool(sl, tl, pl, N, K, [None] * rows)[1])
    monkeypatch.setattr(draft_select, "capturing", lambda t=None: False)
    stash_pool(*pools(6, 6))  # an eager draft's: no graph of its own at start
    for key in draft_select._CAPTURED:  # on a GPU the captured copies were recorded, never run: any bytes
        draft_select._NATIVE[key].fill_(10 ** 9)
        for t in draft_select._STASH[key]:
            t.fill_(-(10 ** 9))
    assert draft_select.capture_selections(topk, N) == want
    for key in draft_select._CAPTURED:  # zeroed before the graph's eager first launch read them as indices
        assert all(not t.any() for t in draft_select._STASH[key] + (draft_select._NATIVE[key],)) == bool(want)
    assert len(select_graph.GRAPHS) == want
    if not want:
        return
    for g in select_graph.GRAPHS.values():
        assert g.native is not None and len(g.clf_ids) >= 1  # the default classifier at least
    made = []
    real = select_graph.SelectionGraph
    monkeypatch.setattr(select_graph, "SelectionGraph", lambda *a, **k: made.append(a) or real(*a, **k))
    sl, tl, pl = pools(8, 9)
    stash_pool(sl, tl, pl, select_from_pool(sl, tl, pl, N, K, [None] * 8)[1])  # the 8-row graph's replay
    params = [parse_spec(s) if s else None for s in SPECS[:5]]  # talon, native, salf, c2t (default), none
    mine = [[t[:5] for t in part] for part in (sl, tl, pl)]
    native = select_from_pool(*mine, N, K, [None] * 5)[:3]
    step = DraftStep(params, K)
    top, toks, _ = select_after_draft(step, 8, native[1], native[2], N, S)
    ref = select_from_pool(*mine, N, K, params, native=native)
    assert torch.equal(top, ref[1]) and torch.equal(toks, ref[2]) and torch.equal(step.keep, ref[3])
    assert made == []  # served by the graph captured at start


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # Triton's interpreter on -inf
@pytest.mark.parametrize("mode", ["torch", "graph"])
def test_a_rank_takes_rank_0s_tree_its_parent_table_included(monkeypatch, mode):
    """Ranks that verify together take rank 0's whole tree in one broadcast: the verify order, the tokens, the kept
    nodes and the parent table SGLang builds the tree's shape from (a rank whose draft beam went another way has
    another table: here rank 1's is another pool's, and the test fault reverses it and rank 1's scores)."""
    monkeypatch.setenv(draft_select.ENV_SELECT, mode)
    sl, tl, pl = pools(8, 4)
    params = [parse_spec(s) if s else None for s in SPECS]
    native = select_from_pool(sl, tl, pl, N, K, [None] * 8)
    table0 = native[0].clone()  # [bs, W] rank 0's parent_list, as build_eagle_verify_input is handed it
    table1 = select_from_pool(*pools(8, 5), N, K, [None] * 8)[0].clone()  # [bs, W] rank 1's: another beam
    assert table1.shape == table0.shape and not torch.equal(table1, table0)
    stash_pool(sl, tl, pl)
    step0 = DraftStep(params, K)
    top0, toks0, alone = select_after_draft(step0, None, native[1], native[2], N, S, table0)
    assert alone is table0  # alone: nothing to agree on
    flat0 = flat(top0, toks0, step0.keep, table0)
    group = Rank1Of2(flat0)  # rank 1's end of rank 0's broadcast
    monkeypatch.setattr(draft_select, "verify_group", lambda: group)
    monkeypatch.setenv("TREESPEC_TEST_PERTURB_RANK", "1")
    step = DraftStep(params, K)
    top, toks, got = select_after_draft(step, None, native[1], native[2], N, S, table1)
    assert len(group.sent) == 1 and not torch.equal(group.sent[0], flat0)  # rank 1's own tree was another one
    assert torch.equal(top, top0) and torch.equal(toks, toks0) and torch.equal(step.keep, step0.keep)
    assert torch.equal(got, table0) and got is not table1 and got.dtype == torch.int64 and got.is_contiguous()
