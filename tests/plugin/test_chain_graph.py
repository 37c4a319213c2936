"""``chain_graph``: the C2T chain cut over static buffers (captured on CUDA, run uncaptured here) against the plain
oracle of the cut, and the round's choice between the fixed keep, the graph and the eager cut."""

import random
from types import SimpleNamespace

import pytest
import torch

from tests.plugin.chains import PARAMS, S, V, plain_lengths, step_logits
from tests.plugin.pools import OTHER_CLF
from treespec_sglang.plugin import chain_graph, chain_stop
from treespec_sglang.plugin.chain_graph import CutGraph, capture_cuts, chain_keep, cut_graph_for
from treespec_sglang.plugin.chain_stop import ChainStopper, keep_mask, record_step
from treespec_sglang.plugin.rows import _clf_id, classifier_ids, request_row
from treespec_sglang.policies import parse_spec
from treespec_sglang.utils.syncs import count_ops

N = S + 1


@pytest.fixture(autouse=True)
def fresh(monkeypatch):
    """No stash or graph from another test; the replayed selection (and so the cut graph) on the CPU."""
    monkeypatch.setattr(chain_stop, "_STASH", {})
    monkeypatch.setattr(chain_graph, "_STASH", chain_stop._STASH)
    monkeypatch.setattr(chain_graph, "CUT_GRAPHS", {})
    monkeypatch.setenv("TREESPEC_SELECT", "graph")


def record(logits, rows):
    """What a replay of a ``rows``-row draft graph records: the batch's step logits, padding rows after them."""
    for i, lg in enumerate(logits):
        pad = torch.randn(rows - lg.shape[0], V, generator=torch.Generator().manual_seed(i)) * 9
        record_step(torch.cat([lg, pad]), i, S)


def random_batch(rng, bs):
    """Random chain-mode rows: native, ``none``, shorter chains, C2T rows with their own beta and classifier."""
    specs = [None, {"policy": "none"}, {"policy": "chain", "length": rng.randint(1, S)}]
    for clf in (None, OTHER_CLF):
        specs.append({"policy": "chain", "length": rng.randint(1, S + 2), "beta": round(rng.uniform(0.2, 0.8), 2),
                      **({"classifier": clf} if clf is not None else {})})
    params = [parse_spec(s) if s else None for s in (rng.choice(specs) for _ in range(bs))]
    params[rng.randrange(bs)] = parse_spec({"policy": "chain", "beta": 0.5, "classifier": OTHER_CLF})
    return params


def test_the_graph_cuts_as_the_plain_oracle_over_batches_that_come_and_go():
    """One graph of a 9-row stash serves batches of 7, 3 and 9 rows in turn (padding rows written by a bigger batch
    go native again), two classifiers mixed: lengths, keep and sizes equal the oracle's row by row."""
    rng = random.Random(0)
    g = None
    for bs in (7, 7, 3, 9, 3):  # a new batch of the same size too: its table is copied in all the same
        params = random_batch(rng, bs)
        logits = [torch.randn(bs, V, generator=torch.Generator().manual_seed(rng.randrange(99))) * rng.uniform(1, 6)
                  for _ in range(S - 1)]
        record(logits, 9)
        stop = ChainStopper(params, S, "cpu")
        if g is None:
            g = CutGraph(chain_stop._STASH[(9, S - 1, "cpu")], N, sorted({_clf_id(None), *stop.clf_ids}))
        length, keep, sizes = g.run(stop.rows)
        want = plain_lengths(params, logits)
        assert length.tolist() == want
        assert torch.equal(keep, keep_mask(torch.tensor(want), N)) and sizes.tolist() == [n + 1 for n in want]
        assert torch.equal(g.rows_in[bs:], request_row(None, "cpu").expand(9 - bs, -1))  # the padding: native
    assert 0 < min(want) and min(want) < S  # some row stopped early, none cut to the root alone


def test_a_steady_batch_copies_nothing_in_and_reads_nothing_back():
    params = [parse_spec(p) if p else None for p in PARAMS]
    record(step_logits(1), 4)
    stop = ChainStopper(params, S, "cpu")
    g = cut_graph_for(stop.steps(4), (4, S - 1, "cpu"), N, stop.clf_ids)
    g.run(stop.rows)
    with count_ops() as body:
        g._body()
    with count_ops() as c:
        length, _, _ = g.run(stop.rows)  # uncaptured on the CPU: the body's ops alone, nothing copied in or read
    assert c.ops == body.ops and (c.reads, c.copies) == (0, 0)
    assert length.tolist() == plain_lengths(params, step_logits(1))


def test_a_graph_is_captured_again_for_a_classifier_it_lacks():
    params = [parse_spec(p) if p else None for p in PARAMS]
    record(step_logits(2), 4)
    steps, key = chain_stop._STASH[(4, S - 1, "cpu")], (4, S - 1, "cpu")
    first = cut_graph_for(steps, key, N, [_clf_id(None)])
    assert cut_graph_for(steps, key, N, [_clf_id(None)]) is first
    other = classifier_ids([parse_spec({"policy": "chain", "beta": 0.4, "classifier": OTHER_CLF})])
    again = cut_graph_for(steps, key, N, other)
    assert again is not first and set(again.clf_ids) == {_clf_id(None), *other}
    assert again.run(ChainStopper(params, S, "cpu").rows)[0].tolist() == plain_lengths(params, step_logits(2))


def test_a_round_takes_the_fixed_keep_the_graph_or_the_eager_cut(monkeypatch):
    """No C2T row: the rows' own lengths, one keep for every round (no op after the first); a C2T row after a
    replay: the graph; after an eager draft (or where the selection is not replayed): the eager cut. Each keep is
    the oracle's."""
    fixed = ChainStopper([parse_spec({"policy": "chain", "length": 2}), parse_spec({"policy": "none"}), None],
                         S, "cpu")
    keep, sizes = chain_keep(fixed, 8, N)
    with count_ops() as c:
        again = chain_keep(fixed, 8, N)
    assert again[0] is keep and c.ops == 0 and sizes.tolist() == [3, 1, N] and not chain_graph.CUT_GRAPHS
    params = [parse_spec(p) if p else None for p in PARAMS]
    want = [n + 1 for n in plain_lengths(params, step_logits(3))]
    record(step_logits(3), 6)
    stop = ChainStopper(params, S, "cpu")
    keep, sizes = chain_keep(stop, 6, N)
    assert sizes.tolist() == want == keep.sum(-1).tolist() and list(chain_graph.CUT_GRAPHS) == [((6, S - 1, "cpu"), N)]
    record(step_logits(3), 4)  # an eager draft's stash: this batch's own rows
    keep, sizes = chain_keep(stop, None, N)
    assert sizes is None and keep.sum(-1).tolist() == want and len(chain_graph.CUT_GRAPHS) == 1
    monkeypatch.setenv("TREESPEC_SELECT", "torch")
    keep, sizes = chain_keep(stop, 6, N)
    assert sizes is None and keep.sum(-1).tolist() == want and len(chain_graph.CUT_GRAPHS) == 1


@pytest.mark.parametrize("width", [1, 2])
def test_with_a_verify_group_the_graphs_cut_is_rank_0s(width):
    """Ranks that verify together keep rank 0's cut (one broadcast); a group of one rank (a one-GPU server's
    verify group is one: never None there) keeps the graph's own keep and sizes, no op a round."""
    sent = []
    group = SimpleNamespace(world_size=width, rank_in_group=width - 1,
                            broadcast=lambda t, src=0: sent.append(t.clone()) or t)
    params = [parse_spec(p) if p else None for p in PARAMS]
    record(step_logits(4), 4)
    stop = ChainStopper(params, S, "cpu")
    keep, sizes = chain_keep(stop, 4, N, group)
    want = [n + 1 for n in plain_lengths(params, step_logits(4))]
    assert keep.sum(-1).tolist() == want
    if width > 1:
        assert len(sent) == 1 and sizes is None
        return
    assert not sent and sizes.tolist() == want
    graph = chain_graph.CUT_GRAPHS[((4, S - 1, "cpu"), N)]
    assert keep.data_ptr() == graph.keep.data_ptr()  # the graph's static output, not a keep rebuilt


@pytest.mark.parametrize("on", [True, False])
def test_server_start_builds_a_graph_per_recorded_shape_with_every_classifier(monkeypatch, on):
    """At start (after SGLang's draft graphs were captured recording the loop's steps) every stash shape of the
    server's S gets its graph, zeroed first, with every registered classifier; without the setting, none."""
    monkeypatch.setenv("TREESPEC_CHAIN_STOP_GRAPH", "1" if on else "0")
    for rows in (2, 8):
        record([torch.randn(rows, V) for _ in range(S - 1)], rows)
    record_step(torch.randn(3, V), 0, S + 2)  # another S: not this server's
    assert capture_cuts(S, N) == (2 if on else 0)
    assert sorted(k for k, _ in chain_graph.CUT_GRAPHS) == ([(2, S - 1, "cpu"), (8, S - 1, "cpu")] if on else [])
    for g in chain_graph.CUT_GRAPHS.values():
        assert g.clf_ids == (_clf_id(None),) and all(t.eq(0).all() for t in g.steps)


@pytest.mark.parametrize("mode", ["torch", "auto"])  # auto on the CPU: no replayed selection
def test_where_the_selection_is_not_replayed_a_padded_replay_is_cut_eagerly_on_its_rows(monkeypatch, mode):
    monkeypatch.setenv("TREESPEC_SELECT", mode)
    params = [parse_spec(p) if p else None for p in PARAMS]
    record(step_logits(6), 7)  # a 7-row replay's stash: the only one
    keep, sizes = chain_keep(ChainStopper(params, S, "cpu"), 7, N)
    assert sizes is None and keep.sum(-1).tolist() == [n + 1 for n in plain_lengths(params, step_logits(6))]
    assert not chain_graph.CUT_GRAPHS


def test_server_start_builds_the_cut_graph_of_a_two_step_server_with_a_registered_classifier(monkeypatch):
    """S = 2 (one loop step) records steps; nothing recorded: no graph; one shape: its graph, with every classifier
    the server registered; ``auto`` on the CPU: none."""
    monkeypatch.setenv("TREESPEC_CHAIN_STOP_GRAPH", "1")
    monkeypatch.setattr(chain_graph, "registered", lambda: {"default": None, "other": OTHER_CLF})
    assert capture_cuts(2, 3) == 0 and not chain_graph.CUT_GRAPHS
    record_step(torch.randn(5, V), 0, 2)
    assert capture_cuts(2, 3) == 1
    (key, g), = chain_graph.CUT_GRAPHS.items()
    assert key == ((5, 1, "cpu"), 3) and g.clf_ids == tuple(sorted({_clf_id(None), _clf_id(OTHER_CLF)}))
    chain_graph.CUT_GRAPHS.clear()
    monkeypatch.setenv("TREESPEC_SELECT", "auto")
    assert capture_cuts(2, 3) == 0 and not chain_graph.CUT_GRAPHS


@pytest.mark.filterwarnings("error")  # an output buffer of another shape is resized (a warning), not written
def test_the_cut_graph_writes_int64_lengths_a_bool_keep_and_int64_sizes_into_its_buffers():
    params = [parse_spec(p) if p else None for p in PARAMS]
    record(step_logits(8), 5)
    stop = ChainStopper(params, S, "cpu")
    g = CutGraph(chain_stop._STASH[(5, S - 1, "cpu")], N, stop.clf_ids, capture=False)
    length, keep, sizes = g.run(stop.rows)
    assert (length.dtype, keep.dtype, sizes.dtype) == (torch.int64, torch.bool, torch.int64)
    assert (tuple(g.length.shape), tuple(g.keep.shape), tuple(g.sizes.shape)) == ((5,), (5, N), (5,))
    assert length.tolist() == plain_lengths(params, step_logits(8))
    assert sizes.tolist() == [n + 1 for n in length.tolist()] == keep.sum(-1).tolist()


@pytest.mark.gpu
def test_the_captured_cut_equals_the_uncaptured_one_on_cuda():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    params = [parse_spec(p) if p else None for p in PARAMS]
    logits = [lg.cuda() for lg in step_logits(5)]
    for i, lg in enumerate(logits):
        record_step(torch.cat([lg, torch.randn(2, V, device="cuda") * 9]), i, S)
    stop = ChainStopper(params, S, "cuda")
    steps = chain_stop._STASH[(6, S - 1, "cuda:0")]
    graph, plain = CutGraph(steps, N, stop.clf_ids), CutGraph(steps, N, stop.clf_ids, capture=False)
    assert graph.graph is not None
    for a, b in zip(graph.run(stop.rows), plain.run(stop.rows)):
        assert torch.equal(a, b)
    assert graph.run(stop.rows)[0].tolist() == plain_lengths(params, [lg.cpu() for lg in logits])
    other = [parse_spec({"policy": "chain", "length": 2}), None, parse_spec({"policy": "chain", "beta": 0.9})]
    small = ChainStopper(other, S, "cuda")  # another table, a smaller batch: replayed on what run() copied in
    assert graph.run(small.rows)[0].tolist() == plain_lengths(other, [lg[:3].cpu() for lg in logits])
