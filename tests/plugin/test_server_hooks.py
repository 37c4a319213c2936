"""The server-side hook bodies (``plugin/server_hooks.py``) as SGLang calls them, on stand-in objects: the metrics
hooks enable the plugin's series with SGLang's labels only where SGLang collects metrics, ``/server_info`` gains its
``treespec`` section, a batch's malformed items are counted as refused and its cached per-item objects follow the
marked copies, DP attention's draft-graph vote, the scheduler's abort of what a server cannot draft, the draft
worker's start checks (each handed what it checks), SGLang's per-request info keys, the CPU's sampling verify, and
the ``--treespec-*`` flags (their help kept equal to docs/plugin.md's). (With SGLang's own objects:
``test_sglang_real.py``, ``test_ranks.py``.)"""

from types import SimpleNamespace

import pytest

from tests.helpers import cli_flags
from treespec_sglang.plugin import server_hooks
from treespec_sglang.plugin.columns import batch_columns
from treespec_sglang.plugin.request import ERROR_KEY


@pytest.fixture
def enabled(monkeypatch):
    """The labels each metrics family was enabled with: ``{"scheduler": [...], "tokenizer": [...]}``."""
    seen = {"scheduler": [], "tokenizer": []}
    monkeypatch.setattr(server_hooks, "enable_scheduler", lambda labels: seen["scheduler"].append(labels))
    monkeypatch.setattr(server_hooks, "enable_tokenizer", lambda labels: seen["tokenizer"].append(labels))
    return seen


@pytest.mark.parametrize("scheduler, want", [
    (SimpleNamespace(metrics_collector=SimpleNamespace(labels={"model_name": "m", "tp_rank": 1})),
     [{"model_name": "m", "tp_rank": 1}]),
    (SimpleNamespace(metrics_collector=SimpleNamespace()), [{}]),  # a collector without labels
    (SimpleNamespace(metrics_collector=None), []),  # a rank that logs no stats
    (SimpleNamespace(), []),
])
def test_the_scheduler_series_follow_sglangs_collector_and_its_labels(enabled, scheduler, want):
    assert server_hooks._scheduler_metrics("out", scheduler) == "out"
    assert enabled == {"scheduler": want, "tokenizer": []}


@pytest.mark.parametrize("manager, want", [
    (SimpleNamespace(enable_metrics=True, metrics_collector=SimpleNamespace(labels={"model_name": "m"})),
     [{"model_name": "m"}]),
    (SimpleNamespace(enable_metrics=True, metrics_collector=SimpleNamespace(labels=None)), [{}]),
    (SimpleNamespace(enable_metrics=True, metrics_collector=SimpleNamespace()), [{}]),
    (SimpleNamespace(enable_metrics=True), [{}]),
    (SimpleNamespace(enable_metrics=False, metrics_collector=SimpleNamespace(labels={"model_name": "m"})), []),
    (SimpleNamespace(metrics_collector=SimpleNamespace(labels={"model_name": "m"})), []),  # no flag: off
])
def test_the_refused_counter_is_enabled_only_with_the_tokenizers_metrics(enabled, manager, want):
    assert server_hooks._tokenizer_metrics("out", manager) == "out"
    assert enabled == {"scheduler": [], "tokenizer": want}


def test_server_info_gains_the_treespec_section_and_nothing_else(monkeypatch):
    monkeypatch.setattr(server_hooks, "server_info", lambda: {"policies": ["talon"]})
    info = {"version": "0.5.23"}
    assert server_hooks._server_info(info, None, None) is info
    assert info == {"version": "0.5.23", "treespec": {"policies": ["talon"]}}
    assert server_hooks._server_info("not a dict") == "not a dict"


@pytest.fixture
def refused(monkeypatch):
    """The messages ``count_refused`` was called with."""
    out = []
    monkeypatch.setattr(server_hooks, "count_refused", out.append)
    return out


BAD = {"max_new_tokens": 4, "custom_params": {"treespec": {"policy": "talon", "budget": 0}}}
GOOD = {"max_new_tokens": 4, "custom_params": {"treespec": {"policy": "talon", "budget": 8}}}


def test_each_malformed_batch_item_is_counted_as_refused_with_its_message(refused):
    obj = SimpleNamespace(sampling_params=[GOOD, BAD, None, {"max_new_tokens": 4}, dict(BAD)])
    server_hooks._handle_batch_request(None, obj)
    assert len(refused) == 2 and all("talon.budget must be in [1, 1024], got 0" in m for m in refused)
    assert refused[0] == obj.sampling_params[1]["custom_params"][ERROR_KEY]
    assert obj.sampling_params[2] is None and obj.sampling_params[0] is GOOD  # items left as given


def test_a_batch_sharing_one_dict_is_left_whole_and_its_cached_items_alone(refused):
    """One dict for every item: not marked (the call fails as a whole), and the per-item objects SGLang already
    handed out keep what they had."""
    sub = SimpleNamespace(sampling_params="as handed out")
    obj = SimpleNamespace(sampling_params=dict(BAD), _sub_obj_cache={0: sub})
    server_hooks._handle_batch_request(None, obj)
    assert refused == [] and obj.sampling_params == BAD and sub.sampling_params == "as handed out"


def test_cached_items_follow_the_marked_copies(refused):
    subs = {0: SimpleNamespace(sampling_params=GOOD), 1: SimpleNamespace(sampling_params=BAD), 2: SimpleNamespace()}
    obj = SimpleNamespace(sampling_params=[GOOD, BAD, GOOD], _sub_obj_cache=subs)
    server_hooks._handle_batch_request(None, obj)
    assert subs[1].sampling_params is obj.sampling_params[1] and ERROR_KEY in subs[1].sampling_params["custom_params"]
    assert subs[0].sampling_params is GOOD and not hasattr(subs[2], "sampling_params")


def test_an_embedding_request_passes_untouched(refused):
    obj = SimpleNamespace(text="x")
    assert server_hooks._handle_batch_request(None, obj) is None and vars(obj) == {"text": "x"} and refused == []


STOPPING = {"policy": "chain", "length": 4, "beta": 0.5}  # its C2T stop reads the draft's steps


@pytest.fixture
def chain_server(monkeypatch):
    """A chain-mode server (topk 1) whose requests are their ``spec`` (absent: native), the chain graph's
    recording off."""
    from treespec_sglang.policies import parse_spec

    monkeypatch.setitem(server_hooks._DRAFT_TOPK, "topk", 1)
    monkeypatch.delenv("TREESPEC_CHAIN_STOP_GRAPH", raising=False)
    monkeypatch.setattr(server_hooks, "server_defaults", lambda: None)
    monkeypatch.setattr(server_hooks, "_req_params", lambda r, defaults: parse_spec(r["spec"]) if r else None)


def decode(reqs):
    return SimpleNamespace(reqs=reqs, forward_mode=SimpleNamespace(is_decode=lambda: True))


def test_the_draft_graph_vote_edges(chain_server, monkeypatch):
    """Only a decode batch with a stopping chain on a chain server votes for an eager draft, and only while the
    graph does not record the steps; a batch without requests (an idle DP rank's, with or without the
    attribute) keeps SGLang's vote."""
    assert server_hooks._draft_graph_vote(True, decode([{}, {"spec": STOPPING}])) is False
    assert server_hooks._draft_graph_vote(True, decode([{}])) is True
    assert server_hooks._draft_graph_vote(True, SimpleNamespace()) is True  # no reqs attribute, no forward_mode
    assert server_hooks._draft_graph_vote(True, SimpleNamespace(reqs=[])) is True
    assert server_hooks._draft_graph_vote(False, decode([{"spec": STOPPING}])) is False
    monkeypatch.setenv("TREESPEC_CHAIN_STOP_GRAPH", "1")  # the graph records the steps: it replays
    assert server_hooks._draft_graph_vote(True, decode([{"spec": STOPPING}])) is True
    monkeypatch.delenv("TREESPEC_CHAIN_STOP_GRAPH")
    monkeypatch.setitem(server_hooks._DRAFT_TOPK, "topk", 2)  # a tree server: the selection runs after the graph
    assert server_hooks._draft_graph_vote(True, decode([{"spec": STOPPING}])) is True


@pytest.mark.parametrize("spec", [{"policy": "chain", "length": 2}, {"policy": "none"}, {"policy": "chain"}])
def test_a_chain_batch_whose_cut_reads_no_step_keeps_the_graph_under_dp_attention(chain_server, spec):
    """Its cut is the rows' lengths alone: the draft hook keeps the graph without DP attention, and the vote
    keeps it with (it voted every treespec chain batch eager: a lost graph every round)."""
    assert server_hooks._draft_graph_vote(True, decode([{"spec": spec}, {}])) is True


class Req:
    """A scheduler request: its sampling parameters and the abort it was finished with (if any)."""

    def __init__(self, custom_params=None):
        self.sampling_params = SimpleNamespace(custom_params=custom_params)
        self.aborted = None

    def set_finish_with_abort(self, msg, status_code, err_type):
        self.aborted = (msg, status_code, err_type)


TREE_SERVER = SimpleNamespace(server_args=SimpleNamespace(speculative_algorithm="EAGLE", speculative_eagle_topk=4))
CHAIN_SERVER = SimpleNamespace(server_args=SimpleNamespace(speculative_algorithm="EAGLE", speculative_eagle_topk=1))


@pytest.fixture
def default(monkeypatch):
    """Sets the server's default policy (a ``ServerDefaults``) the scheduler hook reads."""
    from treespec_sglang.plugin.config import ServerDefaults

    def set_default(policy=None, **config):
        monkeypatch.setattr(server_hooks, "server_defaults", lambda: ServerDefaults(policy, config))
    set_default()
    return set_default


def test_a_marked_item_is_aborted_with_the_tokenizers_message(default):
    """The tokenizer's message wins (the item's policy itself would pass here); nothing is parsed again."""
    req = Req({"treespec": {"policy": "talon", "budget": 8}, ERROR_KEY: "custom_params['treespec']: marked"})
    assert server_hooks._create_generation_req(req, TREE_SERVER) is req
    assert req.aborted == ("custom_params['treespec']: marked", None, "BadRequestError")


@pytest.mark.parametrize("custom_params, server, want", [
    ({"treespec": {"policy": "talon"}}, CHAIN_SERVER, "talon needs a draft tree"),
    ({"treespec": {"policy": "talon"}}, TREE_SERVER, None),
    ({"treespec": {"policy": "chain", "length": 2}}, CHAIN_SERVER, None),
    ({"treespec": {"policy": "talon", "budget": 0}}, TREE_SERVER, "custom_params['treespec']: talon.budget must be"),
    (None, CHAIN_SERVER, None),  # native
])
def test_the_scheduler_aborts_what_this_server_cannot_draft(default, custom_params, server, want):
    req = Req(custom_params)
    server_hooks._create_generation_req(req, server)
    if want is None:
        assert req.aborted is None
    else:
        msg, status, kind = req.aborted
        assert msg.startswith(want) and (status, kind) == (None, "BadRequestError")


@pytest.mark.parametrize("custom_params, server", [
    ({"treespec": {"policy": "nope"}, ERROR_KEY: "custom_params['treespec']: policy must be"}, TREE_SERVER),
    ({"treespec": {"policy": "talon", "budget": 0}}, TREE_SERVER),  # skipped the tokenizer's validation
    ({"treespec": {"policy": "talon"}}, CHAIN_SERVER),  # valid, but not on this server
])
def test_an_aborted_request_is_native_to_the_rounds_it_may_still_sit_in(default, custom_params, server):
    """SGLang prefills an aborted request and the overlap scheduler merges it into the next decode batch before
    the prefill's result finishes it: the round's hooks read it as SGLang's own (parsing it there raised out of
    the draft, taking down the scheduler with every request)."""
    req = Req(custom_params)
    server_hooks._create_generation_req(req, server)
    assert req.aborted is not None
    assert server_hooks._req_params(req, server_hooks.server_defaults()) is None
    assert batch_columns([req], server_hooks.server_defaults()).params == (None,)


def test_a_request_without_params_takes_the_servers_default(default):
    default("talon")  # a tree default (a chain server refuses it at start; here it shows which default is read)
    req = Req()
    server_hooks._create_generation_req(req, CHAIN_SERVER)
    assert req.aborted[0].startswith("talon needs a draft tree")
    default("chain", length=2)
    fine = Req()
    server_hooks._create_generation_req(fine, CHAIN_SERVER)
    assert fine.aborted is None and fine._treespec_params is not None


@pytest.fixture
def start_checks(monkeypatch):
    """The draft worker's start-time checks, each recording what it was handed: ``[(name, args), ...]``."""
    calls = []

    def record(name):
        return lambda *a, **k: calls.append((name, a, k))
    for name in ("check_ragged_parallelism", "check_ragged_model", "check_settings_agree", "check_selection"):
        monkeypatch.setattr(server_hooks, name, record(name))
    monkeypatch.setattr(server_hooks, "verify_group", lambda: "the verify group")
    monkeypatch.setattr(server_hooks, "shard_hot_head", lambda original, self, *a, **k: ("head", original, a, k))
    monkeypatch.setitem(server_hooks._DRAFT_TOPK, "topk", "unset")
    return calls


def draft_worker(runner=True, topk=4, **more):
    runner = SimpleNamespace(model=SimpleNamespace(), device="cuda:3") if runner is True else runner
    return SimpleNamespace(draft_runner=runner, topk=topk, speculative_num_steps="3", speculative_num_draft_tokens="8",
                           server_args="the server args", target_worker=SimpleNamespace(model_runner="the target"),
                           **more)


def original(self, *args, **kwargs):
    return "built"


def test_the_draft_head_hook_runs_each_start_check_on_what_it_is_for(start_checks):
    out = server_hooks._draft_head(original, draft_worker(), "arg", key="value")
    assert out == ("head", original, ("arg",), {"key": "value"})  # the head is built by the TP-sharding wrapper
    assert start_checks == [("check_ragged_parallelism", ("the server args",), {}),
                            ("check_ragged_model", ("the target",), {}),
                            ("check_settings_agree", ("the verify group",), {}),
                            ("check_selection", ("cuda:3", 4, 3, 8), {})]
    assert server_hooks._DRAFT_TOPK["topk"] == 4


@pytest.mark.parametrize("worker, selection, topk", [
    (draft_worker(runner=SimpleNamespace(model=SimpleNamespace()), topk=1), ("cpu", 1, 3, 8), 1),  # no device: CPU
    (draft_worker(runner=None, speculative_algorithm="an algorithm never asked"), None, 4),  # no draft runner yet
    (draft_worker(topk=None), None, "unset"),
])
def test_the_draft_head_hook_without_a_runner_device_or_topk(start_checks, worker, selection, topk):
    server_hooks._draft_head(original, worker)
    assert [a for name, a, _ in start_checks if name == "check_selection"] == ([selection] if selection else [])
    assert server_hooks._DRAFT_TOPK["topk"] == topk


def test_per_request_info_keys_are_the_plugins_and_sglangs_own():
    seen = []

    def sglang_own(self, key, *args, **kwargs):
        seen.append((self, key, args, kwargs))
        return key == "sglang_key"
    assert server_hooks._request_level_key(sglang_own, "streamer", "treespec_tree_sizes") is True and seen == []
    assert server_hooks._request_level_key(sglang_own, "streamer", "sglang_key", 1, flag=2) is True
    assert server_hooks._request_level_key(sglang_own, "streamer", "other") is False
    assert seen[0] == ("streamer", "sglang_key", (1,), {"flag": 2})


@pytest.fixture
def eagle_utils(monkeypatch):
    """SGLang's ``eagle_utils`` module as the CPU sees it: one sampling op missing, one None, one present."""
    import sys
    import types

    mod = types.ModuleType("sglang.srt.speculative.eagle_utils")
    mod.top_k_renorm_prob, mod.top_p_renorm_prob = None, "sglang's own"
    monkeypatch.setitem(sys.modules, "sglang.srt.speculative.eagle_utils", mod)
    return mod


def test_the_cpu_verify_samples_with_the_plugins_ops_where_sglang_has_none(eagle_utils):
    from treespec_sglang.plugin.cpu import sampling

    def verify(*args, **kwargs):
        return args, kwargs
    assert server_hooks._verify_uses_greedy(verify, "a", is_cpu=True, t=1) == (("a",), {"is_cpu": False, "t": 1})
    assert eagle_utils.tree_speculative_sampling_target_only is sampling.tree_speculative_sampling_target_only
    assert eagle_utils.top_k_renorm_prob is sampling.top_k_renorm_prob and eagle_utils.top_p_renorm_prob == "sglang's own"
    for kwargs in ({"is_cpu": False}, {"is_cpu": True, "use_rejection_sampling": True}):
        assert server_hooks._verify_uses_greedy(verify, "a", **kwargs) == (("a",), kwargs)  # as SGLang has it


# ---------------------------------------------------------------------------- the --treespec-* flags
def treespec_parser():
    import argparse

    parser = argparse.ArgumentParser(prog="launch_server", add_help=False,
                                     formatter_class=lambda prog: argparse.HelpFormatter(prog, width=116))
    assert server_hooks._add_cli_args("out", parser) == "out"
    return parser


def test_the_flags_parse_to_their_types_and_repeat_where_they_may(tmp_path):
    parser = treespec_parser()
    assert vars(parser.parse_args([])) == dict(treespec_policy=None, treespec_config=None, treespec_token_cap=None,
                                               treespec_classifier=None)
    args = parser.parse_args(["--treespec-policy", "talon", "--treespec-config", '{"budget": 8}',
                              "--treespec-token-cap", "16", "--treespec-classifier", "a=/x",
                              "--treespec-classifier", "b=/y"])
    assert (args.treespec_policy, args.treespec_config, args.treespec_token_cap) == ("talon", '{"budget": 8}', 16)
    assert args.treespec_classifier == ["a=/x", "b=/y"]


def test_the_flags_help_is_what_the_docs_show():
    """docs/plugin.md shows the ``treespec`` group of ``--help`` (wrapped at 116 columns) as a ``text`` block."""
    import os
    import re

    text = treespec_parser().format_help()
    docs = open(os.path.join(os.path.dirname(__file__), "..", "..", "docs", "plugin.md")).read()
    (block,) = re.findall(r"```text\n(treespec:\n.*?)\n```", docs, flags=re.S)
    assert text[text.index("treespec:"):].rstrip() == block


def test_the_flags_help_names_every_tree_policy_and_a_valid_example():
    import json

    from treespec_sglang.policies.registry import REGISTRY
    from treespec_sglang.plugin.request import parse_spec, request_shares, validate_custom_params

    helps = {a.dest: a.help for a in treespec_parser()._actions}
    listed = helps["treespec_policy"].split("(")[1].split(")")[0].split(", ")
    assert sorted(listed) == sorted(n for n in REGISTRY if n != "none")  # the built-in tree policies
    example = json.loads(helps["treespec_config"].split("e.g. '")[1].rstrip("'"))
    parse_spec({"policy": "talon", **example})  # the example is a valid talon config
    opt_out = json.loads(helps["treespec_token_cap"].split("opts out with ")[1].split(" in ")[0])
    sp = SimpleNamespace(custom_params={"treespec": {"policy": "talon", **opt_out}})
    validate_custom_params(sp.custom_params)
    assert request_shares(sp) is False  # the opt-out the help shows is one


@pytest.fixture
def configured(monkeypatch):
    """What ``configure`` was called with from the flags: ``[(policy, config, token_cap, classifiers)]``."""
    from treespec_sglang.plugin.config import ServerDefaults

    calls = []
    monkeypatch.setattr(server_hooks, "configure", lambda *a: calls.append(a) or ServerDefaults())
    return calls


def test_no_flag_configures_nothing_even_without_the_flags_attributes(configured):
    for args in (cli_flags(), SimpleNamespace()):  # a parser that never added them
        assert server_hooks._from_cli_args("server args", None, args) == "server args"
    assert configured == []


def test_a_classifier_flag_alone_configures_the_classifiers(configured, tmp_path):
    path = tmp_path / "c2t.pt"
    path.write_bytes(b"")
    server_hooks._from_cli_args(None, None, cli_flags(classifier=[f"mine={path}"]))
    assert configured == [(None, None, None, {"mine": str(path)}), (None, {}, None)]  # the classifiers, then no policy


@pytest.mark.parametrize("flags, env, message", [
    (dict(policy="bogus"), {}, "--treespec-policy / TREESPEC_CONFIG: policy must be one of "),
    (dict(policy=""), {}, "--treespec-policy / TREESPEC_CONFIG: policy must be one of "),
    (dict(policy="talon", config='{"mu": 7}'), {}, "--treespec-policy / --treespec-config: talon.mu must be "),
    (dict(config='{"mu": 7}'), {"TREESPEC_POLICY": "talon"}, "TREESPEC_POLICY / --treespec-config: talon.mu "),
    (dict(policy="talon", config=""), {}, "--treespec-config must be a JSON object of the policy's parameters, got ''"),
    (dict(policy="talon", config="  "), {}, "--treespec-config must be a JSON object of the policy's parameters"),
])
def test_a_bad_flag_names_the_flag_or_variable_it_came_from(monkeypatch, flags, env, message):
    """An empty --treespec-config is refused, not read as no parameters; a policy's error names its source."""
    for var in ("TREESPEC_POLICY", "TREESPEC_CONFIG", "TREESPEC_TOKEN_CAP"):  # restored at teardown
        monkeypatch.setenv(var, env.get(var, ""))
    with pytest.raises(ValueError) as e:
        server_hooks._from_cli_args(None, None, cli_flags(**flags))
    assert str(e.value).startswith(message), str(e.value)


@pytest.mark.parametrize("config, env, source", [("{bad", None, "--treespec-config"),
                                                 (None, "{bad", "TREESPEC_CONFIG")])
def test_a_bad_config_names_where_it_came_from(configured, monkeypatch, config, env, source):
    if env is not None:
        monkeypatch.setenv("TREESPEC_CONFIG", env)
    with pytest.raises(ValueError, match=rf"^{source} must be a JSON object: "):
        server_hooks._from_cli_args(None, None, cli_flags(policy="talon", config=config))


RELAXED = ("treespec: --speculative-accept-threshold-single/acc != 1 relaxes verification; sampling is then not "
           "lossless (greedy is unaffected)")


@pytest.mark.parametrize("thresholds, warned", [
    ({}, False), ({"speculative_accept_threshold_single": None, "speculative_accept_threshold_acc": None}, False),
    ({"speculative_accept_threshold_single": 1.0, "speculative_accept_threshold_acc": 1.0}, False),
    ({"speculative_accept_threshold_acc": 0.9}, True), ({"speculative_accept_threshold_single": 2.0}, True)])
def test_relaxed_accept_thresholds_are_warned_about_in_so_many_words(configured, caplog, thresholds, warned):
    import logging

    with caplog.at_level(logging.WARNING, logger="treespec_sglang.plugin"):
        server_hooks._from_cli_args(None, None, cli_flags(**thresholds))
    assert [r.getMessage() for r in caplog.records] == ([RELAXED] if warned else [])


def test_a_bad_request_is_counted_as_refused_and_fails_with_its_message(refused):
    bad = SimpleNamespace(custom_params={"treespec": {"policy": "talon", "budget": 0}})
    with pytest.raises(ValueError, match=r"talon.budget must be in \[1, 1024\], got 0") as e:
        server_hooks._verify_sampling_params(None, bad, 1000)
    assert refused == [str(e.value)]
    assert server_hooks._verify_sampling_params("ok", SimpleNamespace(), 1000) == "ok" and len(refused) == 1


def test_a_request_whose_sampling_params_carry_no_custom_params_is_native(default):
    req = Req()
    del req.sampling_params.custom_params
    assert server_hooks._create_generation_req(req, CHAIN_SERVER) is req and req.aborted is None
