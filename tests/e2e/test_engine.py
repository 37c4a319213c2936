"""Real SGLang 0.5.23 on the CPU: plain and EAGLE (topk 4, steps 3, N 8) engines with the demo target and
the shipped draft + token map, the plugin loaded; greedy equality, per-request policies, meta_info,
bad-parameter isolation, and the law of sampled tokens at T > 0."""

import math
from collections import Counter

import pytest
import torch

from tests.e2e.conftest import (N_NEW, cpu_engine_kwargs, eagle_kwargs, greedy_params, same_tokens, shipped_draft)

pytestmark = [pytest.mark.e2e, pytest.mark.sglang, pytest.mark.slow]

TOPK, STEPS, N = 4, 3, 8
POLICIES = {
    "eagle2": {"policy": "eagle2", "budget": N, "topk": TOPK, "depth": STEPS},
    "talon": {"policy": "talon", "budget": N, "topk": TOPK, "mu": 0.03},
    "salf": {"policy": "salf", "budget": N, "th": 0.1},  # batch unset: min(10, budget)
    "c2t": {"policy": "c2t", "budget": N, "topk": TOPK, "beta": 0.5},
    "chain": {"policy": "chain", "length": STEPS},
}


@pytest.fixture(scope="module")
def plain(host_factory, demo_target_dir):
    h = host_factory("plain", cpu_engine_kwargs(demo_target_dir))
    yield h
    h.close()


@pytest.fixture(scope="module")
def eagle(host_factory, demo_target_dir):
    h = host_factory("eagle", cpu_engine_kwargs(demo_target_dir, **eagle_kwargs(shipped_draft(), TOPK, STEPS, N)))
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


def check_meta(meta, completion_tokens):
    sizes, accepts = meta["treespec_tree_sizes"], meta["treespec_accept_lengths"]
    assert all(1 <= s <= N for s in sizes), sizes
    assert all(0 <= a <= STEPS for a in accepts), accepts
    assert len(accepts) == meta["spec_verify_ct"] and sum(accepts) == meta["spec_num_correct_drafts"]
    # the first token comes from the prefill, every round commits accepts + 1 (the last may be cut)
    produced = 1 + sum(a + 1 for a in accepts)
    assert produced - (STEPS + 1) < completion_tokens <= produced
    # SGLang's spec_accept_length counts every completion token (the prefill's too) per verify round
    assert math.isclose(completion_tokens / len(accepts), meta["spec_accept_length"], rel_tol=1e-6)
    return sizes


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
    # every prompt under every policy and natively, all in one call: 4 x 6 = 24 requests
    names = sorted(POLICIES) + [None]
    ids, params, refs = [], [], []
    for p, ref in zip(prompt_ids, plain_greedy):
        for name in names:
            ids.append(p)
            params.append(greedy_params(POLICIES[name] if name else None))
            refs.append((name, ref))
    outs = eagle.generate(input_ids=ids, sampling_params=params)
    for o, (name, ref) in zip(outs, refs):
        assert same_tokens(o["output_ids"], ref), name
        if name:
            assert o["meta_info"]["treespec_policy"] == [name]
            check_meta(o["meta_info"], o["meta_info"]["completion_tokens"])
        else:  # SGLang pads request-level keys of a shared output batch with empty lists
            assert not o["meta_info"].get("treespec_policy") and not o["meta_info"].get("treespec_tree_sizes")


# trees spanning 1..N in one batch: root only, small, mid, classifier-pruned, chain, full
RAGGED = {"root-only": {"policy": "eagle2", "budget": 1, "topk": TOPK, "depth": STEPS},
          "talon-3": {"policy": "talon", "budget": 3, "topk": TOPK, "mu": 0.03},
          "salf-5": {"policy": "salf", "budget": 5, "batch": 2, "th": 0.1},
          "c2t-8": POLICIES["c2t"], "chain-2": {"policy": "chain", "length": 2}, "full": POLICIES["eagle2"]}


def test_ragged_verify_runs_each_tree_at_its_own_size(eagle, prompt_ids, plain_greedy):
    """Ragged verify (on by default on the CPU): the target's attention processes exactly each request's tree
    size per round (counted inside the forward), output == plain greedy, and the pool stays consistent
    (SGLang's strict idle memory check would kill the engine on a leaked slot)."""
    names = sorted(RAGGED) + [None]
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
        assert verified == sizes, name  # Σ over the batch = Σ tree sizes: nothing padded to N
        if name == "root-only":
            assert set(sizes) == {1} and set(meta["treespec_accept_lengths"]) == {0}
        if name == "full":
            assert set(sizes) == {N}
    assert eagle.method("flush_cache")  # the radix cache empties: nothing still holds a verify slot


BAD = [({"policy": "nope"}, "policy must be one of"),
       ({"policy": "talon", "budget": 0}, "talon.budget must be in [1, 1024], got 0"),
       ({"policy": "salf", "budget": 8, "batch": 4, "th": float("nan")}, "salf.th"),
       ({"policy": "talon", "budget": "sixty"}, "talon.budget"),
       ("talon", "policy spec must be a dict")]


def test_bad_params_fail_alone_in_a_batch(eagle, prompt_ids, plain_greedy):
    good = POLICIES["talon"]
    params, expect = [], []
    for i, (bad, msg) in enumerate(BAD):
        params += [greedy_params(good), greedy_params(bad)]
        expect += [None, msg]
    ids = [prompt_ids[i % len(prompt_ids)] for i in range(len(params))]
    outs = eagle.generate(input_ids=ids, sampling_params=params)
    for i, (o, msg) in enumerate(zip(outs, expect)):
        fr = o["meta_info"]["finish_reason"]
        if msg is None:
            assert same_tokens(o["output_ids"], plain_greedy[i % len(prompt_ids)])
            assert fr["type"] in ("length", "stop")
        else:
            assert fr["type"] == "abort" and "custom_params['treespec']" in fr["message"], fr
            assert msg in fr["message"], fr


@pytest.mark.parametrize("bad,msg", BAD[:2])
def test_a_single_bad_request_is_refused_with_the_field_and_range(eagle, prompt_ids, bad, msg):
    res = eagle.call(input_ids=prompt_ids[0], sampling_params=greedy_params(bad))
    assert not res["ok"] and "ValueError" in res["error"] and msg in res["error"], res


# ------------------------------------------------------------------------------------------ sampling
SAMPLE_PROMPT = "Name one animal."
DRAWS = 1200
Z = 3.719  # one-sided normal quantile at 1e-4


def chi2_threshold(df: int) -> float:
    """Upper 1e-4 quantile of chi-square(df), Wilson-Hilferty approximation."""
    a = 2.0 / (9 * df)
    return df * (1 - a + Z * math.sqrt(a)) ** 3


@pytest.fixture(scope="module")
def sample_law(spec_engine):
    """Exact law of the first two tokens at T = 1 from the float32 target: ``(ids, {(t1, t2): p}, cond)``,
    ``cond[t1]`` the ``[vocab]`` float64 log-probs of the second token after each of the 24 likeliest t1."""
    ids = spec_engine.encode([SAMPLE_PROMPT])[0]
    with torch.inference_mode():
        from treespec_sglang.engine.engine import prefill

        def next_logprobs(seqs):
            cache, inp, hidden, lens = prefill(spec_engine.target, seqs, max(len(s) for s in seqs) + 1)
            last = torch.gather(hidden, 1, (lens - 1)[:, None, None].expand(len(seqs), 1, hidden.shape[-1]))[:, 0]
            return torch.log_softmax(spec_engine._logits(last).double(), -1)

        p1 = next_logprobs([ids])[0].exp()
        top1 = torch.topk(p1, 24).indices.tolist()
        lp2 = next_logprobs([ids + [t] for t in top1])
    law = {}
    for row, t1 in enumerate(top1):
        for t2 in torch.topk(lp2[row], 24).indices.tolist():
            law[(t1, t2)] = float(p1[t1] * lp2[row, t2].exp())
    cond = {t1: lp2[row] for row, t1 in enumerate(top1)}
    return ids, law, cond, {t1: float(p1[t1]) for t1 in top1}


Z2 = 3.891  # two-sided normal quantile at 1e-4


def temperature_z(samples, cond) -> float:
    """z of the second token's target log-prob, given the first: the sum over draws (first token among
    ``cond``) of ``log p(t2 | t1) - E[log p | t1]`` over its standard deviation under T = 1. A verify that
    samples at T' < 1 picks likelier tokens (z > 0), T' > 1 less likely ones (z < 0)."""
    num = var = 0.0
    for t1, t2 in samples:
        if t1 in cond:
            lp = cond[t1]
            mean = float((lp.exp() * lp).sum())
            num += float(lp[t2]) - mean
            var += float((lp.exp() * lp * lp).sum()) - mean * mean
    return num / math.sqrt(var)


def temperature_power(cond, p1, wrong_t: float, draws: int) -> float:
    """Probability that :func:`temperature_z` rejects (|z| > Z2) when the second token is drawn at
    ``wrong_t``: the expected shift of z for ``draws`` draws against its unit standard deviation."""
    covered = sum(p1.values())
    shift = var = 0.0
    for t1, lp in cond.items():
        w = p1[t1] / covered
        p, q = lp.exp(), torch.softmax(lp / wrong_t, -1)  # T = 1, T = wrong_t
        mean = float((p * lp).sum())
        shift += w * (float((q * lp).sum()) - mean)
        var += w * (float((p * lp * lp).sum()) - mean * mean)
    n = draws * covered
    z = abs(n * shift / math.sqrt(n * var))
    return 0.5 * (1 + math.erf((z - Z2) / math.sqrt(2)))


def chi2_stat(samples, law):
    """Pearson statistic over the pairs expected >= 5 times plus one bin for everything else."""
    n = len(samples)
    bins = [k for k, p in law.items() if n * p >= 5]
    counts = Counter(s if s in bins else "other" for s in samples)
    p_other = 1 - sum(law[k] for k in bins)
    stat = sum((counts.get(k, 0) - n * law[k]) ** 2 / (n * law[k]) for k in bins)
    stat += (counts.get("other", 0) - n * p_other) ** 2 / (n * p_other)
    return stat, len(bins)


def draw_pairs(host, ids, temperature, custom=None):
    sp = {"max_new_tokens": 2, "temperature": temperature, "ignore_eos": True}
    if custom:
        sp["custom_params"] = {"treespec": custom}
    outs = host.generate(input_ids=[ids] * DRAWS, sampling_params=[sp] * DRAWS)
    return [tuple(o["output_ids"][:2]) for o in outs]


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
