"""The selection after the draft at its edges: a padded replay selected eagerly, SGLang's own selection kept
verbatim (and not read when stashed for another tree size or not stashed this round), the token cap on part of a
batch, a custom pool rule after a replay, a faulty test rank's own tree and digests, the stash's dtypes, one- and
two-step drafts, and what the server start captures and compiles; which unlink runs."""

import random

import pytest
import torch

from tests.helpers import Rank1Of2, flat
from tests.plugin.kernel_cases import OTHER
from tests.plugin.pools import pool, random_chains, unlink_oracle
from treespec_sglang.plugin import draft_select, ranks, select_graph
from treespec_sglang.plugin.draft_select import read_pool, select_after_draft, stash_pool
from treespec_sglang.plugin.hooks import DraftStep
from treespec_sglang.plugin.pool import select_from_pool, share_token_cap
from treespec_sglang.plugin.rows import _clf_id
from treespec_sglang.policies import parse_spec

pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # the interpreter on -inf

K, S, N = 4, 4, 16
TALON, SALF = {"policy": "talon", "budget": 10}, {"policy": "salf", "budget": 12, "th": 0.3}


@pytest.fixture(autouse=True)
def fresh(monkeypatch):
    """No stash, graph or scratch of another test."""
    for name, value in (("_STASH", {}), ("_NATIVE", {}), ("_CAPTURED", set())):
        monkeypatch.setattr(draft_select, name, value)
    monkeypatch.setattr(select_graph, "GRAPHS", {})
    monkeypatch.setattr(select_graph, "_WORKSPACE", {})


def lists(rows, seed, topk=K, steps=S):
    """``(score_list, token_list, parents_list)`` of a ``rows``-row draft loop, as organize_draft_results gets them."""
    return pool(topk, steps, seed, roots=range(3, 3 + rows))[1:4]


def first(parts, bs):
    """The first ``bs`` rows of every list of a draft's pool (a batch padded to a captured size: its own rows)."""
    return [[t[:bs] for t in part] for part in parts]


def specs(*raw):
    return [parse_spec(s) if s else None for s in raw]


@pytest.mark.parametrize("mode", ["torch", "auto"])  # auto on the CPU: torch, even after a replayed draft
def test_a_padded_replay_selected_eagerly_reads_its_rows_and_keeps_sglangs_selection_verbatim(monkeypatch, mode):
    monkeypatch.setenv(draft_select.ENV_SELECT, mode)
    parts = lists(8, 1)
    stash_pool(*parts)
    mine, params = first(parts, 5), specs(TALON, None, SALF, {"policy": "none"}, None)
    native = select_from_pool(*mine, N, K, [None] * 5)[:3]
    theirs = native[1].flip(-1).contiguous()  # SGLang's selection in its own order: native rows take it as it is
    step = DraftStep(params, K)
    top, toks, _ = select_after_draft(step, 8, theirs, native[2], N, S)
    ref = select_from_pool(*mine, N, K, params, native=(native[0], theirs, native[2]))
    assert torch.equal(top, ref[1]) and torch.equal(toks, ref[2]) and torch.equal(step.keep, ref[3])
    assert torch.equal(top[[1, 4]], theirs[[1, 4]]) and not torch.equal(theirs[1], native[1][1])
    with pytest.raises(RuntimeError) as e:
        read_pool(7, 5, K, S, "cpu")
    assert str(e.value) == ("treespec: no draft pool of shape (7, 52, 13) was recorded; the draft CUDA graph must be "
                            "captured with the plugin loaded (rows, P = k + (S-1)k^2, W = 1 + (S-1)k)")


@pytest.mark.parametrize("mode", ["torch", "graph"])
def test_the_token_cap_cuts_the_sharing_rows_by_their_scores_and_leaves_the_others(monkeypatch, mode):
    """Rows 0 and 2 share a cap of 2 verified tokens a request, rows 1 and 3 do not: theirs are the uncapped trees;
    the sharing rows' are cut by the pool's scores (after a replay, read where the stash holds them)."""
    monkeypatch.setenv(draft_select.ENV_SELECT, mode)
    parts = lists(8, 5)
    stash_pool(*parts, select_from_pool(*parts, N, K, [None] * 8)[1])
    mine, params = first(parts, 4), specs(TALON, TALON, SALF, SALF)
    native = select_from_pool(*mine, N, K, [None] * 4)[:3]
    shares = torch.tensor([True, False, True, False])
    step = DraftStep(params, K, shares.tolist(), 2)
    top, _, _ = select_after_draft(step, 8, native[1], native[2], N, S)
    full = select_from_pool(*mine, N, K, params, native=native)
    want = share_token_cap(torch.cat(mine[0], 1).flatten(1), full[1], full[3], shares, 2)
    assert torch.equal(top, full[1]) and torch.equal(step.keep, want) and torch.equal(step.sizes, want.sum(-1))
    assert torch.equal(step.keep[[1, 3]], full[3][[1, 3]]) and step.sizes[[0, 2]].sum() <= 4 < full[3][[0, 2]].sum()


def test_a_custom_pool_rule_after_a_replayed_draft_keeps_its_own_nodes(monkeypatch, custom):
    """A custom rule's keep is computed on the host from the stash and read by the selection graph."""
    monkeypatch.setenv(draft_select.ENV_SELECT, "graph")
    parts = lists(8, 3)
    stash_pool(*parts, select_from_pool(*parts, N, K, [None] * 8)[1])
    params = specs({"policy": "root-children", "budget": 3}, TALON, None, {"policy": "root-children", "budget": 4})
    mine = first(parts, 4)
    native = select_from_pool(*mine, N, K, [None] * 4)[:3]
    step = DraftStep(params, K)
    top, toks, _ = select_after_draft(step, 8, native[1], native[2], N, S)
    ref = select_from_pool(*mine, N, K, params, native=native)
    assert torch.equal(top, ref[1]) and torch.equal(toks, ref[2]) and torch.equal(step.keep, ref[3])
    assert step.sizes[[0, 3]].tolist() == [3, 4]


@pytest.mark.parametrize("mode,rows", [("torch", None), ("graph", 8)])
@pytest.mark.parametrize("with_table", [False, True])
def test_a_faulty_rank_sends_its_own_tree_takes_rank_0s_and_logs_both_digests(monkeypatch, tmp_path, mode, rows,
                                                                               with_table):
    """The test fault reverses the faulty rank's scores (eager draft or replay) and its parent table: what it sends
    is the selection on those; what it keeps is rank 0's; its digest file holds both trees' digests."""
    monkeypatch.setenv(draft_select.ENV_SELECT, mode)
    monkeypatch.setenv(ranks.ENV_DIGESTS, str(tmp_path))
    parts = lists(8, 4)
    stash_pool(*parts)
    bs = 8 if rows is None else 6
    mine, params = first(parts, bs), specs(TALON, None, SALF, {"policy": "eagle2", "budget": 5}, TALON, SALF, None,
                                           TALON)[:bs]
    native = select_from_pool(*mine, N, K, [None] * bs)
    table = native[0].clone()  # [bs, W] the parent table build_eagle_verify_input is handed on this rank
    table0 = select_from_pool(*first(lists(8, 9), bs), N, K, [None] * bs)[0]  # rank 0's: its beam went elsewhere
    zero = select_from_pool(*mine, N, K, params, native=native[:3])  # rank 0's tree
    faulty = select_from_pool([-s for s in mine[0]], mine[1], mine[2], N, K, params, native=native[:3])
    own = (faulty[1], faulty[2], faulty[3]) + ((table.flip(-1),) if with_table else ())
    agreed = (zero[1], zero[2], zero[3]) + ((table0,) if with_table else ())
    assert not torch.equal(faulty[3], zero[3])
    group = Rank1Of2(flat(*agreed))
    monkeypatch.setattr(draft_select, "verify_group", lambda: group)
    monkeypatch.setenv(ranks.ENV_PERTURB, "1")
    step = DraftStep(params, K)
    top, toks, got = select_after_draft(step, rows, native[1], native[2], N, S, table if with_table else None)
    assert len(group.sent) == 1 and torch.equal(group.sent[0], flat(*own))
    assert torch.equal(top, zero[1]) and torch.equal(toks, zero[2]) and torch.equal(step.keep, zero[3])
    assert (got is None) != with_table and (got is None or torch.equal(got, table0))
    (line,) = (tmp_path / "rank1.txt").read_text().splitlines()
    assert line.split() == [ranks._tree_hash(own), ranks._tree_hash(agreed)] and not (tmp_path / "rank0.txt").exists()


def test_a_pool_stashed_without_sglangs_selection_drops_the_one_stashed_before(monkeypatch):
    """A draft graph captured without the stash of SGLang's selection: the selection graph takes the one handed to
    it, never another round's left beside the pool."""
    monkeypatch.setenv(draft_select.ENV_SELECT, "graph")
    parts = lists(8, 6)
    key = stash_pool(*parts, select_from_pool(*parts, N, K, [None] * 8)[1])
    assert key in draft_select._NATIVE
    parts = lists(8, 7)
    assert stash_pool(*parts) == key and key not in draft_select._NATIVE
    mine, params = first(parts, 3), specs(None, TALON, None)
    native = select_from_pool(*mine, N, K, [None] * 3)[:3]
    theirs = native[1].flip(-1).contiguous()
    step = DraftStep(params, K)
    top, _, _ = select_after_draft(step, 8, theirs, native[2], N, S)
    assert torch.equal(top[[0, 2]], theirs[[0, 2]])


def test_the_stash_holds_float32_scores_and_int64_tables_whatever_the_default_dtype():
    sl, tl, pl = lists(6, 2)
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        key = stash_pool([s.double() for s in sl], tl, pl, torch.zeros(6, N - 1, dtype=torch.int32))
    finally:
        torch.set_default_dtype(before)
    scores, tokens, parents = draft_select._STASH[key]
    assert (scores.dtype, tokens.dtype, parents.dtype, draft_select._NATIVE[key].dtype) == (
        torch.float32, torch.int64, torch.int64, torch.int64)
    assert torch.equal(scores, torch.cat(sl, 1).flatten(1)) and torch.equal(parents, torch.cat(pl[:-1], 1))


@pytest.mark.parametrize("steps", [1, 2])
def test_a_short_draft_is_stashed_with_its_parent_table_and_selected_as_its_lists(steps):
    """One draft step (S = 1): the pool is the root's k children and the stashed parent table the root alone
    (``[rows, 1]`` of -1, W = 1 + (S-1)k); two steps: SGLang's first table piece (``[rows, k + 1]``). Read back under
    that shape."""
    parts = lists(3, 4, steps=steps)
    assert len(parts[2]) == steps
    stash_pool(*parts)
    got = read_pool(3, 3, K, steps, "cpu")
    want = torch.full((3, 1), -1) if steps == 1 else parts[2][0]
    assert got.parent_list.dtype == torch.int64 and torch.equal(got.parent_list, want)
    assert torch.equal(got.scores, torch.cat(parts[0], 1).flatten(1))
    params = specs(TALON, None, {"policy": "eagle2", "budget": 3})
    n = 4 if steps == 1 else 8
    native = select_from_pool(*parts, n, K, [None] * 3)[:3]
    step = DraftStep(params, K)
    top, toks, _ = select_after_draft(step, None, native[1], native[2], n, steps)
    ref = select_from_pool(*parts, n, K, params, native=native)
    assert torch.equal(top, ref[1]) and torch.equal(toks, ref[2]) and torch.equal(step.keep, ref[3])


def test_sglangs_selection_stashed_for_another_tree_size_is_not_read(monkeypatch):
    """The selection stashed beside the pool has N' - 1 columns for another N': a round at N takes the one handed
    to it (native rows keep it verbatim)."""
    monkeypatch.setenv(draft_select.ENV_SELECT, "graph")
    parts = lists(8, 8)
    stash_pool(*parts, select_from_pool(*parts, 8, K, [None] * 8)[1])  # SGLang's at N' = 8: [rows, 7]
    mine, params = first(parts, 3), specs(None, TALON, None)
    native = select_from_pool(*mine, N, K, [None] * 3)[:3]
    theirs = native[1].flip(-1).contiguous()
    step = DraftStep(params, K)
    top, toks, _ = select_after_draft(step, 8, theirs, native[2], N, S)
    ref = select_from_pool(*mine, N, K, params, native=(native[0], theirs, native[2]))
    assert torch.equal(top, ref[1]) and torch.equal(toks, ref[2]) and torch.equal(top[[0, 2]], theirs[[0, 2]])


def test_an_eager_draft_on_the_cpu_is_never_taken_for_a_capture():
    """Only a CUDA stream is captured: a CPU tensor's stash is an eager one, freed when another shape is stashed."""
    assert draft_select.capturing(torch.zeros(1)) is False and draft_select.capturing() is False
    stash_pool(*lists(5, 1))
    key = stash_pool(*lists(6, 2))
    assert not draft_select._CAPTURED and list(draft_select._STASH) == [key]


@pytest.mark.parametrize("mode,shapes", [("graph", (4, 8)), ("graph", (8,)), ("auto", (4, 8))])
def test_the_server_start_captures_topk_2_shapes_largest_first_with_every_registered_classifier(monkeypatch, mode,
                                                                                                 shapes):
    """k = 2 is a tree server; one shape's draft graph stashed SGLang's selection, the other's did not; a classifier
    registered beside the shipped one is in every graph; the largest shape first, so the graphs share one scratch.
    ``auto`` on the CPU replays nothing."""
    monkeypatch.setenv(draft_select.ENV_SELECT, mode)
    monkeypatch.setattr(draft_select, "registered", lambda: {"default": None, "other": OTHER})
    monkeypatch.setattr(draft_select, "capturing", lambda t=None: True)
    n = 8
    for rows in shapes:
        parts = lists(rows, rows, topk=2)
        stash_pool(*parts, select_from_pool(*parts, n, 2, [None] * rows)[1] if rows == 8 else None)
    want = len(shapes) if mode == "graph" else 0
    assert draft_select.capture_selections(2, n) == want and len(select_graph.GRAPHS) == want
    if want < 2:
        return
    g4, g8 = (select_graph.GRAPHS[(k, n, 2)] for k in sorted(draft_select._CAPTURED))
    assert g4.clf_ids == g8.clf_ids == tuple(sorted({_clf_id(None), _clf_id(OTHER)}))
    assert g4.native is None and g8.native is draft_select._NATIVE[max(draft_select._CAPTURED)]
    (scratch,) = select_graph._WORKSPACE.values()
    assert scratch[0].shape[0] == 8 and g4.out[3].data_ptr() == g8.out[3].data_ptr() == scratch[0].data_ptr()


@pytest.mark.parametrize("topk,warmed", [(1, False), (2, True)])
def test_the_start_check_compiles_the_selection_for_a_tree_server_and_the_unlink_for_any(monkeypatch, topk, warmed):
    monkeypatch.setenv(draft_select.ENV_SELECT, "triton")
    warm, unlinks = [], []
    monkeypatch.setattr(draft_select, "warm_up", lambda *a: warm.append(a))
    monkeypatch.setattr(draft_select, "check_unlink", lambda *a: unlinks.append(a))
    assert draft_select.check_selection("cpu", topk, S, N) == "triton"
    assert warm == ([("cpu", topk, S, N)] if warmed else []) and unlinks == [("cpu", N)]


@pytest.mark.parametrize("mode,fused", [("torch", False), ("auto", False), ("triton", True), ("graph", True)])
def test_the_unlink_runs_where_the_selection_runs_and_unlinks_as_the_plain_loop(monkeypatch, mode, fused):
    monkeypatch.setenv(draft_select.ENV_SELECT, mode)
    calls = []
    for name in ("unlink_filler", "unlink_filler_fused"):
        fn = getattr(draft_select, name)
        monkeypatch.setattr(draft_select, name, lambda *a, _f=fn, _n=name: calls.append(_n) or _f(*a))
    nt, ns, keep = random_chains(random.Random(5), 4, 9)
    want = unlink_oracle(nt, ns, keep)
    draft_select.unlink(nt, ns, keep)
    assert (nt.tolist(), ns.tolist()) == want
    assert calls == ["unlink_filler_fused" if fused else "unlink_filler"]
