"""What a server can draft: a request asking for more is refused with a message, never served natively."""

from types import SimpleNamespace

import pytest

from treespec_sglang.plugin.request import ERROR_KEY, flag_invalid_items, request_shares, unsupported_reason
from treespec_sglang.policies import parse_spec
from treespec_sglang.utils.bounded import Bounded

TREE = [{"policy": "talon"}, {"policy": "salf"}, {"policy": "c2t"}, {"policy": "eagle2", "budget": 4}]
CHAIN = [{"policy": "chain", "length": 2}, {"policy": "chain", "beta": 0.5}, {"policy": "none"}]


def args(topk=4, algo="EAGLE", multi=False):
    return SimpleNamespace(speculative_algorithm=algo, speculative_eagle_topk=topk, enable_multi_layer_eagle=multi)


@pytest.mark.parametrize("spec", TREE + CHAIN)
def test_a_tree_server_drafts_every_policy(spec):
    assert unsupported_reason(parse_spec(spec), args(topk=4)) is None


@pytest.mark.parametrize("spec", TREE)
def test_a_chain_server_refuses_tree_policies_naming_them_and_the_way_out(spec):
    msg = unsupported_reason(parse_spec(spec), args(topk=1))
    assert msg.startswith(f"{spec['policy']} needs a draft tree") and "'chain'" in msg and "topk > 1" in msg


@pytest.mark.parametrize("spec", CHAIN)
def test_a_chain_server_drafts_chains_and_none(spec):
    assert unsupported_reason(parse_spec(spec), args(topk=1)) is None


@pytest.mark.parametrize("topk, server, fine", [(2, 4, False), (3, 4, False), (4, 4, True), (8, 4, True),
                                                (10, 16, False), (16, 16, True)])
def test_eagle2_with_a_topk_below_the_servers_is_refused_naming_the_bound(topk, server, fine):
    """SGLang's beam at the server's k is not EAGLE-2's at a smaller one (the k' best children of the k' kept at each
    level): refused, never the server's tree under another name; a larger topk is capped (the pool's limit)."""
    msg = unsupported_reason(parse_spec({"policy": "eagle2", "budget": 4, "topk": topk}), args(topk=server))
    if fine:
        assert msg is None
    else:
        assert msg.startswith(f"eagle2.topk must be >= this server's --speculative-eagle-topk {server} (a larger one "
                              f"is capped at {server}), got {topk}")
    talon = parse_spec({"policy": "talon", "budget": 4, "topk": topk})  # TALON reads its topk over the pool
    assert unsupported_reason(talon, args(topk=server)) is None


@pytest.mark.parametrize("topk", [1, 4])
@pytest.mark.parametrize("spec", TREE[:1] + CHAIN)
def test_a_rejection_sampling_verify_refuses_every_policy(spec, topk):
    """Its kernel walks every drafted token: a cut chain, a policy's tree or speculation off would not be verified."""
    a = SimpleNamespace(**vars(args(topk=topk)), speculative_use_rejection_sampling=True)
    msg = unsupported_reason(parse_spec(spec), a)
    assert msg.startswith(spec["policy"]) and "--speculative-use-rejection-sampling" in msg


@pytest.mark.parametrize("spec", TREE + CHAIN)
def test_the_multi_layer_eagle_worker_refuses_every_policy(spec):
    msg = unsupported_reason(parse_spec(spec), args(multi=True))
    assert "--enable-multi-layer-eagle" in msg and msg.startswith(spec["policy"])


@pytest.mark.parametrize("topk", [1, 4])
@pytest.mark.parametrize("spec", TREE[:1] + CHAIN)
def test_pipeline_parallelism_refuses_every_policy(spec, topk):
    """Its stages rebuild the verify tree from SGLang's own top_scores_index (draft(with_topology=True)): the
    stages would verify different trees."""
    msg = unsupported_reason(parse_spec(spec), SimpleNamespace(**vars(args(topk=topk)), pp_size=2))
    assert msg.startswith(spec["policy"]) and "--pp-size 2" in msg
    one_stage = unsupported_reason(parse_spec(spec), SimpleNamespace(**vars(args(topk=topk)), pp_size=1))
    assert one_stage == unsupported_reason(parse_spec(spec), args(topk=topk))  # one stage: as without the field


def test_native_requests_and_servers_without_speculation_pass():
    assert unsupported_reason(None, args(topk=1, multi=True)) is None
    assert unsupported_reason(parse_spec({"policy": "talon"}), args(algo=None, topk=1)) is None


@pytest.mark.sglang
def test_the_server_fields_read_exist_in_sglang():
    sa = pytest.importorskip("sglang.srt.server_args")
    fields = sa.ServerArgs.__annotations__
    assert {"speculative_algorithm", "speculative_eagle_topk", "enable_multi_layer_eagle", "pp_size"} <= set(fields)


@pytest.mark.parametrize("cls,eagle3,refused", [
    ("LlamaForCausalLMEagle3", False, "an EAGLE-3 head"), ("LlamaForCausalLMEagle3", True, None),
    ("LlamaForCausalLMEagle", True, "an EAGLE head"), ("LlamaForCausalLMEagle", False, None),
    ("Qwen2ForCausalLMEagle", True, "an EAGLE head"), ("MiMoMTP", True, None), ("MiMoMTP", False, None)])
def test_the_draft_class_must_fit_the_algorithm(cls, eagle3, refused, monkeypatch):
    """The EAGLE-3-served-as-EAGLE trap (it runs and accepts nothing) and its reverse are refused at start, through
    the init_lm_head hook on a worker-shaped object; other draft classes (MTP) pass."""
    from treespec_sglang.plugin import hooks, server_hooks
    from treespec_sglang.plugin.config import draft_algorithm_mismatch

    reason = draft_algorithm_mismatch(cls, eagle3)
    assert (reason is None) if refused is None else (refused in reason and cls in reason)
    model = type(cls, (), {})()
    worker = SimpleNamespace(draft_runner=SimpleNamespace(model=model),
                             speculative_algorithm=SimpleNamespace(is_eagle3=lambda: eagle3))
    called = []
    if refused is None:
        monkeypatch.setattr(server_hooks, "check_settings_agree", lambda group: None)
        monkeypatch.setattr(server_hooks, "shard_hot_head", lambda original, self: called.append(self))
        hooks._draft_head(lambda self: None, worker)
        assert called == [worker]
    else:
        with pytest.raises(ValueError, match="--speculative-algorithm EAGLE"):
            hooks._draft_head(lambda self: called.append(self), worker)
        assert called == []


def test_a_requests_token_cap_opt_out_is_read_once(monkeypatch):
    """The draft hook asks every round whether each request shares the token cap: its ``custom_params`` are
    parsed on the first ask and the answer kept on the request (an opt-out stays an opt-out)."""
    from treespec_sglang.plugin import server_hooks

    reads = []
    real = server_hooks.request_shares
    monkeypatch.setattr(server_hooks, "request_shares", lambda sp: reads.append(sp) or real(sp))
    out = SimpleNamespace(sampling_params=SimpleNamespace(custom_params={"treespec": {"token_cap": False}}))
    shared = SimpleNamespace(sampling_params=SimpleNamespace(custom_params=None))
    for _ in range(3):
        assert server_hooks._req_shares(out) is False and server_hooks._req_shares(shared) is True
    assert len(reads) == 2


def test_requests_with_the_same_parameters_share_one_object(monkeypatch):
    """``request_params`` gives one object per parameter set (a batch's per-set work and per-composition caches
    key on it): equal values the same object, other values their own, the server default one object too; a full
    table starts again (sharing lost, values intact)."""
    from treespec_sglang.plugin import request
    from treespec_sglang.plugin.config import ServerDefaults

    def params(spec, defaults=ServerDefaults()):
        return request.request_params(SimpleNamespace(custom_params=spec and {"treespec": spec}), defaults)

    monkeypatch.setattr(request, "_INTERNED", Bounded(4096))
    a, b = params({"policy": "talon", "budget": 9}), params({"budget": 9, "policy": "talon"})
    c = params({"policy": "talon", "budget": 10})
    assert a is b and a == parse_spec({"policy": "talon", "budget": 9}) and c is not a and c.budget == 10
    d = ServerDefaults("salf", {"budget": 8})
    assert params(None, d) is params(None, d) is params({"policy": "salf", "budget": 8})
    assert params(None) is None
    full = Bounded(4096)
    full.update({i: i for i in range(4096)})
    monkeypatch.setattr(request, "_INTERNED", full)  # full, without a's set: starts again
    e = params({"policy": "talon", "budget": 9})
    assert e == a and e is not a and params({"policy": "talon", "budget": 9}) is e and len(request._INTERNED) == 1


def test_a_server_without_speculation_or_without_a_topk_flag_refuses_nothing():
    talon = parse_spec({"policy": "talon"})
    assert unsupported_reason(talon, SimpleNamespace()) is None  # no speculative_algorithm at all: plain decoding
    assert unsupported_reason(talon, SimpleNamespace(speculative_algorithm="EAGLE")) is None


def test_sharing_the_token_cap_is_refused_only_by_an_explicit_false():
    def sp(treespec):
        return SimpleNamespace(custom_params={"treespec": treespec})

    assert request_shares(sp({"policy": "talon", "token_cap": False})) is False
    assert request_shares(sp({"policy": "talon", "token_cap": True})) is True
    assert request_shares(sp({"policy": "talon"})) is True
    assert request_shares(sp({"policy": "talon", "token_cap": "no"})) is True  # malformed: refused on arrival
    assert request_shares(object()) is True  # sampling params without custom_params


@pytest.mark.parametrize("value", [{"policy": "talon", "budget": [8]}, {"policy": "talon", "budget": 10 ** 30},
                                   {"policy": "nope", "x": {"deep": [1, [2]]}}])
def test_a_marked_item_carries_its_message_and_not_its_value(value):
    """What travels to the scheduler is the message alone: the value may be one SGLang's msgpack transport
    (``SGLANG_USE_PICKLE_IPC=0``) cannot carry, which failed the scheduler's receive for every request."""
    item = {"max_new_tokens": 4, "custom_params": {"treespec": value, "other": 1}}
    (out,) = flag_invalid_items([item])
    cp = out["custom_params"]
    assert cp["treespec"] is None and cp["other"] == 1 and cp[ERROR_KEY].startswith("custom_params['treespec']: ")
    assert out["max_new_tokens"] == 4 and item["custom_params"]["treespec"] is value  # the caller's dict untouched


@pytest.mark.sglang
def test_a_marked_item_survives_sglangs_msgpack_transport():
    """The tokenized request as SGLang 0.5.23 sends it to the scheduler, through its msgpack encoder and decoder."""
    import array

    io = pytest.importorskip("sglang.srt.managers.io_struct")
    from sglang.srt.sampling.sampling_params import SamplingParams

    (out,) = flag_invalid_items([{"custom_params": {"treespec": {"policy": "talon", "budget": [8]}}}])
    req = io.TokenizedGenerateReqInput(
        rid="r0", input_text="hi", input_ids=array.array("q", [1, 2]), input_embeds=None, mm_inputs=None,
        token_type_ids=None, sampling_params=SamplingParams(**out), return_logprob=False, logprob_start_len=-1,
        top_logprobs_num=0, token_ids_logprob=None, stream=False)
    back = io.msgpack_decode(io.msgpack_encode(req)).sampling_params.custom_params
    assert back == {"treespec": None, ERROR_KEY: out["custom_params"][ERROR_KEY]}


def test_a_batchs_items_that_are_not_dicts_pass_through_unflagged():
    bad = {"custom_params": {"treespec": {"policy": "nope"}}}
    out = flag_invalid_items([None, bad, "x"])
    assert out[0] is None and out[2] == "x" and ERROR_KEY in out[1]["custom_params"]
