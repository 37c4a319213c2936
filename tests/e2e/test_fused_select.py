"""Real SGLang 0.5.23 on the CPU with the fused selection kernel (``TREESPEC_SELECT=triton``, run by Triton's
interpreter here, compiled on a GPU): every policy, a registered custom policy and native requests in one batch
equal plain greedy."""

import pytest

from tests.e2e.conftest import (N, STEPS, TOPK, cpu_engine_kwargs, eagle_kwargs, every_policy_and_native,
                                greedy_params, same_tokens, shipped_draft)

pytestmark = [pytest.mark.e2e, pytest.mark.sglang, pytest.mark.slow]


@pytest.fixture(scope="module")
def fused(host_factory, demo_target_dir):
    pytest.importorskip("triton")
    h = host_factory("fused", cpu_engine_kwargs(demo_target_dir, **eagle_kwargs(shipped_draft(), TOPK, STEPS, N)),
                     env={"TREESPEC_SELECT": "triton", "TREESPEC_POLICY_MODULES": "tests.e2e.custom_policy"})
    yield h
    h.close()


def test_every_policy_with_the_fused_selection_equals_plain_greedy(fused, prompt_ids, plain_greedy):
    ids, params, refs = every_policy_and_native(prompt_ids[:2], plain_greedy[:2])
    ids += prompt_ids[:2]  # a policy with its own Python keep: the kernel ORs it in before the padding
    params += [greedy_params({"policy": "root-children", "budget": 3})] * 2
    refs += [("root-children", ref) for ref in plain_greedy[:2]]
    outs = fused.generate(input_ids=ids, sampling_params=params)
    for o, (name, ref) in zip(outs, refs):
        assert same_tokens(o["output_ids"], ref), name
        if name is not None:
            sizes = o["meta_info"]["treespec_tree_sizes"]
            assert o["meta_info"]["treespec_policy"] == [name] and sizes, name
            assert name == "none" or max(sizes) > 1, (name, sizes)  # the kernel's trees, not the root alone
