"""Real SGLang 0.5.23 on the CPU: plain and EAGLE (topk 4, steps 3, N 8) engines with the demo target and
the shipped draft + token map, the plugin loaded; greedy equality, per-request policies, meta_info,
bad-parameter isolation, and the law of sampled tokens at T > 0."""

import pytest

from tests.e2e.conftest import (BAD, N, POLICIES, STEPS, TOPK, check_bad_items_fail_alone,
                                check_every_policy_batch, check_meta, cpu_engine_kwargs, eagle_kwargs,
                                greedy_params, same_tokens, shipped_draft)
from tests.e2e.law import DRAWS, Z2, chi2_stat, chi2_threshold, draw_pairs, temperature_power, temperature_z

pytestmark = [pytest.mark.e2e, pytest.mark.sglang, pytest.mark.slow]

@pytest.fixture(scope="module")
def plain(host_factory, demo_target_dir):
    h = host_factory("plain", cpu_engine_kwargs(demo_target_dir))
    yield h
    h.close()


@pytest.fixture(scope="module")
def eagle(host_factory, demo_target_dir):
    # tests.e2e.custom_policy registers two policies through the public API in every process of the engine;
    # every compactable verify ragged (auto on the CPU tunes: each batch size ragged or padded by measured time)
    h = host_factory("eagle", cpu_engine_kwargs(demo_target_dir, **eagle_kwargs(shipped_draft(), TOPK, STEPS, N)),
                     env={"TREESPEC_POLICY_MODULES": "tests.e2e.custom_policy", "TREESPEC_RAGGED_VERIFY": "1"})
    yield h
    h.close()


def run(host, prompt_ids, params):
    params = params if isinstance(params, list) else [params] * len(prompt_ids)
    return host.generate(input_ids=prompt_ids, sampling_params=params)


def test_plain_sglang_equals_our_plain_greedy(plain, prompt_ids, plain_greedy):
    outs = run(plain, prompt_ids, greedy_params())
    for o, ref in zip(outs, plain_greedy):
        assert same_tokens(o["output_ids"], ref), (o["output_ids"], ref)


def test_native_eagle_equals_plain_greedy(eagle, prompt_ids, plain_greedy):
    outs = run(eagle, prompt_ids, greedy_params())
    for o, ref in zip(outs, plain_greedy):
        assert same_tokens(o["output_ids"], ref)
        assert "treespec_policy" not in o["meta_info"]  # no policy: SGLang's own tree, untouched
        assert o["meta_info"]["spec_verify_ct"] >= 1


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_each_policy_alone_equals_plain_greedy(eagle, prompt_ids, plain_greedy, name):
    outs = run(eagle, prompt_ids, greedy_params(POLICIES[name]))
    for o, ref in zip(outs, plain_greedy):
        assert same_tokens(o["output_ids"], ref)
        meta = o["meta_info"]
        assert meta["treespec_policy"] == [name]
        sizes = check_meta(meta, meta["completion_tokens"])
        if name == "chain":
            assert all(s <= STEPS + 1 for s in sizes)


def test_mixed_batch_with_native_requests_equals_plain_greedy(eagle, prompt_ids, plain_greedy):
    check_every_policy_batch(eagle, prompt_ids, plain_greedy)  # all in one call: 4 x 6 = 24 requests


def test_every_policy_in_one_batch_without_native_rows_equals_plain_greedy(eagle, prompt_ids, plain_greedy):
    """No native row: every round's tree indices are the plugin's alone (on an H100 such a round once crashed
    SGLang's tree kernel on a strided index; the CPU stand-ins now check what that kernel checks)."""
    check_every_policy_batch(eagle, prompt_ids, plain_greedy, native=False)  # 4 x 5 = 20 requests


def test_a_policy_registered_through_the_public_api_is_served_or_refused_on_arrival(eagle, prompt_ids, plain_greedy):
    """``root-children`` (``tests/e2e/custom_policy.py``: one ``@register_policy`` with a custom pool rule) runs
    beside a built-in policy and a native request, equal to plain greedy with its own stats; ``engine-only``
    (registered without a pool rule) fails alone with its name, never mid-round."""
    specs = [{"policy": "root-children", "budget": 3}, POLICIES["talon"], None, {"policy": "engine-only"}]
    ids = [p for p in prompt_ids for _ in specs]
    outs = eagle.generate(input_ids=ids, sampling_params=[greedy_params(s) for _ in prompt_ids for s in specs])
    for i, o in enumerate(outs):
        spec, meta = specs[i % len(specs)], o["meta_info"]
        if spec and spec["policy"] == "engine-only":
            fr = meta["finish_reason"]
            assert fr["type"] == "abort" and "policy 'engine-only' has no SGLang pool rule" in fr["message"], fr
            continue
        assert same_tokens(o["output_ids"], plain_greedy[i // len(specs)]), spec
        if spec and spec["policy"] == "root-children":
            assert meta["treespec_policy"] == ["root-children"]
            assert all(1 <= t <= 3 for t in meta["treespec_tree_sizes"]) and max(meta["treespec_tree_sizes"]) == 3
            check_meta(meta, meta["completion_tokens"])


# trees spanning 1..N in one batch: root only, small, mid, classifier-pruned, chain, full
RAGGED = {"root-only": {"policy": "eagle2", "budget": 1, "topk": TOPK, "depth": STEPS},
          "talon-3": {"policy": "talon", "budget": 3, "topk": TOPK, "mu": 0.03},
          "salf-5": {"policy": "salf", "budget": 5, "batch": 2, "th": 0.1},
          "c2t-8": POLICIES["c2t"], "chain-2": {"policy": "chain", "length": 2}, "full": POLICIES["eagle2"]}


SMALL = ("root-only", "talon-3", "chain-2")  # trees of at most 3 nodes


@pytest.mark.parametrize("names", [sorted(RAGGED) + [None], list(SMALL)], ids=["mixed", "small"])
def test_ragged_verify_runs_the_batch_at_its_widest_tree(eagle, prompt_ids, plain_greedy, names):
    """Ragged verify (``TREESPEC_RAGGED_VERIFY=1``): a tree verify runs every request at the batch's widest tree
    (the compiled CPU extend kernel takes a tree mask only over one extend length), never fewer tokens than
    a request's own tree, and a batch of small trees far fewer than N; output == plain greedy, and the pool
    stays consistent (SGLang's strict idle memory check would kill the engine on a leaked slot)."""
    ids = [p for p in prompt_ids for _ in names]
    params = [greedy_params(RAGGED[n] if n else None) for _ in prompt_ids for n in names]
    outs = eagle.generate(input_ids=ids, sampling_params=params)
    for i, o in enumerate(outs):
        name, meta = names[i % len(names)], o["meta_info"]
        assert same_tokens(o["output_ids"], plain_greedy[i // len(names)]), name
        if name is None:
            assert not meta.get("treespec_verify_tokens")
            continue
        sizes, verified = meta["treespec_tree_sizes"], meta["treespec_verify_tokens"]
        assert len(verified) == len(sizes) and all(s <= v <= N for s, v in zip(sizes, verified)), name
        if set(names) <= set(SMALL):
            assert max(verified) <= 3, (name, verified)  # nothing padded to N
        if name == "root-only":
            assert set(sizes) == {1} and set(meta["treespec_accept_lengths"]) == {0}
        if name == "full":
            assert set(sizes) == {N}
    assert eagle.method("flush_cache")  # the radix cache empties: nothing still holds a verify slot


def test_bad_params_fail_alone_in_a_batch(eagle, prompt_ids, plain_greedy):
    check_bad_items_fail_alone(eagle, prompt_ids, plain_greedy)


@pytest.mark.parametrize("bad,msg", BAD[:2])
def test_a_single_bad_request_is_refused_with_the_field_and_range(eagle, prompt_ids, bad, msg):
    res = eagle.call(input_ids=prompt_ids[0], sampling_params=greedy_params(bad))
    assert not res["ok"] and "ValueError" in res["error"] and msg in res["error"], res


# ------------------------------------------------------------------------------------------ sampling
def test_sampled_tokens_follow_the_target_law(eagle, sample_law):
    """T = 1 with a treespec policy (talon): the joint law of the first two tokens (the second comes from
    the first verify round: the plugin's exact CPU sampling walk, which native EAGLE requests use too) matches
    the target's exact law (Pearson chi-square at level 1e-4), and the second token's log-prob given the first
    shows no temperature error (|z| < Z2, two-sided 1e-4). One engine kind only: each 1200-draw run costs
    ~1.5 min of CI on a 2-core CPU (SGLang's own plain sampler is SGLang's to test)."""
    ids, law, cond, _ = sample_law
    samples = draw_pairs(eagle, ids, 1.0, {"policy": "talon", "budget": N, "topk": TOPK, "mu": 0.03})
    stat, bins = chi2_stat(samples, law)
    assert bins >= 8, "the prompt's law is too concentrated for a meaningful test"
    assert stat < chi2_threshold(bins), (stat, chi2_threshold(bins))
    z = temperature_z(samples, cond)
    assert abs(z) < Z2, z


SAMPLED = {"temperature": 0.7, "top_k": 6}


def test_a_mixed_batch_samples_top_k_at_its_temperature_and_keeps_greedy_rows_greedy(eagle, sample_law, prompt_ids,
                                                                                      plain_greedy):
    """Greedy requests (each under a policy) in the same batches as T = 0.7, top-k 6 sampled ones (talon): the
    greedy rows equal plain greedy token for token (a mixed batch takes the sampling verify for every row), and
    the sampled pairs follow the exact top-k law at T = 0.7 (chi-square at level 1e-4, every pair in its support),
    a law the test tells apart from T = 0.85 or from top-k 8 (power >= 0.99, from the exact laws)."""
    from tests.e2e.law import chi2_power, top_k_law

    ids, _, cond, p1 = sample_law
    law = top_k_law(p1, cond, **SAMPLED)
    names = sorted(POLICIES)
    greedy = [greedy_params(POLICIES[names[i % len(names)]]) for i in range(len(prompt_ids))]
    sp = dict(SAMPLED, max_new_tokens=2, ignore_eos=True,
              custom_params={"treespec": {"policy": "talon", "budget": N, "topk": TOPK, "mu": 0.03}})
    outs = eagle.generate(input_ids=list(prompt_ids) + [ids] * DRAWS, sampling_params=greedy + [sp] * DRAWS)
    for i, o in enumerate(outs[:len(prompt_ids)]):
        assert same_tokens(o["output_ids"], plain_greedy[i]), names[i % len(names)]
    samples = [tuple(o["output_ids"][:2]) for o in outs[len(prompt_ids):]]
    assert all(s in law for s in samples), "a token outside the top-k was sampled"
    stat, bins = chi2_stat(samples, law)
    assert bins >= 8 and stat < chi2_threshold(bins), (stat, bins)
    # the controls, from the exact laws: T = 0.85 fails the chi-square test, top-k 8 the support check
    assert chi2_power(law, top_k_law(p1, cond, **dict(SAMPLED, temperature=0.85)), DRAWS, bins) >= 0.99
    wider = top_k_law(p1, cond, **dict(SAMPLED, top_k=8))
    assert (1 - sum(p for pair, p in wider.items() if pair not in law)) ** DRAWS <= 0.01


@pytest.mark.parametrize("wrong_t", [0.9, 1.1])
def test_the_law_test_has_power_against_a_temperature_off_by_ten_percent(sample_law, wrong_t):
    """From the exact law (no draws): with DRAWS samples, a second token drawn at T = 0.9 or 1.1 fails
    the z test with probability >= 0.99."""
    _, _, cond, p1 = sample_law
    assert temperature_power(cond, p1, wrong_t, DRAWS) >= 0.99


def test_the_law_test_rejects_a_slightly_wrong_sampler(plain, sample_law):
    """Control: samples at T = 0.9 (a 10% error) fail the T = 1 test."""
    ids, law, cond, _ = sample_law
    samples = draw_pairs(plain, ids, 0.9)
    stat, bins = chi2_stat(samples, law)
    z = temperature_z(samples, cond)
    assert z > Z2 or stat > chi2_threshold(bins), (z, stat, chi2_threshold(bins))
    assert z > Z2, z  # likelier tokens at T < 1
