"""``bench/plugin_round_profile.py``'s comparison with plain greedy (the GPU benchmark's losslessness column)."""

from bench.plugin_round_profile import policy_sets
from bench.profile_rows import differences


def test_differences_name_each_request_at_its_first_differing_token():
    plain = [[5, 6, 7], [1, 2, 3, 4], [9, 9], [3]]
    got = [[5, 6, 7], [1, 2, 8, 4], [9, 9, 1], [3]]
    assert differences(got, plain) == [(1, 2, 8, 3), (2, 2, 1, -1)]  # a longer output differs where plain ended
    assert differences(plain, plain) == []
    assert differences([[4, 1]], [[5, 1]]) == [(0, 0, 4, 5)]


def test_native_runs_first_and_last_around_every_policy_and_the_mix():
    sets = policy_sets(4, 3, 8)
    names = list(sets)
    assert names[0] == "native" and names[-1] == "native_again" and sets["native_again"] == [None]
    assert {"eagle2", "talon", "salf", "c2t", "chain", "mix"} <= set(names[1:-1])


def test_one_engine_per_selection_and_ragged_setting():
    from argparse import Namespace

    from bench.plugin_round_profile import engines

    assert engines(Namespace(select="auto,torch", ragged=None)) == {  # the operator's ragged setting stays
        "auto": {"TREESPEC_SELECT": "auto"}, "torch": {"TREESPEC_SELECT": "torch"}}
    both = engines(Namespace(select="auto", ragged="0,1"))
    assert both == {"auto ragged=0": {"TREESPEC_SELECT": "auto", "TREESPEC_RAGGED_VERIFY": "0"},
                    "auto ragged=1": {"TREESPEC_SELECT": "auto", "TREESPEC_RAGGED_VERIFY": "1"}}


def test_a_random_target_has_the_drafts_dimensions_and_no_tokenizer(tmp_path):
    """``--target random``: a Llama of the shipped head's dimensions (its layers as asked), random weights, no
    tokenizer files; prompts of random ids avoiding the special ids, the same for the same seed."""
    import json
    import os

    import pytest

    pytest.importorskip("transformers")
    from safetensors import safe_open

    from bench.plugin_round_profile import random_prompt_ids, random_target
    from treespec_sglang.engine.loading import demo_draft_dir

    out = random_target(str(tmp_path / "t"), demo_draft_dir(), layers=2)
    cfg = json.load(open(os.path.join(out, "config.json")))
    head = json.load(open(os.path.join(demo_draft_dir(), "config.json")))
    for k in ("vocab_size", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
              "head_dim"):
        assert cfg[k] == head[k], k
    assert cfg["num_hidden_layers"] == 2 and cfg["architectures"] == ["LlamaForCausalLM"]
    assert not any(f.startswith("tokenizer") for f in os.listdir(out))
    with safe_open(os.path.join(out, "model.safetensors"), "pt") as f:
        emb = f.get_tensor("model.embed_tokens.weight")
        assert tuple(emb.shape) == (head["vocab_size"], head["hidden_size"]) and float(emb.std()) > 0
        assert "model.layers.1.mlp.down_proj.weight" in f.keys()
    ids = random_prompt_ids(5, 100, seed=3)
    assert ids == random_prompt_ids(5, 100, seed=3) != random_prompt_ids(5, 100, seed=4)
    assert all(32 <= len(p) <= 192 and min(p) >= 3 and max(p) < 100 for p in ids)


def test_a_random_target_runs_every_request_to_its_length():
    from bench.plugin_round_profile import params_for

    assert all(p["ignore_eos"] for p in params_for([None, {"policy": "salf"}], 3, 8, ignore_eos=True))
    assert not any("ignore_eos" in p for p in params_for([None], 2, 8))


def test_serving_reports_the_verified_tokens_and_the_share_verified_at_n():
    """``serve``: tau from SGLang's counters; the mean of the treespec verify tokens and the share at N (what
    tells a ``tuned`` run's ragged verifies from its padded ones); a native request has no treespec keys."""
    from bench.plugin_round_profile import serve

    metas = [{"completion_tokens": 6, "spec_verify_ct": 2, "spec_num_correct_drafts": 4,
              "treespec_verify_tokens": [8, 3]},
             {"completion_tokens": 4, "spec_verify_ct": 2, "spec_num_correct_drafts": 2,
              "treespec_verify_tokens": [8, 8, 5]},
             {"completion_tokens": 2, "spec_verify_ct": 1, "spec_num_correct_drafts": 0}]

    def generate(ids, sp):
        return [{"meta_info": metas[i], "output_ids": [i]} for i in ids]

    got = serve(generate, [0, 1, 2], [None] * 3, 2, n=8)
    assert got["tau"] == 1 + 6 / 5 and got["verified"] == 32 / 5 and got["padded"] == 3 / 5
    assert got["outputs"] == [[0], [1], [2]]
    assert serve(generate, [2], [None], 1, n=8)["verified"] is None  # native only


def test_passes_pool_into_one_row_with_the_median_pass_and_outputs_in_prompt_order():
    """``--passes``: each set's passes (prompt shares 0, 2 and 1, 3) pooled: ms per round is the median of the passes'
    own means (a pass that compiled moves it least), SGLang's and the hooks' parts are means over every round,
    tok/s and tau over every request, and the outputs come back in prompt order for the comparison with plain."""
    from bench.profile_rows import pooled

    def prof(rounds, seconds, hook_s):
        return {"ts": {"rounds": rounds, "round_s": seconds, "parts": {"hook:_draft": [hook_s, rounds]},
                       "ops": {"hook:_draft": [2 * rounds, 0]}}}

    def out(i, tokens):
        return {"meta_info": {"completion_tokens": tokens, "spec_verify_ct": 2, "spec_num_correct_drafts": 2},
                "output_ids": [i]}

    passes = [([0, 2], 1.0, [out(0, 10), out(2, 10)], prof(10, 0.050, 0.002)),
              ([1, 3], 3.0, [out(1, 20), out(3, 20)], prof(10, 0.150, 0.004)),
              ([4], 1.0, [out(4, 10)], prof(5, 0.030, 0.001))]
    row = pooled(passes, n=8)
    ts = row["ts"]
    assert ts["ms_passes"] == [5.0, 15.0, 6.0] and ts["ms"] == 6.0  # the median, not the mean (9.2)
    assert ts["rounds"] == 25 and abs(ts["plugin_ms"] - 1e3 * 0.007 / 25) < 1e-9
    assert ts["ops"]["hook:_draft"] == [2.0, 0.0]
    assert row["outputs"] == [[0], [1], [2], [3], [4]]
    assert row["tok_s"] == 70 / 5.0 and row["tau"] == 1 + 10 / 10
    one = pooled(passes[:1], n=8)["ts"]
    assert "ms_passes" not in one and one["ms"] == 5.0
