"""C2T early stop for chain drafting: per-row lengths vs a plain loop, and TP-rank agreement
(two processes over torch.distributed gloo, decisions broadcast from rank 0)."""

import os

import pytest
import torch

from tests.helpers import GlooGroup, run_ranks
from tests.plugin.chains import PARAMS, S, V, plain_lengths, step_logits
from treespec_sglang.plugin.chain_stop import ChainStopper, keep_mask, record_step
from treespec_sglang.policies import parse_spec

def stashed(params, logits, rows=None):
    """``[bs]`` the cut decided from what the draft loop recorded (a replay's padded batch of ``rows``: extra rows)."""
    bs = len(params)
    for i, lg in enumerate(logits):
        pad = torch.randn((rows or bs) - bs, V, generator=torch.Generator().manual_seed(i)) * 9
        record_step(torch.cat([lg, pad]), i, S)
    return ChainStopper(params, S, "cpu").cut(rows)


def test_lengths_match_a_plain_loop():
    params = [parse_spec(p) if p else None for p in PARAMS]
    length = stashed(params, step_logits(0))
    assert length.tolist() == plain_lengths(params, step_logits(0))
    assert keep_mask(length, S + 1).sum(-1).tolist() == [n + 1 for n in plain_lengths(params, step_logits(0))]
    assert length.tolist() != [S] * 4  # some row stopped early


@pytest.mark.parametrize("seed", range(6))
def test_mixed_rows_match_a_plain_loop(seed):
    """Random mixes of C2T rows (each its own beta), plain shorter chains, ``none`` and native rows."""
    g = torch.Generator().manual_seed(seed)
    pick = lambda n: int(torch.randint(n, (1,), generator=g))  # noqa: E731
    specs = [None, {"policy": "none"}, {"policy": "chain", "length": 1 + pick(S)},
             {"policy": "chain", "length": 1 + pick(S + 2),
              "beta": round(0.2 + 0.6 * float(torch.rand(1, generator=g)), 2)}]
    params = [parse_spec(spec) if spec else None for spec in (specs[pick(4)] for _ in range(7))]
    params[pick(7)] = parse_spec({"policy": "chain", "length": S, "beta": 0.5})  # at least one scored row
    logits = [torch.randn(7, V, generator=g) * (1 + 5 * torch.rand(7, 1, generator=g)) for _ in range(S - 1)]
    assert stashed(params, logits, rows=None if seed % 2 else 9).tolist() == plain_lengths(params, logits)


def _rank_main(rank, out):
    params = [parse_spec(p) if p else None for p in PARAMS]
    logits = step_logits(0)
    if rank == 1:  # another rank's logits differ slightly (non-deterministic kernels)
        logits = [lg + 3.0 * torch.randn(lg.shape, generator=torch.Generator().manual_seed(9)) for lg in logits]
    local = stashed(params, logits)
    agreed = keep_mask(local, S + 1, GlooGroup()).long().sum(-1) - 1
    torch.save({"local": local, "agreed": agreed}, os.path.join(out, f"rank{rank}.pt"))


def test_two_ranks_agree_on_rank0_decisions(tmp_path):
    run_ranks(_rank_main, 2, tmp_path, str(tmp_path))
    r0, r1 = (torch.load(tmp_path / f"rank{i}.pt") for i in (0, 1))
    assert torch.equal(r0["agreed"], r1["agreed"]) and torch.equal(r0["agreed"], r0["local"])
    assert not torch.equal(r0["local"], r1["local"]), "the ranks' own decisions should differ in this case"


@pytest.mark.parametrize("device", ["cpu", "cpu:0"])  # SGLang's worker names "cuda", its tensors are on "cuda:0"
def test_chain_mode_hooks_cut_each_row(monkeypatch, device):
    """The draft hook in chain mode (topk 1): each draft forward's logits feed the stopper, and the
    verify input keeps each row's chain up to its cut; stats land in customized_info once flushed."""
    from types import SimpleNamespace

    from treespec_sglang.plugin import hooks
    from treespec_sglang.tree import DraftTree, sglang_retrive

    monkeypatch.delenv("TREESPEC_POLICY", raising=False)
    N = S + 1
    logits = step_logits(0)
    reqs = [SimpleNamespace(sampling_params=SimpleNamespace(custom_params={"treespec": p} if p else None),
                            customized_info=None) for p in PARAMS]

    def model_forward(self, fb):
        return SimpleNamespace(logits_output=SimpleNamespace(next_token_logits=logits[fb]))

    def loop(self, fb):  # SGLang's draft_forward: one draft runner forward per loop step
        for i in range(S - 1):
            hooks._runner_forward(model_forward, None, i)

    def body(self, batch):
        hooks._draft_loop(loop, worker, None)
        chain = DraftTree.from_lists([list(range(N))] * 4, [[-1] + list(range(N - 1))] * 4)
        r = sglang_retrive(chain)
        return hooks._verify_input(SimpleNamespace(retrieve_next_token=r.retrive_next_token.clone(),
                                                   retrieve_next_sibling=r.retrive_next_sibling.clone()))

    worker = SimpleNamespace(topk=1, speculative_num_steps=S, speculative_num_draft_tokens=N, device=device)
    out = hooks._draft(body, worker, SimpleNamespace(reqs=reqs))
    lengths = plain_lengths([parse_spec(p) if p else None for p in PARAMS], logits)
    for b in range(4):
        walk, u = [0], 0
        while int(out.retrieve_next_token[b, u]) >= 0:
            u = int(out.retrieve_next_token[b, u])
            walk.append(u)
        assert walk == list(range(lengths[b] + 1)), b
    assert reqs[0].customized_info is None  # recorded when SGLang resolves the round (no device read here)
    hooks._PENDING.flush()
    assert reqs[0].customized_info["treespec_tree_sizes"] == [lengths[0] + 1]
    assert reqs[2].customized_info is None
    # outside a draft step the model-forward hook is a pass-through
    assert hooks._runner_forward(model_forward, None, 0).logits_output.next_token_logits is logits[0]


def test_a_chains_stats_stay_one_per_round_whether_or_not_the_batch_cuts(monkeypatch):
    """A chain request that never cuts (length >= S) beside one that does for a round, then alone, then in a round
    of adaptive speculation at 0 steps: every round it was in records its tree size, verify tokens and accept length
    (a round without a cut, or without a draft, recorded only the accept length, so its lists drifted apart; alone
    from the start it had no stats at all)."""
    from types import SimpleNamespace

    from treespec_sglang.plugin import hooks
    from treespec_sglang.tree import DraftTree, sglang_retrive

    monkeypatch.delenv("TREESPEC_POLICY", raising=False)
    steps, N = 3, 4

    def req(spec):
        return SimpleNamespace(sampling_params=SimpleNamespace(custom_params={"treespec": spec}), customized_info=None,
                               is_retracted=False, finished_reason=None, stream=False, finished=lambda: False)

    def body(self, batch):  # SGLang's draft: whole chains of N nodes
        r = sglang_retrive(DraftTree.from_lists([list(range(N))] * len(batch.reqs),
                                                [[-1] + list(range(N - 1))] * len(batch.reqs)))
        return hooks._verify_input(SimpleNamespace(retrieve_next_token=r.retrive_next_token.clone(),
                                                   retrieve_next_sibling=r.retrive_next_sibling.clone()))

    def round_(reqs, accepts):
        worker = SimpleNamespace(topk=1, speculative_num_steps=steps, speculative_num_draft_tokens=N, device="cpu")
        batch = SimpleNamespace(reqs=list(reqs))
        hooks._eagle_round(lambda self, b: hooks._draft(body, self, b), worker, batch)
        hooks._record_accepts(None, None, SimpleNamespace(num_correct_drafts_per_req_cpu=accepts), batch)

    def trivial_round(reqs):  # adaptive speculation at 0 steps: SGLang builds a root-only verify, no draft
        batch = SimpleNamespace(reqs=list(reqs))
        hooks._eagle_round(lambda self, b: hooks._trivial_round("verify input", self, b), None, batch)
        hooks._record_accepts(None, None, SimpleNamespace(num_correct_drafts_per_req_cpu=[0] * len(reqs)), batch)

    whole, cut = req({"policy": "chain"}), req({"policy": "chain", "length": 1})  # default length 5 >= S
    round_([whole, cut], [2, 1])
    round_([whole], [3])
    round_([whole], [1])
    trivial_round([whole])
    alone = req({"policy": "chain"})
    round_([alone], [3])
    trivial_round([req(None)])  # native: nothing recorded, nothing read
    hooks._PENDING.flush()
    info = whole.customized_info
    assert info["treespec_tree_sizes"] == [N] * 3 + [1] and info["treespec_accept_lengths"] == [2, 3, 1, 0]
    assert info["treespec_verify_tokens"] == [N, N, 1]  # the cut round's: the target's verify forward (not run here)
    assert cut.customized_info["treespec_tree_sizes"] == [2]
    assert alone.customized_info["treespec_tree_sizes"] == [N] and alone.customized_info["treespec_accept_lengths"] \
        == [3] and alone.customized_info["treespec_verify_tokens"] == [N]


def test_a_replays_padded_stash_decides_as_an_eager_one():
    """What the draft loop records eagerly, or a replayed graph for a padded batch of 6, gives the same lengths."""
    params = [parse_spec(p) if p else None for p in PARAMS]
    logits = step_logits(3)
    eager, replay = stashed(params, logits), stashed(params, logits, rows=6)
    assert torch.equal(eager, replay) and eager.tolist() == plain_lengths(params, logits)
    assert eager.tolist() != [S] * 4
    with pytest.raises(RuntimeError, match="no chain draft loop of shape \\(5, 5\\) recorded its steps"):
        ChainStopper(params, S, "cpu").cut(5)


@pytest.mark.parametrize("named", ["cpu:0", torch.device("cpu", 0)])
def test_the_stopper_reads_the_stash_under_the_device_its_tensors_are_on(named):
    """SGLang's draft worker names its device without an index ("cuda"), the loop's logits carry one ("cuda:0"):
    the same device, so the cut finds what the loop recorded (the CPU's "cpu:0" / "cpu" is the same pair)."""
    params = [parse_spec(p) if p else None for p in PARAMS]
    logits = step_logits(4)
    for i, lg in enumerate(logits):
        record_step(lg, i, S)
    assert ChainStopper(params, S, named).cut().tolist() == plain_lengths(params, logits)


def test_a_batch_whose_step_count_changes_gets_a_stopper_of_the_new_count():
    """SGLang's adaptive speculation moves a topk-1 server's step count between rounds of the same batch."""
    from treespec_sglang.plugin.columns import batch_columns
    from treespec_sglang.plugin.config import ServerDefaults
    from types import SimpleNamespace

    reqs = [SimpleNamespace(sampling_params=SimpleNamespace(custom_params={"treespec": p} if p else None))
            for p in PARAMS]
    defaults = ServerDefaults()
    cols = batch_columns(reqs, defaults)
    three = cols.chain_stopper(3, "cpu")
    assert cols.chain_stopper(3, "cpu") is three  # built once per batch
    five = cols.chain_stopper(5, "cpu")
    assert five.num_steps == 5 and five.max_len.tolist() == [5, 5, 5, 3]
    assert batch_columns(reqs, defaults).chain_stopper(5, "cpu") is five


@pytest.mark.parametrize("raw,on", [(None, False), ("", False), ("0", False), ("off", False), ("1", True),
                                    (" True ", True), ("yes", True), ("2", None)])
def test_chain_stop_graph_setting(monkeypatch, raw, on):
    from treespec_sglang.plugin.chain_stop import ENV_CHAIN_GRAPH, chain_graph_enabled

    if raw is None:
        monkeypatch.delenv(ENV_CHAIN_GRAPH, raising=False)
    else:
        monkeypatch.setenv(ENV_CHAIN_GRAPH, raw)
    if on is None:
        with pytest.raises(ValueError, match="TREESPEC_CHAIN_STOP_GRAPH must be one of 1 / 0 / true / false"):
            chain_graph_enabled()
    else:
        assert chain_graph_enabled() is on


@pytest.mark.parametrize("graph", [False, True])
def test_a_c2t_chain_round_replays_the_draft_graph_only_when_it_records_the_steps(monkeypatch, graph):
    """prepare_for_draft's hook: without TREESPEC_CHAIN_STOP_GRAPH a C2T chain round drafts eagerly (its loop
    records the steps as it runs); with it the replay stands and the round remembers the runner (padded rows)."""
    from types import SimpleNamespace

    from treespec_sglang.plugin import hooks
    from treespec_sglang.plugin.round import DraftStep, opened

    monkeypatch.setenv("TREESPEC_CHAIN_STOP_GRAPH", "1" if graph else "0")
    params = [parse_spec(p) if p else None for p in PARAMS]
    runner = SimpleNamespace(bs=8)
    with opened() as r:
        r.step, r.drafting = DraftStep(params, 1), True
        r.step.chain = ChainStopper(params, S, "cpu")
        fb, can_run, plan = hooks._prepare_for_draft(("fb", True, "plan"), None, None, None, runner)
        assert (fb, plan) == ("fb", "plan") and can_run is graph and r.step.runner is None
        if can_run:  # SGLang replays the graph
            hooks._draft_replayed(None, runner, fb)
            assert r.step.runner is runner


def test_the_loop_records_only_for_a_c2t_chain_round(monkeypatch):
    """Outside a C2T chain round (native, or a tree server) and outside a graph capture, the draft loop is
    SGLang's own: no statistics are computed."""
    from types import SimpleNamespace

    from treespec_sglang.plugin import hooks
    from treespec_sglang.plugin.chain_stop import recording_loop

    monkeypatch.setenv("TREESPEC_CHAIN_STOP_GRAPH", "1")  # on the CPU nothing is ever captured
    seen = []
    loop = lambda self, fb: seen.append(recording_loop())  # noqa: E731
    hooks._draft_loop(loop, SimpleNamespace(topk=1, speculative_num_steps=S), None)
    hooks._draft_loop(loop, SimpleNamespace(topk=4, speculative_num_steps=S), None)
    assert seen == [None, None]


def test_a_round_of_the_stop_reads_nothing_back_and_copies_no_list():
    """Steady state (the requests' parameter rows and classifiers cached): building the stopper, deciding from
    the stash and the keep mask run no host read and no host->device list copy."""
    from treespec_sglang.utils.syncs import count_ops

    params = [parse_spec(p) if p else None for p in PARAMS]
    for i, lg in enumerate(step_logits(5)):
        record_step(lg, i, S)
    ChainStopper(params, S, "cpu").cut()  # first round: rows and classifiers cached
    with count_ops() as c:
        keep_mask(ChainStopper(params, S, "cpu").cut(), S + 1)
    assert (c.reads, c.copies) == (0, 0), c.names


def test_one_draft_step_cuts_by_the_rows_lengths_alone():
    """S = 1: SGLang runs no draft loop step, so nothing is stashed; the cut is each row's own length (it raised)."""
    params = [parse_spec({"policy": "none"}), None, parse_spec({"policy": "chain", "length": 3, "beta": 0.5})]
    stop = ChainStopper(params, 1, "cpu")
    assert stop.active
    assert keep_mask(stop.cut(), 2).tolist() == [[True, False], [True, True], [True, True]]


@pytest.mark.parametrize("spec,steps,active,reads", [
    (None, S, False, False),                                          # native: SGLang's own round
    ({"policy": "chain", "length": S}, S, False, False),              # the captured chain: SGLang's own round
    ({"policy": "chain", "length": S + 2}, S, False, False),          # longer than captured: the captured chain
    ({"policy": "chain", "length": S - 1}, S, True, False),           # a shorter chain: its length alone
    ({"policy": "none"}, S, True, False),                             # the root alone
    ({"policy": "chain", "length": S, "beta": 0.5}, S, True, True),   # C2T: scored every step
    ({"policy": "chain", "length": 2, "beta": 0.5}, 2, True, True),   # S = 2: one loop step to score
    ({"policy": "chain", "length": 1, "beta": 0.5}, 1, True, False),  # S = 1: no loop step
])
def test_a_chain_batch_leaves_sglangs_round_only_where_a_row_is_cut(spec, steps, active, reads):
    """``active``: the round is not SGLang's own; ``reads_steps``: the cut reads the loop's steps (and only then are
    classifiers loaded for the batch)."""
    stop = ChainStopper([None, parse_spec(spec) if spec else None], steps, "cpu")
    assert (stop.active, stop.reads_steps, stop.classifiers is not None) == (active, reads, reads)


def test_a_depth_scored_exactly_at_beta_is_kept():
    """C2T keeps a token whose confidence is at least beta: a score equal to beta continues the chain."""
    from treespec_sglang.plugin.chain_stop import cut_lengths

    scores = torch.tensor([[0.5, 0.5, 0.5], [0.5, 0.49, 0.5], [0.7, 0.7, 0.7]])  # [bs, S-1] at depths 2..4
    steps = torch.zeros(3, 3)
    length = cut_lengths(steps, steps, torch.arange(2, 5), lambda feats: scores, torch.tensor([0.5, 0.5, 0.5]),
                         torch.tensor([4, 4, 3]))
    assert length.tolist() == [4, 2, 3]


def test_an_eager_cut_scores_each_row_with_its_own_classifier():
    from tests.plugin.pools import OTHER_CLF

    params = [parse_spec(p) for p in ({"policy": "chain", "beta": 0.5}, {"policy": "chain", "beta": 0.5,
              "classifier": OTHER_CLF}, {"policy": "chain", "length": 4, "beta": 0.3, "classifier": OTHER_CLF})]
    for seed in range(3):
        logits = step_logits(10 + seed, bs=3)
        assert stashed(params, logits, rows=5).tolist() == plain_lengths(params, logits)


@pytest.mark.parametrize("graph", [False, True])
def test_a_chain_round_without_a_beta_keeps_the_draft_graph_and_records_nothing(monkeypatch, graph):
    """Shorter chains and ``none`` are cut by their lengths alone: the round replays SGLang's draft graph whatever
    TREESPEC_CHAIN_STOP_GRAPH says, its eager loop records no statistics, and the stash is never read."""
    from types import SimpleNamespace

    from treespec_sglang.plugin import hooks
    from treespec_sglang.plugin.chain_stop import recording_loop
    from treespec_sglang.plugin.round import DraftStep, opened

    monkeypatch.setenv("TREESPEC_CHAIN_STOP_GRAPH", "1" if graph else "0")
    params = [parse_spec({"policy": "chain", "length": 2}), parse_spec({"policy": "none"}), None]
    monkeypatch.setattr("treespec_sglang.plugin.chain_stop._STASH", {})  # nothing recorded: a read would raise
    runner, seen = SimpleNamespace(bs=4), []
    with opened() as r:
        r.step, r.drafting = DraftStep(params, 1), True
        r.step.chain = ChainStopper(params, S, "cpu")
        assert r.step.chain.active and not r.step.chain.reads_steps
        fb, can_run, plan = hooks._prepare_for_draft(("fb", True, "plan"), None, None, None, runner)
        assert can_run is True
        hooks._draft_replayed(None, runner, fb)
        assert r.step.runner is runner
        worker = SimpleNamespace(topk=1, speculative_num_steps=S)
        hooks._draft_loop(lambda self, fb: seen.append(recording_loop()), worker, None)
        assert keep_mask(r.step.chain.cut(runner.bs), S + 1).sum(-1).tolist() == [3, 1, S + 1]
    assert seen == [None]


@pytest.mark.parametrize("scored", [False, True])
def test_only_a_cut_read_off_the_draft_is_broadcast_from_rank_0(monkeypatch, scored):
    """TP: a C2T cut (from this rank's draft statistics) is rank 0's on every rank, one broadcast a round; a cut
    from the rows' lengths alone is the same on every rank already, so the round broadcasts nothing."""
    from types import SimpleNamespace

    from treespec_sglang.plugin import hooks
    from treespec_sglang.plugin.round import DraftStep, opened
    from treespec_sglang.tree import DraftTree, sglang_retrive

    sent = []
    group = SimpleNamespace(world_size=2, rank_in_group=1, broadcast=lambda t, src=0: sent.append(t.clone()) or t)
    monkeypatch.setattr(hooks, "verify_group", lambda: group)
    specs = [{"policy": "chain", "length": 2}, {"policy": "none"}, None]
    if scored:
        specs[2] = {"policy": "chain", "beta": 0.5}
    params = [parse_spec(p) if p else None for p in specs]
    logits = step_logits(0, bs=3)
    want = plain_lengths(params, logits)
    chain = DraftTree.from_lists([list(range(S + 1))] * 3, [[-1] + list(range(S))] * 3)
    links = sglang_retrive(chain)
    with opened() as r:
        r.step, r.drafting = DraftStep(params, 1), True
        r.step.chain = ChainStopper(params, S, "cpu")
        if scored:
            for i, lg in enumerate(logits):
                record_step(lg, i, S)
        hooks._verify_input(SimpleNamespace(retrieve_next_token=links.retrive_next_token.clone(),
                                            retrieve_next_sibling=links.retrive_next_sibling.clone()))
        assert r.step.keep.sum(-1).tolist() == [n + 1 for n in want]
    assert len(sent) == (1 if scored else 0)
