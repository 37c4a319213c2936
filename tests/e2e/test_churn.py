"""Real SGLang 0.5.23 on the CPU: a decode batch whose requests change most rounds. An EAGLE engine that runs at most
6 requests at a time serves 18, each stopping at its own length: finished requests leave the batch, queued ones
join it after their prefill, so the plugin's per-batch state (the columns, the row table, the plan, the stats'
members) is rebuilt or looked up again round after round, with requests sharing one parameter object."""

import pytest

from tests.e2e.conftest import (N, N_NEW, POLICIES, STEPS, TOPK, check_meta, cpu_engine_kwargs, eagle_kwargs,
                                greedy_params, same_tokens, shipped_draft)

pytestmark = [pytest.mark.e2e, pytest.mark.sglang, pytest.mark.slow]

RUNNING = 6  # the engine's max running requests: the rest wait and join as others finish


@pytest.fixture(scope="module")
def small_eagle(host_factory, demo_target_dir):
    h = host_factory("eagle-6", cpu_engine_kwargs(demo_target_dir, max_running_requests=RUNNING,
                                                  **eagle_kwargs(shipped_draft(), TOPK, STEPS, N)))
    yield h
    h.close()


def test_requests_joining_and_leaving_mid_decode_keep_their_outputs_and_stats(small_eagle, prompt_ids,
                                                                              plain_greedy):
    """Every policy and native requests, three times the running cap, lengths 4..N_NEW: each output equals plain
    greedy's up to its length, each treespec request's three per-round lists are as long as its verify rounds
    (aligned round by round) and its summary counts them; native requests carry none."""
    names = sorted(POLICIES) + [None]
    ids, params, refs = [], [], []
    for i in range(3 * RUNNING):
        name, n = names[i % len(names)], 4 + (7 * i) % (N_NEW - 3)
        ids.append(prompt_ids[i % len(prompt_ids)])
        params.append(greedy_params(POLICIES[name] if name else None, n))
        refs.append((name, plain_greedy[i % len(prompt_ids)][:n]))
    outs = small_eagle.generate(input_ids=ids, sampling_params=params)
    for o, (name, ref) in zip(outs, refs):
        assert same_tokens(o["output_ids"], ref), name
        meta = o["meta_info"]
        if name is None:
            assert not meta.get("treespec_policy") and not meta.get("treespec_tree_sizes")
            continue
        assert meta["treespec_policy"] == [name]
        sizes = check_meta(meta, meta["completion_tokens"])
        rounds = len(meta["treespec_accept_lengths"])
        assert len(sizes) == len(meta["treespec_verify_tokens"]) == rounds, name
        summary = meta["treespec_summary"][0]
        assert summary["rounds"] == rounds and summary["tree_nodes"] == sum(sizes), name
