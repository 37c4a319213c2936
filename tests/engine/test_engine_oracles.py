"""The reference engine against oracles that share none of its code: plain and speculative greedy against
transformers' own model run token by token without a cache (a two-layer target, so a prefill that lets a prompt
token see a later one changes the second layer's KV), the tree attention oracle against a per-head loop, and
seeded sampling that no other use of torch's global generator can move, through the padded verify and the token
cap's ragged one alike."""

import math

import pytest
import torch

from tests.engines import POLICIES, prompts
from tests.models.tiny import make_tiny_llama
from treespec_sglang.attention.reference import tree_attention
from treespec_sglang.engine import SpecEngine


@pytest.fixture(scope="module")
def two_layer(tmp_path_factory):
    """(engine, transformers' model of the same weights): 2 layers, GQA 4 / 2 heads."""
    pytest.importorskip("transformers")
    path = tmp_path_factory.mktemp("tiny-2l")
    hf = make_tiny_llama(path, vocab=64, hidden=48, layers=2, heads=4, kv_heads=2, seed=3)
    return SpecEngine.from_pretrained(str(path), draft=None, seed=0, dtype="float32"), hf


def hf_greedy(hf, ids, new):
    """Greedy continuation by transformers over the whole sequence each step (no KV cache)."""
    seq = list(ids)
    with torch.no_grad():
        for _ in range(new):
            logits = hf(torch.tensor([seq]), use_cache=False).logits[0, -1]
            seq.append(int(logits.argmax()))
    return seq[len(ids):]


@pytest.mark.parametrize("spec", [None, POLICIES[0], POLICIES[2], POLICIES[4]],
                         ids=["plain", "eagle2", "salf", "chain"])
def test_greedy_equals_transformers_run_without_a_cache(two_layer, spec):
    engine, hf = two_layer
    ps = [p for p in prompts(6, seed=11) if len(p) > 1][:3]  # prompts of different lengths: padded prefill rows
    assert len({len(p) for p in ps}) > 1
    got = engine.generate(ps, max_new_tokens=10, policy=spec)
    assert [r.token_ids for r in got] == [hf_greedy(hf, p, 10) for p in ps]


def loop_attention(q, k, v, mask, scale):
    """``[bs, heads, n_q, d]`` by a loop over requests, heads and queries (query head h reads kv head h // g)."""
    bs, heads, nq, d = q.shape
    g = heads // k.shape[1]
    out = torch.zeros(bs, heads, nq, d)
    for b in range(bs):
        for h in range(heads):
            for i in range(nq):
                cols = [j for j in range(k.shape[2]) if mask[b, i, j]]
                s = torch.stack([(q[b, h, i] * k[b, h // g, j]).sum() * scale for j in cols])
                w = torch.exp(s - s.max())
                out[b, h, i] = sum(wj * v[b, h // g, j] for wj, j in zip(w / w.sum(), cols))
    return out


@pytest.mark.parametrize("scale", [None, 0.3])
@pytest.mark.parametrize("kv_heads", [1, 2, 4])
def test_tree_attention_equals_a_loop_over_heads_and_queries(scale, kv_heads):
    gen = torch.Generator().manual_seed(kv_heads)
    bs, heads, nq, nkv, d = 2, 4, 3, 5, 8
    q, k, v = (torch.randn(bs, h, n, d, generator=gen) for h, n in ((heads, nq), (kv_heads, nkv), (kv_heads, nkv)))
    mask = torch.rand(bs, nq, nkv, generator=gen) < 0.6
    mask[:, :, 0] = True  # every query sees something
    want = loop_attention(q, k, v, mask, 1 / math.sqrt(d) if scale is None else scale)
    torch.testing.assert_close(tree_attention(q, k, v, mask, scale), want)


@pytest.mark.parametrize("token_cap", [None, 1000], ids=["padded verify", "ragged verify (token cap)"])
def test_seeded_sampling_is_untouched_by_the_global_generator(aligned_engine, token_cap):
    ps = prompts(3, seed=5)
    kw = dict(max_new_tokens=12, policy=POLICIES[0], temperature=1.0, seed=7, token_cap=token_cap)
    torch.manual_seed(0)
    first = [r.token_ids for r in aligned_engine.generate(ps, **kw)]
    torch.manual_seed(1)
    assert [r.token_ids for r in aligned_engine.generate(ps, **kw)] == first


def test_a_token_cap_that_keeps_every_node_samples_as_the_padded_verify(aligned_engine):
    """The ragged verify (a token cap) runs the target on the kept rows only: with every node kept it draws the
    same tokens from the same seed as the padded verify of the whole trees."""
    ps = prompts(3, seed=6)
    kw = dict(max_new_tokens=12, policy=POLICIES[0], temperature=1.0, seed=3)
    padded = [r.token_ids for r in aligned_engine.generate(ps, **kw)]
    ragged = aligned_engine.generate(ps, token_cap=1000, **kw)
    assert [r.token_ids for r in ragged] == padded
    assert sum(sum(r.stats.accepted) for r in ragged) > 0


def test_real_tokens_reach_the_target_and_the_draft_as_they_are(tmp_path, monkeypatch):
    """A tree's padding (-1) goes into the target's verify forward as some id, and an emitted row's padding into
    the draft extend; every real token, id 0 included, goes in as it is (a clamp to 1 would turn token 0 into 1).
    Token 0 is made the target's favourite: its head row is the most emitted token's, a little longer."""
    import collections

    import treespec_sglang.engine.engine as EN
    from tests.engines import make_aligned_engine

    engine = make_aligned_engine(tmp_path)
    ps = prompts(8, seed=21)
    counts = collections.Counter(t for r in engine.generate(ps, max_new_tokens=24, policy=None) for t in r.token_ids)
    with torch.no_grad():
        w = engine.target.lm_head.weight
        w[0] = 1.05 * w[counts.most_common(1)[0][0]]

    fed = []  # (the call, its real tokens, what the model was fed)

    def capturing(name, model, call, tokens):
        seen = []
        handle = model.register_forward_pre_hook(lambda mod, args: seen.append(args[0].clone()))
        try:
            out = call()
        finally:
            handle.remove()
        (into,) = seen  # one forward a call
        fed.append((name, tokens(out), into))
        return out

    real_verify, real_commit = EN.verify, EN.commit
    monkeypatch.setattr(EN, "verify", lambda m, b, tree, rows, opts: capturing(
        "verify", m.target, lambda: real_verify(m, b, tree, rows, opts), lambda out: tree.tokens))
    monkeypatch.setattr(EN, "commit", lambda m, b, tree, result, hidden: capturing(
        "commit", m.draft, lambda: real_commit(m, b, tree, result, hidden), lambda em: em))  # em: the emitted rows
    engine.generate(ps, max_new_tokens=24, policy=POLICIES[0])
    assert {name for name, _, _ in fed} == {"verify", "commit"}
    for _, tokens, into in fed:
        real = tokens >= 0
        assert torch.equal(into[real], tokens[real]) and bool((into >= 0).all())
    zeros = sum(int((tokens == 0).sum()) for _, tokens, _ in fed)
    assert zeros > 0, "no token 0 drafted or emitted: the check is empty"
