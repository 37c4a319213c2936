"""Chain mode (EAGLE topk 1, steps 3, N 4) in real SGLang on the CPU with the C2T early stop, the draft
written by our own checkpoint writer in float32 (so SGLang's EAGLE model class loads what we write)."""

import pytest
import torch

from tests.e2e.conftest import cpu_engine_kwargs, eagle_kwargs, greedy_params, resaved_draft, same_tokens

pytestmark = [pytest.mark.e2e, pytest.mark.sglang, pytest.mark.slow]

STEPS = 3


@pytest.fixture(scope="module")
def chain(host_factory, demo_target_dir, tmp_path_factory):
    draft = resaved_draft(str(tmp_path_factory.mktemp("draft-f32")), torch.float32)
    h = host_factory("chain", cpu_engine_kwargs(demo_target_dir, **eagle_kwargs(draft, 1, STEPS, STEPS + 1)))
    yield h
    h.close()


def test_native_chain_equals_plain_greedy(chain, prompt_ids, plain_greedy):
    outs = chain.generate(input_ids=prompt_ids, sampling_params=[greedy_params()] * len(prompt_ids))
    for o, ref in zip(outs, plain_greedy):
        assert same_tokens(o["output_ids"], ref)


def test_c2t_early_stop_equals_plain_greedy_and_cuts_rows_independently(chain, prompt_ids, plain_greedy):
    stop = {"policy": "chain", "beta": 0.85}
    params = [greedy_params(stop), greedy_params()] * len(prompt_ids)  # each prompt with and without the stop
    ids = [p for p in prompt_ids for _ in range(2)]
    outs = chain.generate(input_ids=ids, sampling_params=params)
    sizes = []
    for i, o in enumerate(outs):
        assert same_tokens(o["output_ids"], plain_greedy[i // 2])
        if i % 2 == 0:
            meta = o["meta_info"]
            assert meta["treespec_policy"] == ["chain"]
            s, a = meta["treespec_tree_sizes"], meta["treespec_accept_lengths"]
            assert all(1 <= x <= STEPS + 1 for x in s) and all(0 <= y <= x - 1 for x, y in zip(s, a))
            sizes += s
    assert len(set(sizes)) > 1, "the classifier never cut a chain: sizes all equal"
    assert min(sizes) < STEPS + 1


def test_none_and_a_shorter_chain_are_honoured_in_chain_mode(chain, prompt_ids, plain_greedy):
    """Chain mode without any early stop: ``none`` verifies its root alone, ``length 1`` one draft token,
    native rows the captured chain; all equal plain greedy."""
    specs = [{"policy": "none"}, {"policy": "chain", "length": 1}, None]
    ids = [prompt_ids[0]] * len(specs)
    outs = chain.generate(input_ids=ids, sampling_params=[greedy_params(s) for s in specs])
    for o in outs:
        assert same_tokens(o["output_ids"], plain_greedy[0])
    off, short, native = (o["meta_info"] for o in outs)
    assert set(off["treespec_tree_sizes"]) == {1} and set(off["treespec_accept_lengths"]) == {0}
    assert set(short["treespec_tree_sizes"]) == {2} and max(short["treespec_accept_lengths"]) <= 1
    assert "treespec_tree_sizes" not in native and native["spec_verify_ct"] < off["spec_verify_ct"]


def test_tree_policies_are_refused_in_chain_mode_with_a_message(chain, prompt_ids, plain_greedy):
    """A chain server cannot build a tree: each tree policy finishes at once with a message naming the
    policy and what the server can do, instead of drafting SGLang's chain silently; its neighbours run."""
    specs = [{"policy": "talon", "budget": 4}, {"policy": "eagle2", "budget": 3}, {"policy": "salf"},
             {"policy": "c2t"}, {"policy": "chain", "length": 2}, None]
    outs = chain.generate(input_ids=[prompt_ids[0]] * len(specs), sampling_params=[greedy_params(s) for s in specs])
    for s, o in zip(specs[:4], outs):
        fin = o["meta_info"]["finish_reason"]
        assert fin["type"] == "abort" and fin["message"].startswith(f"{s['policy']} needs a draft tree") \
            and "--speculative-eagle-topk 1" in fin["message"], fin
        assert "treespec_tree_sizes" not in o["meta_info"]
    for o in outs[4:]:
        assert same_tokens(o["output_ids"], plain_greedy[0])
    assert set(outs[4]["meta_info"]["treespec_tree_sizes"]) == {3}
