"""Operating the plugin against a real ``launch_server`` on the CPU (the session's ``server`` fixture, run with
``--enable-metrics`` and ``--treespec-classifier fast=...``): Prometheus series equal to the responses'
stats, the classifier registry (no client-chosen paths), ``{"policy": "none"}``, structured outputs with
trees, and the ``treespec`` section of ``/server_info``."""

import json
import re
import urllib.error

import pytest

from tests.e2e.conftest import N, get, greedy_params, post, same_tokens

pytestmark = [pytest.mark.e2e, pytest.mark.sglang, pytest.mark.slow]

TALON = {"policy": "talon", "budget": 8, "topk": 4}
C2T_FAST = {"policy": "c2t", "budget": 8, "topk": 4, "beta": 0.3, "classifier": "fast"}


def scrape(base) -> dict:
    """``/metrics`` -> {(sample name, policy, field or path label): value summed over the other labels}."""
    from prometheus_client.parser import text_string_to_metric_families

    out = {}
    for fam in text_string_to_metric_families(get(base + "/metrics")):
        for s in fam.samples:
            if s.name.startswith("treespec:") and not s.name.endswith("_created"):
                label = s.labels.get("policy", s.labels.get("field", s.labels.get("path")))
                key = (s.name, label, s.labels.get("le"))
                out[key] = out.get(key, 0.0) + s.value
    return out


def delta(after, before, name, label, le=None) -> float:
    return after.get((name, label, le), 0.0) - before.get((name, label, le), 0.0)


def generate(base, ids, custom=None, **extra):
    return json.loads(post(base + "/generate", {"input_ids": ids, "sampling_params": {**greedy_params(custom),
                                                                                        **extra}}))


def refusal(base, ids, custom) -> str:
    with pytest.raises(urllib.error.HTTPError) as e:
        generate(base, ids, custom)
    assert e.value.code == 400
    return json.loads(e.value.read().decode())["error"]["message"]


def test_metrics_equal_the_sums_of_the_responses(server, prompt_ids):
    before = scrape(server)
    outs = {"talon": [generate(server, prompt_ids[0], TALON), generate(server, prompt_ids[1], TALON)],
            "c2t": [generate(server, prompt_ids[2], C2T_FAST)]}
    generate(server, prompt_ids[3])  # native: no treespec series
    refusal(server, prompt_ids[0], {"policy": "salf", "budget": 0})
    after = scrape(server)
    for policy, rs in outs.items():
        infos = [r["meta_info"] for r in rs]
        assert all(i["treespec_policy"] == [policy] for i in infos)
        accepts = [a for i in infos for a in i["treespec_accept_lengths"]]
        sizes = [s for i in infos for s in i["treespec_tree_sizes"]]
        verified = sum(sum(i["treespec_verify_tokens"]) for i in infos)
        assert delta(after, before, "treespec:requests_total", policy) == len(rs)
        assert delta(after, before, "treespec:rounds_total", policy) == len(accepts) > 0
        assert delta(after, before, "treespec:accepted_draft_tokens_total", policy) == sum(accepts)
        assert delta(after, before, "treespec:verified_tokens_total", policy) == verified
        assert delta(after, before, "treespec:tree_size_count", policy) == len(sizes)
        assert delta(after, before, "treespec:tree_size_sum", policy) == sum(sizes)
        assert delta(after, before, "treespec:accept_length_sum", policy) == sum(accepts)
        assert delta(after, before, "treespec:tree_size_bucket", policy, "4.0") == sum(s <= 4 for s in sizes)
        # the summary covers every round and equals the lists here (far below the cap)
        for i in infos:
            s = i["treespec_summary"][0]
            assert s["rounds"] == len(i["treespec_accept_lengths"]) and not s["lists_truncated"]
            assert s["accepted_tokens"] == sum(i["treespec_accept_lengths"])
            assert s["tree_nodes"] == sum(i["treespec_tree_sizes"])
    # one verify forward per treespec round (each request alone), labelled by what it ran: ragged when < N tokens
    # (auto on the CPU tunes: a bucket's warm-up alternates the paths, then the faster one runs)
    runs = [v for rs in outs.values() for r in rs for v in r["meta_info"]["treespec_verify_tokens"]]
    ragged_runs, padded_runs = (delta(after, before, "treespec:verify_forwards_total", p) for p in ("ragged", "padded"))
    assert ragged_runs == sum(v < N for v in runs) and padded_runs == sum(v == N for v in runs)
    assert ragged_runs + padded_runs == len(runs) > 0
    assert delta(after, before, "treespec:refused_requests_total", "salf.budget") == 1
    assert not any(k[1] is None and k[0].startswith("treespec:requests") for k in after)


def test_metrics_carry_sglangs_rank_labels(server, prompt_ids):
    from prometheus_client.parser import text_string_to_metric_families

    generate(server, prompt_ids[0], TALON)
    fams = {f.name: f for f in text_string_to_metric_families(get(server + "/metrics"))}
    ours = [s for s in fams["treespec:rounds"].samples if s.name == "treespec:rounds_total"]
    theirs = next(iter(fams["sglang:num_running_reqs"].samples)).labels
    assert ours and all({**theirs, "policy": s.labels["policy"]}.items() >= s.labels.items() for s in ours)
    assert {"model_name", "tp_rank"} <= set(ours[0].labels)


def test_a_request_picks_a_registered_classifier_by_name(server, prompt_ids, plain_greedy):
    out = generate(server, prompt_ids[1], C2T_FAST)
    assert same_tokens(out["output_ids"], plain_greedy[1])
    default = generate(server, prompt_ids[1], {**C2T_FAST, "classifier": "default"})
    assert same_tokens(default["output_ids"], plain_greedy[1])


@pytest.mark.parametrize("value", ["/etc/hostname", "/proc/self/environ", "/nonexistent/c2t.pt", "../c2t.pt", 7])
def test_a_classifier_path_is_refused_the_same_way_whether_or_not_it_exists(server, prompt_ids, value):
    msg = refusal(server, prompt_ids[0], {**C2T_FAST, "classifier": value})
    assert msg == ("custom_params['treespec']: c2t.classifier must be one of the server's registered classifiers "
                   "['default', 'fast'], got a value that is not a classifier name (paths are never opened)")


def test_an_unknown_name_is_named_back(server, prompt_ids):
    msg = refusal(server, prompt_ids[0], {"policy": "chain", "length": 3, "beta": 0.5, "classifier": "fsat"})
    assert "chain.classifier must be one of the server's registered classifiers ['default', 'fast'], got 'fsat'" in msg


def test_policy_none_turns_speculation_off_for_one_request(server, prompt_ids, plain_greedy):
    """One batch: speculation off, a tree policy and a native request; all equal plain greedy."""
    body = {"input_ids": prompt_ids[:3],
            "sampling_params": [greedy_params({"policy": "none"}), greedy_params(TALON), greedy_params()]}
    outs = json.loads(post(server + "/generate", body))
    for out, ref in zip(outs, plain_greedy[:3]):
        assert same_tokens(out["output_ids"], ref)
    off, tree, native = (o["meta_info"] for o in outs)
    assert off["treespec_policy"] == ["none"]
    assert set(off["treespec_tree_sizes"]) == {1} and set(off["treespec_accept_lengths"]) == {0}
    # a CPU tree verify runs the batch at its widest tree (the native request's N while it lives)
    assert len(off["treespec_verify_tokens"]) == len(off["treespec_tree_sizes"])
    assert max(tree["treespec_tree_sizes"]) > 1 and not native.get("treespec_policy")


GRAMMARS = [
    ("json_schema", json.dumps({"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                                                 "age": {"type": "integer"}},
                                "required": ["name", "age"], "additionalProperties": False}),
     lambda text: set(json.loads(text)) == {"name", "age"}),
    ("regex", r"(yes|no), because [a-z ]{4,24}\.", lambda text: re.fullmatch(r"(yes|no), because [a-z ]{4,24}\.", text)),
    ("ebnf", 'root ::= "Answer: " digit digit? "."\ndigit ::= [0-9]', lambda text: re.fullmatch(r"Answer: \d\d?\.", text)),
]
POLICIES = [TALON, {"policy": "eagle2", "budget": 6}, {"policy": "salf", "budget": 8, "batch": 4, "th": 0.1},
            C2T_FAST, {"policy": "chain", "length": 3}, {"policy": "none"}]


@pytest.mark.parametrize("kind,grammar,check", GRAMMARS, ids=[g[0] for g in GRAMMARS])
def test_structured_output_with_every_policy_equals_the_native_request(server, spec_engine, kind, grammar, check):
    """A grammar-constrained batch (every policy and a native request, greedy): every output satisfies the
    grammar and equals the native request's output."""
    prompt = spec_engine.encode(["Give a short answer about a person called Ada."])[0]
    sp = {"max_new_tokens": 40, "temperature": 0.0, kind: grammar}
    specs = [None] + POLICIES
    body = {"input_ids": [prompt] * len(specs),
            "sampling_params": [{**sp, **({"custom_params": {"treespec": s}} if s else {})} for s in specs]}
    outs = json.loads(post(server + "/generate", body))
    texts = [o["text"] for o in outs]
    assert check(texts[0]), texts[0]
    assert texts == [texts[0]] * len(specs)
    # a batch's native item carries the treespec keys empty (SGLang collates customized_info per batch)
    assert [(o["meta_info"].get("treespec_policy") or [None])[0] for o in outs] == [None] + [
        s["policy"] for s in POLICIES]
    assert all(max(o["meta_info"]["treespec_tree_sizes"]) > 1 for o in outs[1:-1])  # real trees under the grammar


def test_server_info_reports_the_plugin(server, classifier_file):
    import hashlib

    info = json.loads(get(server + "/server_info"))["treespec"]
    from treespec_sglang import __version__

    assert info["version"] == __version__ and info["sglang"] == "0.5.23"
    assert info["classifiers"]["fast"] == hashlib.sha256(open(classifier_file, "rb").read()).hexdigest()
    assert set(info["classifiers"]) == {"default", "fast"}
    assert info["default_policy"] is None and info["token_cap"] is None
    assert info["ragged_verify"] == "auto" and info["stats_max_rounds"] == 4096 and info["selection"] == "auto"
    assert info["chain_stop_graph"] is False
    assert "none" in info["policies"] and "talon" in info["policies"]
