"""``python -m sglang.launch_server`` on the CPU with the plugin (the session's ``server`` fixture), over
HTTP: /generate with custom_params, the OpenAI client with ``extra_body``, a streaming request, a
refused bad request."""

import json
import urllib.error
import urllib.request

import pytest

from tests.e2e.conftest import greedy_params, post, same_tokens

pytestmark = [pytest.mark.e2e, pytest.mark.sglang, pytest.mark.slow]

POLICY = {"policy": "salf", "budget": 8, "batch": 4, "th": 0.1}


def test_generate_with_custom_params(server, prompt_ids, plain_greedy):
    out = json.loads(post(server + "/generate", {"input_ids": prompt_ids[0], "sampling_params": greedy_params(POLICY)}))
    assert same_tokens(out["output_ids"], plain_greedy[0])
    assert out["meta_info"]["treespec_policy"] == ["salf"]
    assert all(1 <= s <= 8 for s in out["meta_info"]["treespec_tree_sizes"])


def test_bad_custom_params_get_http_400_naming_the_field(server, prompt_ids):
    with pytest.raises(urllib.error.HTTPError) as e:
        post(server + "/generate", {"input_ids": prompt_ids[0],
                                    "sampling_params": greedy_params({"policy": "salf", "budget": 0})})
    assert e.value.code == 400
    assert "salf.budget must be in [1, 1024], got 0" in e.value.read().decode()


def test_streaming_generate_matches_the_whole_response(server, prompt_ids):
    body = {"input_ids": prompt_ids[1], "sampling_params": greedy_params(POLICY)}
    whole = json.loads(post(server + "/generate", body))
    req = urllib.request.Request(server + "/generate", json.dumps({**body, "stream": True}).encode(),
                                 {"Content-Type": "application/json"})
    chunks = []
    with urllib.request.urlopen(req, timeout=300) as r:
        for line in r:
            line = line.decode().strip()
            if line.startswith("data:") and line != "data: [DONE]":
                chunks.append(json.loads(line[5:]))
    assert len(chunks) > 1
    assert chunks[-1]["text"] == whole["text"]
    last, full = chunks[-1]["meta_info"], whole["meta_info"]
    assert last["spec_verify_ct"] == full["spec_verify_ct"]
    # SGLang alone sends request-level customized_info with the first chunk only (before any round ran);
    # the plugin sends each chunk its new rounds and the tokenizer manager accumulates them
    for key in ("treespec_policy", "treespec_tree_sizes", "treespec_verify_tokens", "treespec_accept_lengths"):
        assert last[key] == full[key], key
    # the summary goes once, with the last chunk, brought up to date as the request finished
    assert last["treespec_summary"] == full["treespec_summary"]
    assert not any(c["meta_info"].get("treespec_summary") for c in chunks[:-1])
    assert full["treespec_summary"][0]["rounds"] == len(full["treespec_accept_lengths"]) > 1
    assert full["treespec_summary"][0]["tree_nodes"] == sum(full["treespec_tree_sizes"])
    assert len(full["treespec_tree_sizes"]) == full["spec_verify_ct"] > 1
    seen = [len(c["meta_info"].get("treespec_tree_sizes") or []) for c in chunks]
    assert seen == sorted(seen) and len(set(seen) - {0}) > 1  # the rounds arrive as they run


def test_openai_client_with_extra_body(server, prompt_ids, spec_engine):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=server + "/v1", api_key="none")
    prompt = spec_engine.tokenizer.decode(prompt_ids[2])
    kw = dict(model="default", prompt=prompt, max_tokens=24, temperature=0)
    native = client.completions.create(**kw).choices[0].text
    ours = client.completions.create(**kw, extra_body={"custom_params": {"treespec": POLICY}}).choices[0].text
    assert ours == native and ours
    msgs = [{"role": "user", "content": "Write a haiku about trees."}]
    chat_native = client.chat.completions.create(model="default", messages=msgs, max_tokens=24, temperature=0)
    chat = client.chat.completions.create(model="default", messages=msgs, max_tokens=24, temperature=0,
                                          extra_body={"custom_params": {"treespec": {"policy": "c2t", "budget": 8,
                                                                                     "topk": 4, "beta": 0.5}}})
    assert chat.choices[0].message.content == chat_native.choices[0].message.content
    with pytest.raises(openai.BadRequestError, match="policy must be one of"):
        client.completions.create(**kw, extra_body={"custom_params": {"treespec": {"policy": "nope"}}})
