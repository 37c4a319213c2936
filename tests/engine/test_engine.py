"""SpecEngine end to end on a tiny random Llama: greedy speculative == plain greedy, per policy
and for mixed batches; sampling matches plain sampling in distribution; errors stay per request."""

import math
from collections import Counter

import pytest
import torch

from tests.engines import POLICIES, prompts
from tests.models.tiny import make_tiny_llama
from tests.laws import tv_bound
from treespec_sglang.engine import SpecEngine

pytest.importorskip("transformers")

@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    make_tiny_llama(path, vocab=64, hidden=48, layers=2, heads=4, kv_heads=2)
    return SpecEngine.from_pretrained(str(path), draft=None, seed=0, dtype="float32")


@pytest.mark.parametrize("spec", POLICIES)
@pytest.mark.parametrize("bs", [1, 4])
def test_greedy_speculative_equals_plain(aligned_engine, spec, bs):
    ps = prompts(bs, seed=bs)
    plain = aligned_engine.generate(ps, max_new_tokens=20, policy=None)
    specd = aligned_engine.generate(ps, max_new_tokens=20, policy=spec)
    for a, b in zip(plain, specd):
        assert b.token_ids == a.token_ids
        assert len(a.token_ids) == 20
    assert sum(sum(r.stats.accepted) for r in specd) > 0  # the aligned draft really was accepted


def test_mixed_policies_batch_of_16(aligned_engine, engine):
    ps = prompts(16, seed=7)
    mix = [POLICIES[i % len(POLICIES)] for i in range(15)] + [None]
    for eng in (aligned_engine, engine):
        plain = eng.generate(ps, max_new_tokens=12, policy=None)
        specd = eng.generate(ps, max_new_tokens=12, policy=mix)
        assert [r.token_ids for r in specd] == [r.token_ids for r in plain]
        s = specd[0].stats
        assert s.rounds == len(s.accepted) + 1 and len(s.tree_sizes) == len(s.accepted)
        assert max(s.tree_sizes) > 1
        assert specd[15].stats.tree_sizes and max(specd[15].stats.tree_sizes) == 1  # None = plain rounds


def test_bad_policy_fails_only_that_request(engine):
    ps = prompts(3)
    res = engine.generate(ps, max_new_tokens=5, policy=[POLICIES[0], {"policy": "talon", "mu": 7}, POLICIES[1]])
    assert res[1].error and "talon.mu must be in [0.0, 1.0]" in res[1].error and res[1].token_ids == []
    assert res[0].error is None and len(res[0].token_ids) == 5 and len(res[2].token_ids) == 5
    with pytest.raises(ValueError, match="max_new_tokens"):
        engine.generate(ps, max_new_tokens=0)



def test_bad_prompts_fail_only_their_request(engine):
    """Out-of-vocab ids, an empty prompt and a text prompt without a tokenizer each fail alone, named."""
    ps = prompts(2)
    res = engine.generate([ps[0], [999], [], "hello", ps[1]], max_new_tokens=4, policy=POLICIES[0])
    assert "request 1: prompt 1: token ids must be non-empty and in [0, 63]" in res[1].error
    assert "request 2: prompt 2: token ids must be non-empty" in res[2].error
    assert "request 3: prompt 3 is text but this model has no tokenizer" in res[3].error
    assert all(r.token_ids == [] for r in res[1:4])
    good = engine.generate([ps[0], ps[1]], max_new_tokens=4, policy=POLICIES[0])
    assert res[0].error is None and res[4].error is None
    assert (res[0].token_ids, res[4].token_ids) == (good[0].token_ids, good[1].token_ids)
    with pytest.raises(ValueError, match="token ids must be non-empty"):
        engine.encode([[999]])  # the public encoder still raises



def test_eos_stops_each_request(aligned_engine):
    ps = prompts(3, seed=3)
    plain = aligned_engine.generate(ps, max_new_tokens=15)
    eos = plain[1].token_ids[4]  # pretend this token is EOS
    aligned_engine.eos.add(eos)
    try:
        p2 = aligned_engine.generate(ps, max_new_tokens=15)
        s2 = aligned_engine.generate(ps, max_new_tokens=15, policy=POLICIES[0])
    finally:
        aligned_engine.eos.discard(eos)
    assert [r.token_ids for r in s2] == [r.token_ids for r in p2]
    assert p2[1].token_ids[-1] == eos and len(p2[1].token_ids) <= 5


@pytest.mark.parametrize("spec", [POLICIES[0], POLICIES[2]])
def test_sampling_first_two_tokens_match_plain_sampling(aligned_engine, spec):
    """Engine-level distribution check at T = 1: joint law of the first two generated tokens."""
    n, ps = 3000, [[5, 9, 2]]
    e = aligned_engine
    runs = {}
    for name, pol in (("plain", None), ("spec", spec)):
        out = e.generate(ps * n, max_new_tokens=2, policy=pol, temperature=1.0, seed=11)
        runs[name] = Counter(tuple(r.token_ids[:2]) for r in out)
    first = {k: Counter() for k in runs}
    for k, c in runs.items():
        for (a, _), v in c.items():
            first[k][a] += v
    keys = set(first["plain"]) | set(first["spec"])
    d = 0.5 * sum(abs(first["plain"][k] - first["spec"][k]) / n for k in keys)
    # two independent empirical laws: allow the bound for each
    assert d < 2 * tv_bound(len(keys), n), d
    keys2 = set(runs["plain"]) | set(runs["spec"])
    d2 = 0.5 * sum(abs(runs["plain"][k] - runs["spec"][k]) / n for k in keys2)
    assert d2 < 2 * tv_bound(len(keys2), n), d2


@pytest.mark.parametrize("cap", [None, 6, "auto"])
def test_a_round_syncs_once_per_draft_step_plus_one(aligned_engine, monkeypatch, cap):
    """Host syncs in one speculative round: grow_tree's early-exit check per step and the single
    transfer of the round's results; nothing else (no .item()/.tolist()/bool-mask in the round)."""
    import treespec_sglang.engine.engine as E
    from treespec_sglang.utils import count_host_syncs

    counts = []
    real = E.SpecEngine._round

    def counted(self, *a, **k):
        with count_host_syncs() as c:
            out = real(self, *a, **k)
        counts.append((c.count, dict(c.ops), out))
        return out

    monkeypatch.setattr(E.SpecEngine, "_round", counted)
    aligned_engine.generate(prompts(3), max_new_tokens=10, policy=POLICIES[0],  # eagle2, depth 3
                            token_cap=cap)
    assert counts
    extra = 0 if cap is None else 1  # a token cap reads the kept sizes once (the ragged verify's shape)
    for n, ops, _ in counts:
        assert set(ops) <= {"aten::_local_scalar_dense", "aten::is_nonzero", "Tensor.tolist"}, ops
        assert ops.get("Tensor.tolist", 0) == 1 + extra
        assert n <= 1 + 3 + extra  # depth 3 -> at most 2 expand steps + the final check, plus the transfer


@pytest.mark.parametrize("policy", ["c2t", "chain"])
def test_a_bad_classifier_file_fails_only_its_request(engine, tmp_path, policy):
    """A missing file, a non-torch file and a torch file that is not a classifier: each request fails alone
    with the field named; the good requests beside it run."""
    junk = tmp_path / "junk.pt"
    junk.write_text("not a checkpoint")
    other = tmp_path / "other.pt"
    torch.save([1, 2, 3], other)
    extra = {"beta": 0.5} if policy == "chain" else {"budget": 8}
    bad = [{"policy": policy, "classifier": p, **extra} for p in ("/nonexistent/c2t.pt", str(junk), str(other))]
    ps = prompts(5)
    res = engine.generate(ps, max_new_tokens=5, policy=[POLICIES[0], *bad, POLICIES[1]])
    assert res[1].error.startswith(f"request 1: {policy}.classifier: file '/nonexistent/c2t.pt' does not exist")
    for i in (2, 3):
        assert f"request {i}: {policy}.classifier: " in res[i].error
        assert "is not a treespec C2T classifier file" in res[i].error
    assert all(r.token_ids == [] for r in res[1:4])
    assert res[0].error is None and res[4].error is None and len(res[0].token_ids) == len(res[4].token_ids) == 5


def test_a_prompt_over_the_context_fails_alone_with_the_limit(engine):
    ctx = engine.target.config.max_position_embeddings
    ps = prompts(2)
    long = [1] * (ctx - 3)
    res = engine.generate([ps[0], long, ps[1]], max_new_tokens=4, policy=POLICIES[0])
    assert res[1].error == (f"request 1: prompt 1 has {ctx - 3} tokens; with max_new_tokens 4 that is {ctx + 1} > "
                            f"the model's context {ctx} (max_position_embeddings): shorten the prompt or max_new_tokens")
    assert res[0].error is None and res[2].error is None and len(res[0].token_ids) == 4


@pytest.mark.parametrize("kw, message", [
    (dict(temperature=-0.5), "temperature must be a number in"),
    (dict(temperature=float("nan")), "temperature must be a number in"),
    (dict(top_p=0.0), "top_p must be a number in"),
    (dict(top_p=1.5), "top_p must be a number in"),
    (dict(top_k=2.5), "top_k must be an integer in"),
    (dict(top_k=True), "top_k must be an integer in"),
    (dict(max_new_tokens=True), "max_new_tokens must be an integer >= 1, got True"),
])
def test_bad_sampling_params_fail_before_any_compute(engine, monkeypatch, kw, message):
    def boom(*a, **k):
        raise AssertionError("prefill ran before the sampling parameters were checked")

    monkeypatch.setattr(engine, "_plain", boom)
    monkeypatch.setattr(engine, "_speculative", boom)
    args = dict(max_new_tokens=4, **kw) if "max_new_tokens" not in kw else kw
    with pytest.raises(ValueError, match=message):
        engine.generate(prompts(2), **args)


def test_numpy_scalars_and_nonpositive_top_k_are_accepted(engine):
    np = pytest.importorskip("numpy")
    ps = prompts(2)
    ref = engine.generate(ps, max_new_tokens=4, policy={"policy": "talon", "budget": 8})
    got = engine.generate(ps, max_new_tokens=np.int64(4), top_k=np.int32(-7),
                          policy={"policy": "talon", "budget": np.int64(8), "mu": np.float32(0.03)})
    assert [r.token_ids for r in got] == [r.token_ids for r in ref] and all(r.error is None for r in got)


def test_a_batch_that_cannot_fit_is_refused_up_front_with_an_estimate(engine, monkeypatch):
    from treespec_sglang.engine import memory

    def boom(*a, **k):
        raise AssertionError("compute started before the memory check")

    monkeypatch.setattr(memory, "available_bytes", lambda device: 10_000)
    monkeypatch.setattr(engine, "_speculative", boom)
    with pytest.raises(ValueError, match=r"this batch needs about \d+\.\d GiB \(3 requests x up to 16 tree nodes: "
                                         r".*\) but only 0\.0 GiB is available on cpu; send fewer requests"):
        engine.generate(prompts(3), max_new_tokens=4, policy={"policy": "talon", "budget": 16})
    monkeypatch.undo()
    assert all(r.error is None for r in engine.generate(prompts(3), max_new_tokens=4,
                                                         policy={"policy": "talon", "budget": 16}))


def test_memory_estimate_scales_with_the_batch():
    """64 requests x budget 1024 on the demo target's shape (SmolLM2-135M: vocab 49152) is tens of GB of
    verify logits alone: the estimate says so without allocating anything."""
    from types import SimpleNamespace

    from treespec_sglang.engine.memory import estimate_generate_bytes

    t = SimpleNamespace(num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, hidden_size=576,
                        head_dim=64, vocab_size=49152)
    d = SimpleNamespace(num_attention_heads=9, num_key_value_heads=3, hidden_size=576, head_dim=64)
    kw = dict(max_prompt=512, max_new=256, dtype=torch.bfloat16, draft_vocab=8192)
    big = estimate_generate_bytes(t, d, bs=64, max_nodes=1024, **kw)
    assert big["verify_logits"] == 2 * 64 * 1024 * 49152 * 4 and big["total"] > 25 * 2 ** 30
    half = estimate_generate_bytes(t, d, bs=32, max_nodes=1024, **kw)
    assert half["total"] * 2 == pytest.approx(big["total"], rel=1e-9)
    plain = estimate_generate_bytes(t, None, bs=64, max_nodes=1, **kw)
    assert "draft_kv" not in plain and plain["total"] < big["total"] / 10  # the KV cache remains


def test_plain_decoding_counts_its_forwards_and_samples_from_its_own_seed(engine):
    """Plain decoding: one target forward per token (the prefill's included) and, at T > 0, draws from the
    call's seeded generator only (torch's global generator moved in between changes nothing)."""
    ps = prompts(3, seed=8)
    out = engine.generate(ps, max_new_tokens=6, policy=None)
    assert all(r.stats.rounds == len(r.token_ids) for r in out)
    runs = []
    for g in (0, 123):
        torch.manual_seed(g)
        runs.append([r.token_ids for r in engine.generate(ps, max_new_tokens=6, policy=None, temperature=1.0, seed=5)])
    assert runs[0] == runs[1]
    other = [r.token_ids for r in engine.generate(ps, max_new_tokens=6, policy=None, temperature=1.0, seed=6)]
    assert other != runs[0]


@pytest.mark.parametrize("policy", [None, POLICIES[0]])
def test_progress_hears_each_round_s_new_tokens(engine, policy):
    """``progress`` is called once per round, the prefill's first tokens included, with the tokens the round
    added across the batch: the calls sum to every request's output."""
    ps = prompts(3, seed=4)
    seen = []
    res = engine.generate(ps, max_new_tokens=7, policy=policy, progress=seen.append)
    assert len(seen) == max(r.stats.rounds for r in res) and seen[0] == len(ps)
    assert all(isinstance(n, int) and n >= 1 for n in seen) and sum(seen) == sum(len(r.token_ids) for r in res)


@pytest.mark.parametrize("token_cap", [None, 5])
def test_only_an_auto_token_cap_measures_the_round_cost(engine, monkeypatch, token_cap):
    def boom(self, *a):
        raise AssertionError("a round cost was measured without token_cap='auto'")

    monkeypatch.setattr(SpecEngine, "_round_cost", boom)
    monkeypatch.setattr(SpecEngine, "measured_cost_curve", boom)
    res = engine.generate(prompts(2), max_new_tokens=4, policy=POLICIES[0], token_cap=token_cap)
    assert all(r.error is None and len(r.token_ids) == 4 for r in res)


def test_the_observer_sees_each_verified_tree_its_entropies_and_result(engine):
    """``engine.observer(tree, parent_entropy, result)`` after every verify (what C2T's data collection reads):
    the round's tree, each node's parent-distribution entropy (the root's for every depth-1 node, within
    [0, log vocab]) and the round's accepted count."""
    seen = []
    engine.observer = lambda tree, entropy, result: seen.append((tree, entropy, result))
    try:
        (r,) = engine.generate(prompts(1, seed=5), max_new_tokens=8, policy=POLICIES[1])
    finally:
        engine.observer = None
    assert len(seen) == len(r.stats.accepted) >= 2
    for (tree, entropy, result), accepted, size in zip(seen, r.stats.accepted, r.stats.tree_sizes):
        assert int(result.num_accepted[0]) == accepted and int(tree.size[0]) == size
        assert entropy.shape == tree.tokens.shape and entropy.dtype.is_floating_point
        first = entropy[0][tree.depth[0] == 1]
        assert len(first) >= 1 and bool((first == first[0]).all()) and 0 <= float(first[0]) <= math.log(64) + 1e-5
