"""Several ranks in real SGLang 0.5.23 on the CPU: tensor parallelism (TP = 2: two scheduler ranks share
every verify) and data parallelism (DP = 2: two schedulers), demo target + shipped draft with its token
map (the draft head is sharded over the TP ranks by the plugin).

The TP = 2 EAGLE engine runs with a faulty rank on purpose: ``TREESPEC_TEST_PERTURB_RANK=1`` reverses
rank 1's draft scores before its selection and its parent table (as if its draft beam had gone another way),
so its own trees differ from rank 0's, and
``TREESPEC_TEST_PERTURB_VERIFY_RANK=1`` reverses its greedy verify's target argmaxes, so it would accept
other tokens; every rank must still verify rank 0's tree and accept rank 0's outcome
(``TREESPEC_RANK_DIGESTS`` logs both per round), or outputs break or the ranks hang."""

import os

import pytest

from tests.e2e.conftest import N, POLICIES, STEPS, TOPK, cpu_engine_kwargs, eagle_kwargs, greedy_params, \
    same_tokens, shipped_draft
from tests.e2e.law import DRAWS, Z2, chi2_stat, chi2_threshold, temperature_z

pytestmark = [pytest.mark.e2e, pytest.mark.sglang, pytest.mark.slow]

TOKEN_CAP = 6  # mean verified tokens per sharing request (< N: the token cap trims)
SPECS = [None, {"policy": "none"}] + [POLICIES[k] for k in sorted(POLICIES)]  # native, off, every policy


@pytest.fixture(scope="module")
def digest_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("rank-digests"))


@pytest.fixture(scope="module")
def tp2_eagle(host_factory, demo_target_dir, digest_dir):
    kw = cpu_engine_kwargs(demo_target_dir, tp_size=2, **eagle_kwargs(shipped_draft(), TOPK, STEPS, N),
                           treespec_defaults={"policy": None, "token_cap": TOKEN_CAP})
    # ragged verify tuned (each verify ragged or padded by measured time; tiny warm-up so both paths run)
    h = host_factory("tp2-eagle", kw, env={"TREESPEC_RANK_DIGESTS": digest_dir, "TREESPEC_TEST_PERTURB_RANK": "1",
                                           "TREESPEC_TEST_PERTURB_VERIFY_RANK": "1", "TREESPEC_RAGGED_VERIFY": "tuned",
                                           "TREESPEC_RAGGED_TUNING": "warmup=1,explore_every=3,agree_every=2"})
    yield h
    h.close()


@pytest.fixture(scope="module")
def tp2_reference(host_factory, demo_target_dir, prompt_ids):
    """TP = 2 plain greedy output of each prompt (same all-reduce numerics as the TP = 2 EAGLE engines);
    the engine stops at once, so it never runs beside another."""
    h = host_factory("tp2-plain", cpu_engine_kwargs(demo_target_dir, tp_size=2))
    try:
        outs = h.generate(input_ids=prompt_ids, sampling_params=[greedy_params()] * len(prompt_ids))
    finally:
        h.close()
    return [o["output_ids"] for o in outs]


def read_digests(digest_dir, what=""):
    rows = {}
    for rank in (0, 1):
        with open(os.path.join(digest_dir, f"{what}rank{rank}.txt")) as f:
            rows[rank] = [line.split() for line in f]
    return rows


# Engines of their own first: the TP = 2 EAGLE engine (module-scoped) starts after them.
def test_tp2_chain_mode_with_the_c2t_stop_equals_tp2_plain(host_factory, demo_target_dir, tp2_reference, prompt_ids):
    """Chain mode (topk 1, 4 steps) under TP = 2: C2T early stops, a shorter chain, speculation off and
    native requests in one batch; the stop's cut is rank 0's on both ranks."""
    h = host_factory("tp2-chain", cpu_engine_kwargs(demo_target_dir, tp_size=2,
                                                    **eagle_kwargs(shipped_draft(), topk=1, steps=4, n=5)))
    try:
        specs = [{"policy": "chain", "length": 4, "beta": 0.5}, {"policy": "chain", "length": 4, "beta": 0.9},
                 {"policy": "chain", "length": 2}, {"policy": "none"}, None]
        ids = [prompt_ids[i % len(prompt_ids)] for i in range(len(specs))]
        outs = h.generate(input_ids=ids, sampling_params=[greedy_params(s) for s in specs])
    finally:
        h.close()
    for i, (o, spec) in enumerate(zip(outs, specs)):
        assert same_tokens(o["output_ids"], tp2_reference[i % len(prompt_ids)]), spec
    stopped = outs[1]["meta_info"]["treespec_tree_sizes"]
    assert min(stopped) < 5 and max(outs[2]["meta_info"]["treespec_tree_sizes"]) <= 3


def test_dp2_schedulers_serve_per_request_policies(host_factory, demo_target_dir, prompt_ids, plain_greedy):
    """DP = 2: two schedulers share the requests; each serves per-request policies; output == plain greedy."""
    h = host_factory("dp2-eagle", cpu_engine_kwargs(demo_target_dir, dp_size=2,
                                                    **eagle_kwargs(shipped_draft(), TOPK, STEPS, N)))
    try:
        ids = [prompt_ids[i % len(prompt_ids)] for i in range(len(SPECS))]
        outs = h.generate(input_ids=ids, sampling_params=[greedy_params(s) for s in SPECS])
    finally:
        h.close()
    for i, (o, spec) in enumerate(zip(outs, SPECS)):
        assert same_tokens(o["output_ids"], plain_greedy[i % len(prompt_ids)]), spec
        if spec is not None:
            assert o["meta_info"]["treespec_policy"] == [spec["policy"]] and o["meta_info"]["treespec_tree_sizes"]


def test_tp2_mixed_batch_equals_tp2_plain_and_every_rank_verifies_rank0s_tree(tp2_eagle, tp2_reference, prompt_ids,
                                                                           digest_dir):
    """Every policy, native and speculation off in one batch, ragged verify (tuned) and the token cap on, a
    faulty rank 1: token for token TP = 2 plain greedy; both ranks verified the same tree every round, and ran
    the same verify path (ragged or padded) although rank 1 proposed the other one."""
    ids = [prompt_ids[i % len(prompt_ids)] for i in range(len(SPECS))]
    outs = tp2_eagle.generate(input_ids=ids, sampling_params=[greedy_params(s) for s in SPECS])
    for i, (o, spec) in enumerate(zip(outs, SPECS)):
        ref = tp2_reference[i % len(prompt_ids)]
        assert same_tokens(o["output_ids"], ref), (spec, o["output_ids"], ref)
        meta = o["meta_info"]
        if spec is None:  # SGLang pads request-level keys of a shared output batch with empty lists
            assert not meta.get("treespec_policy") and not meta.get("treespec_tree_sizes")
            continue
        sizes = meta["treespec_tree_sizes"]
        verified = meta["treespec_verify_tokens"]  # ragged: a tree verify runs the batch's widest kept tree
        assert len(verified) == len(sizes) and all(s <= v <= N for s, v in zip(sizes, verified))
        assert all(1 <= s <= N for s in sizes) and (spec["policy"] != "none" or set(sizes) == {1})
    paths = read_digests(digest_dir, "ragged-")  # (own proposal, path run) per verify
    assert len(paths[0]) == len(paths[1]) > 0
    assert [r[1] for r in paths[0]] == [r[1] for r in paths[1]] and len({r[1] for r in paths[0]}) == 2
    assert any(r0[0] != r1[0] for r0, r1 in zip(paths[0], paths[1]))  # rank 1's own proposals were overruled
    trimmed = [s for o, spec in zip(outs, SPECS) if spec and spec["policy"] != "none"
               for s in o["meta_info"]["treespec_tree_sizes"]]
    assert min(trimmed) < N  # the token cap (6 per request on average) trimmed some trees
    rows = read_digests(digest_dir)
    assert len(rows[0]) == len(rows[1]) > 0
    assert [r[1] for r in rows[0]] == [r[1] for r in rows[1]]  # the verified trees agree round by round
    assert all(own == agreed for own, agreed in rows[0])  # rank 0 verifies its own selection
    assert any(own != agreed for own, agreed in rows[1])  # rank 1's own (faulty) selection was overridden
    # rank 1's greedy verify is faulty too (its target argmaxes reversed): every rank accepts rank 0's outcome
    verify = read_digests(digest_dir, "verify-")
    assert len(verify[0]) == len(verify[1]) > 0
    assert [r[1] for r in verify[0]] == [r[1] for r in verify[1]]
    assert all(own == agreed for own, agreed in verify[0])
    assert any(own != agreed for own, agreed in verify[1])


def test_tp2_bad_value_fails_alone_on_every_rank(tp2_eagle, tp2_reference, prompt_ids):
    specs = [{"policy": "talon", "budget": 99999}, POLICIES["talon"]]
    outs = tp2_eagle.generate(input_ids=prompt_ids[:2], sampling_params=[greedy_params(s) for s in specs])
    fin = outs[0]["meta_info"]["finish_reason"]
    assert fin["type"] == "abort" and "budget" in fin["message"], fin
    assert same_tokens(outs[1]["output_ids"], tp2_reference[1])


def test_tp2_sampling_mixed_batch_finishes_and_follows_the_target_law(tp2_eagle, sample_law):
    """T = 1 under TP = 2 (faulty rank 1 included): a batch of every policy and native requests finishes
    within the timeout, and the first two tokens pass the single-rank test's chi-square and z tests."""
    ids, law, cond, _ = sample_law
    specs = [POLICIES["talon"], POLICIES["salf"], POLICIES["c2t"], None]
    sps = [{"max_new_tokens": 2, "temperature": 1.0, "ignore_eos": True,
            **({"custom_params": {"treespec": specs[i % 4]}} if specs[i % 4] else {})} for i in range(DRAWS)]
    msg = tp2_eagle.call(timeout=900, input_ids=[ids] * DRAWS, sampling_params=sps)  # TimeoutError: a hang
    assert msg["ok"], msg.get("error")
    samples = [tuple(o["output_ids"][:2]) for o in msg["result"]]
    stat, bins = chi2_stat(samples, law)
    assert bins >= 8 and stat < chi2_threshold(bins), (stat, bins)
    z = temperature_z(samples, cond)
    assert abs(z) < Z2, z
