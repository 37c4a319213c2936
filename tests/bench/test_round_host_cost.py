"""``bench/round_host_cost.py``: its stand-in round goes through the plugin's real hooks (a treespec batch gets its
selection's inputs staged, its filler unlinked and its stats recorded every round; a native one calls straight
through), with only the device work stubbed (so the trees themselves are not checked here)."""

import argparse
from unittest import mock

import pytest
import torch

pytest.importorskip("triton")
from bench import round_host_cost  # noqa: E402
from treespec_sglang.plugin import draft_select, select_graph  # noqa: E402
from treespec_sglang.plugin.rows import policy_rows  # noqa: E402


def args(**kw):
    return argparse.Namespace(**{**dict(select="graph", eager=False, topk=2, steps=3, N=6, repeats=3, device="cpu",
                                        breakdown=False, churn=0, stream=False), **kw})


@pytest.mark.parametrize("select,eager", [("graph", False), ("graph", True), ("triton", False), ("torch", False)])
def test_a_treespec_round_stages_unlinks_and_records_through_the_hooks(select, eager):
    a = args(select=select, eager=eager)
    unlinks, real = [], draft_select.unlink_filler_fused
    with mock.patch.object(draft_select, "unlink_filler_fused", lambda *x: unlinks.append(1) or real(*x)), \
            mock.patch.object(select_graph, "GRAPHS", {}) as graphs:
        us, ops, reads, _, one = round_host_cost.measure("mix", 7, a)
    rounds = 3 + 1 + a.repeats  # warm-up, counted, timed
    # a replayed selection of a steady batch dispatches no ATen op of its own (the graph's replay and the unlink's
    # launch are not ATen ops; its views and scratch are kept per batch size)
    assert us > 0 and (ops == 0 if (select, eager) == ("graph", False) else ops > 0)
    for i, req in enumerate(one.reqs):
        info = req.customized_info
        if i % len(round_host_cost.SETS["mix"]) == 0:  # the native requests of the mix
            assert info is None
            continue
        assert len(info["treespec_accept_lengths"]) == rounds == len(info["treespec_verify_tokens"])
        assert len(info["treespec_tree_sizes"]) == rounds  # on the CPU a round's sizes are ready at its accepts
    if select == "graph" and not eager:  # the replayed selection's static input holds this batch's row table
        graph, = graphs.values()
        params = [r._treespec_params for r in one.reqs]
        shares = [p is not None for p in params]
        # the mix's eagle2 at its default budget (60 >= N) keeps SGLang's own tree: a native row of the selection
        params = [None if p is not None and type(p).__name__ == "Eagle2Params" else p for p in params]
        assert torch.equal(graph.rows_in[:7], policy_rows(params, "cpu", shares))
    torch_unlink = select == "torch"
    assert len(unlinks) == (0 if torch_unlink else rounds)  # the fused unlink (its launch stubbed)


def test_a_churning_batch_replaces_requests_and_each_ones_stats_stay_aligned():
    """``--churn 2``: every round two requests leave (filtered out, finished) and two join at the end, parsed on
    arrival; each treespec request's three lists have one value per round it was in the batch, the mix's
    natives none."""
    a = args(churn=2)
    us, ops, reads, _, one = round_host_cost.measure("mix", 7, a)
    rounds = 3 + len(round_host_cost.SETS["mix"]) + 1 + a.repeats  # warm-up (every set joins once), counted, timed
    assert len(one.reqs) == 7 and len(one.left) == 2 * rounds and all(r.finished() for r in one.left)
    assert not set(map(id, one.left)) & set(map(id, one.reqs))
    served = 0
    for req in one.left + one.reqs:
        info = req.customized_info
        if req.sampling_params.custom_params is None or (info is None and req in one.left):  # native; left unserved
            assert info is None
            continue
        n = len(info["treespec_accept_lengths"])
        assert n >= 1 and len(info["treespec_verify_tokens"]) == n == len(info["treespec_tree_sizes"])
        served += n
    natives = sum(r.sampling_params.custom_params is None for r in one.left + one.reqs)
    assert served > 0 and served + natives <= 7 * rounds


def test_a_churned_rounds_count_leaves_out_first_use_set_up():
    """Under churn the warm-up runs until every set has joined once: the counted round of a one-request mix, whose
    request is a new set's each round, reads nothing back (a first c2t request's classifier load and graph, which a
    server does at start, read values: those rounds are warm-up)."""
    us, ops, reads, _, one = round_host_cost.measure("mix", 1, args(churn=1))
    assert reads == 0 and ops < 10


def test_a_streamed_round_sends_each_requests_new_rounds_through_the_output_hook():
    """``--stream``: each round ends with the output hook taking every request; a treespec request's chunks have
    sent each of its lists whole (its own count of what went), a native one has nothing sent."""
    us, ops, reads, _, one = round_host_cost.measure("mix", 7, args(stream=True))
    for req in one.reqs:
        if req.sampling_params.custom_params is None:
            assert req.customized_info is None and not hasattr(req, "_treespec_sent")
            continue
        sent = req._treespec_sent
        for key in ("treespec_tree_sizes", "treespec_verify_tokens", "treespec_accept_lengths"):
            assert sent[key] == len(req.customized_info[key]) == 3 + 1 + 3, key


def test_a_native_round_calls_straight_through():
    us, ops, reads, _, one = round_host_cost.measure("native", 5, args())
    assert (ops, reads) == (0, 0) and all(r.customized_info is None for r in one.reqs)


@pytest.mark.parametrize("name,eager", [("chain", False), ("chain", True), ("chain-lengths", False)])
def test_a_chain_mode_round_cuts_and_records_through_the_hooks(name, eager):
    """Chain mode (topk 1): every round records each treespec row's cut (``none``: the root alone; a length-2
    chain: 3 nodes; a C2T row: between 2 and S + 1), whether the draft replayed its graph or ran eagerly."""
    a = args(topk=1, steps=4, N=5, eager=eager)
    us, ops, reads, _, one = round_host_cost.measure(name, 8, a)
    specs = round_host_cost.SETS[name]
    for i, req in enumerate(one.reqs):
        spec = specs[i % len(specs)]
        sizes = (req.customized_info or {}).get("treespec_tree_sizes")
        if spec is None:
            assert req.customized_info is None
        elif spec["policy"] == "none" or "length" in spec:
            assert sizes == [1 if spec["policy"] == "none" else spec["length"] + 1] * (3 + 1 + a.repeats), spec
        else:
            assert sizes and all(2 <= n <= a.steps + 1 for n in sizes)
