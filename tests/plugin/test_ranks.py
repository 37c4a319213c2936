"""Several ranks, one tree (:mod:`treespec_sglang.plugin.ranks`): rank 0's decisions on every rank, the
settings check, CPU groups without PyNccl, the faults tests inject; the hooks that use them (the token map's head
shards under TP: ``test_ranks_hot_head.py``).
Multi-rank cases run in spawned processes over a gloo group (``tests.helpers.run_ranks``)."""

import dataclasses
import json
import os
from types import SimpleNamespace

import pytest
import torch

from tests.helpers import GlooGroup, run_ranks
from treespec_sglang.plugin import ranks as R
from treespec_sglang.plugin.config import ServerDefaults
from treespec_sglang.plugin.request import request_params
from treespec_sglang.policies.classifier import DEFAULT_FILE
from treespec_sglang.policies.params import Eagle2Params


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    for k in ("TREESPEC_POLICY", "TREESPEC_CONFIG", "TREESPEC_TOKEN_CAP", "TREESPEC_CLASSIFIERS",
              R.ENV_PERTURB, R.ENV_PERTURB_VERIFY, R.ENV_DIGESTS):
        monkeypatch.delenv(k, raising=False)


# ------------------------------------------------------------------------------------------ agree
def _agree_main(rank, out):
    g = torch.Generator().manual_seed(rank)  # each rank holds its own values
    idx = torch.randint(0, 50, (3, 7), generator=g)
    keep = torch.rand(3, 8, generator=g) > 0.5
    before = dict(R.BROADCASTS)
    a_idx, a_keep = R.agree([idx, keep], GlooGroup())
    (again,) = R.agree([idx[:1]], GlooGroup())  # a second round: the counters add up
    assert torch.equal(again, a_idx[:1])
    torch.save({"idx": idx, "keep": keep, "a_idx": a_idx, "a_keep": a_keep,
                "count": R.BROADCASTS["count"] - before["count"], "bytes": R.BROADCASTS["bytes"] - before["bytes"]},
               os.path.join(out, f"rank{rank}.pt"))


def test_every_rank_gets_rank0s_values_in_one_broadcast(tmp_path):
    run_ranks(_agree_main, 2, tmp_path, str(tmp_path))
    r0, r1 = (torch.load(tmp_path / f"rank{i}.pt") for i in (0, 1))
    assert not torch.equal(r0["idx"], r1["idx"])  # the ranks started out different
    for r in (r0, r1):
        assert torch.equal(r["a_idx"], r0["idx"]) and torch.equal(r["a_keep"], r0["keep"])
        assert r["a_keep"].dtype == torch.bool and r["a_idx"].dtype == torch.int64
        assert r["count"] == 2 and r["bytes"] == 8 * (3 * 7 + 3 * 8) + 8 * 7


def test_alone_agree_is_the_identity_and_sends_nothing():
    t = torch.arange(6).view(2, 3)
    before = dict(R.BROADCASTS)
    for group in (None, SimpleNamespace(world_size=1)):
        (out,) = R.agree([t], group)
        assert out is t
    assert R.BROADCASTS == before


# ------------------------------------------------------------------------------------------ verify outcome
def _verify_case(bs=3, n=5, steps=4):
    """A greedy verify as SGLang calls it: a chain of n nodes per request (node i's first child i + 1) whose
    candidates equal the target's tokens for a prefix, SGLang's int32 outputs and int64 tree tensors."""
    g = torch.Generator().manual_seed(5)
    target = torch.randint(0, 40, (bs, n), generator=g)
    cand = torch.roll(target, 1, dims=1)  # node i + 1 carries the target's token at node i: every draft accepted
    cand[1, 3] = (cand[1, 3] + 1) % 40  # request 1 stops after two
    nxt = torch.where(torch.arange(n) < n - 1, torch.arange(n) + 1, -1).expand(bs, n).contiguous()
    return dict(predicts=torch.zeros(bs * n, dtype=torch.int32), accept_index=torch.full((bs, steps), -1, dtype=torch.int32),
                accept_token_num=torch.zeros(bs, dtype=torch.int32), candidates=cand,
                retrieve_index=torch.arange(bs * n).view(bs, n), retrieve_next_token=nxt,
                retrieve_next_sibling=torch.full((bs, n), -1), target_predict=target, topk=4)


def _greedy_verify(predicts, accept_index, accept_token_num, candidates, retrieve_index, retrieve_next_token,
                   retrieve_next_sibling, target_predict, topk=-1):
    """SGLang's ``verify_tree_greedy_func`` on the CPU (the strict stand-in of its kernel)."""
    from treespec_sglang.plugin.cpu.kernels import verify_tree_greedy_cpu

    verify_tree_greedy_cpu(predicts, accept_index, accept_token_num, candidates, retrieve_index, retrieve_next_token,
                           retrieve_next_sibling, target_predict)
    return predicts, accept_index, accept_token_num


def _verify_main(rank, out, digests):
    os.environ[R.ENV_PERTURB_VERIFY] = "1"  # rank 1's verify splits from rank 0's at every node
    os.environ[R.ENV_DIGESTS] = digests
    R.verify_group = GlooGroup  # the plugin's group lookup, pointed at this world
    case = _verify_case()
    own = _greedy_verify(**{k: v.clone() if torch.is_tensor(v) else v for k, v in case.items()})
    if rank == 1:
        flipped = dict(case, target_predict=case["target_predict"].flip(-1).contiguous())
        own = _greedy_verify(**{k: v.clone() if torch.is_tensor(v) else v for k, v in flipped.items()})
    before = dict(R.BROADCASTS)
    first = [case.pop(k) for k in ("predicts", "accept_index", "accept_token_num")]  # positional: bound by name
    got = R.agree_verify(_greedy_verify, *first, **case)
    torch.save({"own": own, "got": got, "count": R.BROADCASTS["count"] - before["count"]},
               os.path.join(out, f"rank{rank}.pt"))


def test_every_rank_accepts_rank0s_outcome_even_when_its_own_verify_split(tmp_path):
    digests = tmp_path / "digests"
    digests.mkdir()
    run_ranks(_verify_main, 2, tmp_path, str(tmp_path), str(digests))
    r0, r1 = (torch.load(tmp_path / f"rank{i}.pt") for i in (0, 1))
    assert r0["own"][2].tolist() == [3, 2, 3]  # the case accepts drafts on rank 0 ...
    assert not all(torch.equal(a, b) for a, b in zip(r0["own"], r1["own"]))  # ... and rank 1's own verify differs
    for r in (r0, r1):
        assert all(torch.equal(a, b) and a.dtype == torch.int32 for a, b in zip(r["got"], r0["own"]))
        assert r["count"] == 1  # one broadcast per round
    rows = {k: (digests / f"verify-rank{k}.txt").read_text().split() for k in (0, 1)}
    assert rows[0][0] == rows[0][1] == rows[1][1] != rows[1][0]  # own / agreed hashes per rank


def test_alone_the_greedy_verify_is_sglangs_call_untouched():
    calls = []

    def original(*args, **kwargs):
        calls.append((args, kwargs))
        return "sglang's"

    assert R.agree_verify(original, 1, 2, topk=3) == "sglang's" and calls == [((1, 2), {"topk": 3})]


# ------------------------------------------------------------------------------------------ settings
def _settings_main(rank, out):
    if rank == 1:
        os.environ["TREESPEC_POLICY"], os.environ["TREESPEC_CONFIG"] = "talon", '{"budget": 12}'
    try:
        res = R.check_settings_agree(GlooGroup())
    except RuntimeError as e:
        res = str(e)
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump({"digest": R.settings_digest(), "result": res}, f)


def test_a_rank_with_other_settings_stops_with_a_message(tmp_path):
    """Rank 0 returns the agreed digest; a rank started with another policy stops, its message naming both
    digests' first 16 hex digits and what to give every rank. Alone there is nothing to agree."""
    run_ranks(_settings_main, 2, tmp_path, str(tmp_path))
    r0, r1 = (json.loads((tmp_path / f"rank{i}.json").read_text()) for i in (0, 1))
    assert r0["result"] == r0["digest"] != r1["digest"]
    assert r1["result"] == (  # every input of the digest named, both digests' heads, what to do
        "treespec: this rank's settings (TREESPEC_POLICY / TREESPEC_CONFIG / TREESPEC_TOKEN_CAP, the policies of "
        "TREESPEC_POLICY_MODULES, the classifier files of TREESPEC_CLASSIFIERS, TREESPEC_STATS_MAX_ROUNDS, "
        "TREESPEC_SELECT, TREESPEC_CHAIN_STOP_GRAPH, TREESPEC_RAGGED_VERIFY / _TUNING) differ from rank 0's: "
        f"sha256 {r1['digest'][:16]} here vs {r0['digest'][:16]} on rank 0; give every rank the same flags, "
        "environment and files")
    assert R.check_settings_agree(None) is None and R.check_settings_agree(SimpleNamespace(world_size=1)) is None


@pytest.mark.parametrize("var,value", [
    ("TREESPEC_POLICY", "talon"), ("TREESPEC_CONFIG", '{"budget": 7}'), ("TREESPEC_TOKEN_CAP", "7"),
    ("TREESPEC_SELECT", "triton"), ("TREESPEC_CHAIN_STOP_GRAPH", "1"), ("TREESPEC_STATS_MAX_ROUNDS", "9"),
    ("TREESPEC_RAGGED_VERIFY", "1"), ("TREESPEC_RAGGED_TUNING", "warmup=9"),
    ("TREESPEC_CLASSIFIERS", json.dumps({"other": DEFAULT_FILE}))])
def test_the_settings_digest_follows_every_input(monkeypatch, var, value):
    """Each input a rank's per-round decisions depend on, changed alone, changes the digest (a rank started with
    another value would stop at start), and back again gives the same digest."""
    monkeypatch.delenv(var, raising=False)
    if var == "TREESPEC_CONFIG":  # a config is the default policy's
        monkeypatch.setenv("TREESPEC_POLICY", "talon")
    base = R.settings_digest()
    monkeypatch.setenv(var, value)
    assert R.settings_digest() != base
    monkeypatch.delenv(var)
    assert R.settings_digest() == base


def test_the_settings_digest_follows_the_registered_policies_and_their_pool_stages(fresh_registry):
    """A registered policy whose pool stage differs, and a policy registered on one rank only (an operator's module
    imported there; one without a pool rule): each changes the digest."""
    base = R.settings_digest()
    talon = fresh_registry.REGISTRY["talon"]
    fresh_registry.REGISTRY["talon"] = dataclasses.replace(talon, pool_rule=fresh_registry.REGISTRY["c2t"].pool_rule)
    try:
        assert R.settings_digest() != base  # same names, talon's rows run another stage
    finally:
        fresh_registry.REGISTRY["talon"] = talon
    assert R.settings_digest() == base
    # an operator's policy without a pool rule, registered here only (a class of its own: a module imported by an
    # earlier test would register nothing the second time)
    params = dataclasses.make_dataclass("DigestOnlyParams", [], bases=(Eagle2Params,), frozen=True)
    fresh_registry.register_policy(type("DigestOnlyPolicy", (fresh_registry.REGISTRY["eagle2"].engine,),
                                        {"name": "digest-only", "Params": params, "pool_rule": None}))
    assert R.settings_digest() != base


# ------------------------------------------------------------------------------------------ CPU groups
def test_a_gloo_group_gets_no_pynccl():
    seen = []

    def init_model_parallel_group(group_ranks, local_rank, backend, use_pynccl=None, use_custom_allreduce=None,
                                  group_name=None):
        seen.append((backend, use_pynccl, use_custom_allreduce, group_name))

    R.cpu_parallel_group(init_model_parallel_group, [[0, 1]], 0, "gloo", group_name="tp")
    R.cpu_parallel_group(init_model_parallel_group, [[0, 1]], 0, "nccl", group_name="tp")
    R.cpu_parallel_group(init_model_parallel_group, [[0, 1]], 0, backend="gloo", use_pynccl=True)
    assert seen == [("gloo", False, False, "tp"), ("nccl", None, None, "tp"), ("gloo", False, False, None)]


@pytest.mark.sglang
@pytest.mark.parametrize("dp_attention", [False, True])
def test_the_verify_group_is_the_one_sglangs_own_verify_takes(monkeypatch, dp_attention):
    """SGLang's ``eagle_sample`` broadcasts over the attention TP group under DP attention and over the TP group
    otherwise (the two differ with attention context parallelism, whose slices verify one batch together): the
    plugin's agreements take the same group."""
    pytest.importorskip("sglang")
    import sglang.srt.layers.dp_attention as dp
    import sglang.srt.runtime_context as rc

    parallel = SimpleNamespace(tp_group=object(), attn_tp_group=object())
    monkeypatch.setattr(rc, "get_parallel", lambda: parallel)
    monkeypatch.setattr(dp, "is_dp_attention_enabled", lambda: dp_attention)
    assert R.verify_group() is (parallel.attn_tp_group if dp_attention else parallel.tp_group)


# ------------------------------------------------------------------------------------------ faults for tests
def test_only_the_named_rank_sees_perturbed_scores(monkeypatch):
    scores = [torch.tensor([[0.5, 0.2]]), torch.tensor([[0.1]])]
    rank1 = SimpleNamespace(rank_in_group=1)
    assert R.perturbed(scores, rank1) is scores  # no fault asked for
    monkeypatch.setenv(R.ENV_PERTURB, "1")
    assert R.perturbed(scores, SimpleNamespace(rank_in_group=0)) is scores
    assert R.perturbed(scores, None) is scores
    out = R.perturbed(scores, rank1)
    assert all(torch.equal(o, -t) for o, t in zip(out, scores)) and len(out) == 2
    assert R.perturbed_rank(rank1) and not R.perturbed_rank(SimpleNamespace(rank_in_group=0))
    assert not R.perturbed_rank(None)
    table = torch.tensor([[-1, 0, 1, 2]])  # [bs, W] a parent table
    assert R.perturbed_parent_list(table, SimpleNamespace(rank_in_group=0, world_size=2)) is table
    assert R.perturbed_parent_list(table, rank1) is table  # a group of one rank: its table is the one used
    assert R.perturbed_parent_list(table, SimpleNamespace(rank_in_group=1, world_size=2)).tolist() == [[2, 1, 0, -1]]
    monkeypatch.setenv(R.ENV_PERTURB, "0")  # rank 0's table is every rank's: never reversed
    assert R.perturbed_parent_list(table, SimpleNamespace(rank_in_group=0, world_size=2)) is table


def test_digests_log_own_and_agreed_trees_per_rank(tmp_path, monkeypatch):
    a, b = (torch.tensor([[1, 2]]), torch.tensor([[True, False]])), (torch.tensor([[2, 1]]), torch.tensor([[True, True]]))
    R.record_digest(a, a, None)  # off: writes nothing
    assert not list(tmp_path.iterdir())
    monkeypatch.setenv(R.ENV_DIGESTS, str(tmp_path))
    R.record_digest(a, a, None)
    R.record_digest(b, a, SimpleNamespace(rank_in_group=1))
    (own0, agreed0), = [line.split() for line in (tmp_path / "rank0.txt").read_text().splitlines()]
    (own1, agreed1), = [line.split() for line in (tmp_path / "rank1.txt").read_text().splitlines()]
    assert own0 == agreed0 == agreed1 != own1


@pytest.mark.parametrize("other", [
    (torch.tensor([[1, 2, 3, 4]]),),                         # the same bytes, one [1, 4] tensor
    (torch.tensor([[1, 2]]), torch.tensor([[3, 4]])),        # the same bytes, split in two
    (torch.tensor([[1], [2]]), torch.tensor([[3, 4]])),      # split and reshaped
    (torch.tensor([[1, 2], [3, 4]]).view(torch.float64),),  # the same shape and bits, read as float64
])
def test_a_digest_tells_trees_apart_whose_bytes_run_together_alike(other):
    tree = (torch.tensor([[1, 2], [3, 4]]),)  # [bs, W]
    digest = R._tree_hash(tree)
    assert len(digest) == 16 and int(digest, 16) >= 0
    assert R._tree_hash((torch.tensor([[1, 2], [3, 4]]),)) == digest  # equal trees, equal digests
    assert b"".join(t.numpy().tobytes() for t in other) == tree[0].numpy().tobytes()
    assert R._tree_hash(other) != digest


# ------------------------------------------------------------------------------------------ no per-rank fallback
def test_a_malformed_value_raises_instead_of_falling_back():
    sp = SimpleNamespace(custom_params={"treespec": {"policy": "talon", "budget": -1}})
    with pytest.raises(ValueError, match=r"custom_params\['treespec'\]: .*budget"):
        request_params(sp, ServerDefaults("eagle2", {"budget": 8}))


def _req(custom):
    aborts = []
    req = SimpleNamespace(sampling_params=SimpleNamespace(custom_params=custom),
                          set_finish_with_abort=lambda msg, **kw: aborts.append(msg))
    return req, aborts


def test_the_scheduler_refuses_a_value_that_skipped_validation():
    from treespec_sglang.plugin import hooks

    bad, bad_aborts = _req({"treespec": {"policy": "salf", "th": 7}})
    good, good_aborts = _req({"treespec": {"policy": "salf", "th": 0.2}})
    for req in (bad, good):
        assert hooks._create_generation_req(req, None) is req
    assert len(bad_aborts) == 1 and "th" in bad_aborts[0] and good_aborts == []
    assert good._treespec_params.th == 0.2  # parsed once, at creation


def test_a_chain_mode_treespec_batch_votes_for_an_eager_draft_before_dp_ranks_reduce(monkeypatch):
    """In chain mode (topk 1) a decode batch with a stopping chain votes no (the C2T stop reads each draft step);
    on a tree server it keeps the graph (the selection runs on the replay's pool)."""
    from treespec_sglang.plugin import hooks, server_hooks

    monkeypatch.setitem(server_hooks._DRAFT_TOPK, "topk", 1)
    def batch(custom, decode=True):
        req = SimpleNamespace(sampling_params=SimpleNamespace(custom_params=custom))
        return SimpleNamespace(reqs=[req], forward_mode=SimpleNamespace(is_decode=lambda: decode))

    talon = {"treespec": {"policy": "chain", "length": 3, "beta": 0.4}}  # a stopping chain
    assert hooks._draft_graph_vote(True, batch(talon)) is False
    assert hooks._draft_graph_vote(True, batch(None)) is True  # native: SGLang's own vote
    assert hooks._draft_graph_vote(False, batch(None)) is False
    assert hooks._draft_graph_vote(True, batch(talon, decode=False)) is True
    assert hooks._draft_graph_vote(True, None) is True
    monkeypatch.setitem(server_hooks._DRAFT_TOPK, "topk", 4)
    assert hooks._draft_graph_vote(True, batch(talon)) is True
