"""Real SGLang 0.5.23 on the CPU under its overlap scheduler, the scheduling a GPU server runs by default (SGLang
turns it off for speculative decoding on a CPU; the test bed lets it run,
:func:`treespec_sglang.plugin.cpu.host.allow_cpu_overlap`): a batch's results are processed after the next batch
has been launched, and a prefill's requests join the next decode batch before their own results finish them, so
a request the scheduler aborts on arrival can still sit in a decode round. EAGLE topk 4 / steps 3 / N 8 and chain
mode with the C2T stop, the demo target and the shipped draft: greedy equality, ``meta_info`` against SGLang's
counters, and malformed parameters failing alone."""

import pytest

from tests.e2e.conftest import (N, STEPS, TOPK, check_bad_items_fail_alone, check_every_policy_batch,
                                cpu_engine_kwargs, eagle_kwargs, greedy_params, same_tokens, shipped_draft)

pytestmark = [pytest.mark.e2e, pytest.mark.sglang, pytest.mark.slow]


@pytest.fixture(scope="module")
def overlap(host_factory, demo_target_dir):
    h = host_factory("eagle-overlap", cpu_engine_kwargs(demo_target_dir, overlap=True,
                                                        **eagle_kwargs(shipped_draft(), TOPK, STEPS, N)))
    yield h
    h.close()


@pytest.fixture(scope="module")
def overlap_chain(host_factory, demo_target_dir):
    h = host_factory("chain-overlap", cpu_engine_kwargs(demo_target_dir, overlap=True,
                                                        **eagle_kwargs(shipped_draft(), 1, STEPS, STEPS + 1)))
    yield h
    h.close()


@pytest.mark.parametrize("engine", ["overlap", "overlap_chain"])
def test_the_engines_run_sglangs_overlap_scheduler(request, engine):
    assert request.getfixturevalue(engine).method("get_server_info")["disable_overlap_schedule"] is False


def test_every_policy_and_native_in_one_batch_equals_plain_greedy(overlap, prompt_ids, plain_greedy):
    check_every_policy_batch(overlap, prompt_ids, plain_greedy)  # 4 x 6 = 24 requests in one call


def test_every_policy_without_native_rows_equals_plain_greedy(overlap, prompt_ids, plain_greedy):
    check_every_policy_batch(overlap, prompt_ids, plain_greedy, native=False)


def test_bad_params_fail_alone_in_a_batch(overlap, prompt_ids, plain_greedy):
    check_bad_items_fail_alone(overlap, prompt_ids, plain_greedy)


def test_a_policy_the_server_cannot_draft_fails_alone_while_its_batch_decodes(overlap_chain, prompt_ids,
                                                                              plain_greedy):
    """A tree policy on a chain server is parsed, then refused by the scheduler (an abort with the reason). SGLang
    still prefills it (one token) and finishes it with that prefill's result; under overlap the prefill's requests
    join the next decode batch first, so the refused request sits in one decode round, where it must be SGLang's
    own request (its refused policy never drafted) while its neighbours' chains run."""
    specs = [{"policy": "talon", "budget": 4}, {"policy": "chain", "length": 2}, {"policy": "salf"},
             {"policy": "chain", "length": STEPS, "beta": 0.85}, None]
    ids = [p for p in prompt_ids for _ in specs]
    outs = overlap_chain.generate(input_ids=ids, sampling_params=[greedy_params(s) for _ in prompt_ids for s in specs])
    for i, o in enumerate(outs):
        spec = specs[i % len(specs)]
        if spec is not None and spec["policy"] != "chain":
            fin = o["meta_info"]["finish_reason"]
            assert fin["type"] == "abort" and fin["message"].startswith(f"{spec['policy']} needs a draft tree"), fin
            assert not o["meta_info"].get("treespec_tree_sizes"), o["meta_info"]  # no round of its policy
        else:
            assert same_tokens(o["output_ids"], plain_greedy[i // len(specs)]), spec


def test_chain_mode_with_c2t_stops_and_lengths_equals_plain_greedy(overlap_chain, prompt_ids, plain_greedy):
    specs = [None, {"policy": "chain", "length": 2}, {"policy": "chain", "length": STEPS, "beta": 0.85},
             {"policy": "none"}]
    ids, params, refs = [], [], []
    for p, ref in zip(prompt_ids, plain_greedy):
        for spec in specs:
            ids.append(p)
            params.append(greedy_params(spec))
            refs.append((spec, ref))
    outs = overlap_chain.generate(input_ids=ids, sampling_params=params)
    cut = []
    for o, (spec, ref) in zip(outs, refs):
        assert same_tokens(o["output_ids"], ref), spec
        meta = o["meta_info"]
        if spec is None:
            continue
        sizes = meta["treespec_tree_sizes"]
        assert len(sizes) == len(meta["treespec_accept_lengths"]) == meta["spec_verify_ct"]
        cap = 1 if spec["policy"] == "none" else 1 + spec["length"]
        assert all(1 <= s <= cap for s in sizes), (spec, sizes)
        assert all(a <= s - 1 for a, s in zip(meta["treespec_accept_lengths"], sizes)), (spec, meta)
        cut += sizes if spec.get("beta") else []
    assert min(cut) < STEPS + 1, "the classifier never cut a chain"
