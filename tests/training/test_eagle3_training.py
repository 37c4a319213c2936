"""EAGLE-3 training and serving in the reference engine on a tiny 8-layer target: stored states are
HF's hidden states, training-time test equals the inference chain (target features first, then the
head's own), KL / LK training raises held-out acceptance, and greedy decoding stays lossless."""

import pytest
import torch

from tests.engines import POLICIES, IdsEngine, prompts
from tests.models.tiny import make_tiny_llama
from treespec_sglang.engine import KVCache, SpecEngine
from treespec_sglang.models import Eagle3DraftHead, LlamaModel
from treespec_sglang.training.data import (generate_distill_data, iter_sequences, load_shards, restate_distill_data,
                                           split_roles)
from treespec_sglang.training.trainer import TrainConfig, batch_sequences, evaluate_alpha, train_draft, ttt_forward

pytest.importorskip("transformers")

VOCAB, H, VOCAB_D = 48, 32, 32
HOT = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(5))[:VOCAB_D]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-e3")
    hf = make_tiny_llama(path, vocab=VOCAB, hidden=H, layers=8, heads=4, kv_heads=2, seed=3)
    return hf, str(path)


def fresh_engine(path, seed=1):
    target = LlamaModel.from_pretrained(path)
    head = Eagle3DraftHead.for_target(target.config, HOT, target.lm_head.weight, target.model.norm.weight, seed=seed)
    return SpecEngine(target, head, fuse=False)


@pytest.fixture(scope="module")
def data(tiny, tmp_path_factory):
    """Plain-decoded answers of 32 random prompts, then their states restated with the 3 captured layers."""
    _, path = tiny
    e = SpecEngine.from_pretrained(path, draft=None, dtype="float32")
    g = torch.Generator().manual_seed(0)
    ps = [torch.randint(0, VOCAB, (5,), generator=g).tolist() for _ in range(32)]
    d = tmp_path_factory.mktemp("d")
    generate_distill_data(IdsEngine(e), [str(i) for i in range(32)], ps, str(d / "eagle"), max_new_tokens=16,
                          batch_size=8, progress=False)
    model = LlamaModel.from_pretrained(path)
    model.aux_layers = (2, 4, 5)
    restate_distill_data(model, str(d / "eagle"), str(d / "eagle3"), batch_size=3, progress=False)
    return d


def test_restated_states_are_hfs_final_then_captured_hidden_states(tiny, data):
    hf, _ = tiny
    old, new = iter_sequences(load_shards(str(data / "eagle"))), iter_sequences(load_shards(str(data / "eagle3")))
    assert len(new) == len(old) == 32
    for (t0, h0, m0), (t1, h1, m1) in zip(old[:5], new[:5]):
        assert torch.equal(t0, t1) and torch.equal(m0, m1) and h1.shape == (len(t1), 4 * H)
        with torch.no_grad():
            ref = hf(t1[None], output_hidden_states=True).hidden_states
        want = torch.cat([ref[-1][0], ref[2][0], ref[4][0], ref[5][0]], -1)
        torch.testing.assert_close(h1.float(), want, rtol=2e-3, atol=2e-3)  # stored as float16


def test_restating_resumes_shard_by_shard(tiny, data, tmp_path):
    _, path = tiny
    model = LlamaModel.from_pretrained(path)
    model.aux_layers = (2, 4, 5)
    calls = []
    real = model.forward
    model.forward = lambda *a, **k: calls.append(1) or real(*a, **k)
    man = restate_distill_data(model, str(data / "eagle"), str(data / "eagle3"), progress=False)
    assert calls == [] and man["aux_layers"] == [2, 4, 5]  # every shard already there: no forward


def _inference_chain(head, toks, real_feats, own_steps):
    """What the engine does: one draft extend over real (token, target feature) pairs at positions 1..m,
    then ``own_steps`` single-node forwards fed the head's previous output; -> the last output."""
    m = len(toks) - own_steps
    cfg = head.config
    cache = KVCache(1, 1, cfg.num_key_value_heads, len(toks) + 1, cfg.head_dim, torch.float32, "cpu")
    pos = torch.arange(1, m + 1)[None]
    kv = len(toks) + 1
    col = torch.arange(kv)[None, None, :]
    out = head(torch.tensor([toks[:m]]), real_feats[None], pos, cache.stores(pos, kv)[0],
               (col >= 1) & (col <= pos[:, :, None]))[0, -1]
    for j in range(own_steps):
        p = torch.tensor([[m + 1 + j]])
        out = head(torch.tensor([[toks[m + j]]]), out[None, None], p, cache.stores(p, kv)[0],
                   (col >= 1) & (col <= p[:, :, None]))[0, -1]
    return out


def test_ttt_step_k_equals_the_inference_chain(tiny, data):
    e = fresh_engine(tiny[1])
    tok_, h_, m_ = iter_sequences(load_shards(str(data / "eagle3")))[0]
    seq = tok_.tolist()
    tok, hid, msk, lens = batch_sequences([(tok_, h_, torch.ones_like(m_))], 64)
    with torch.no_grad():
        steps, th = ttt_forward(e.draft, tok, hid, msk, lens, ttt_steps=3)
        torch.testing.assert_close(th[0], hid[0, 1:len(seq) - 1, :H])  # the target side: final states only
        for k in range(3):
            for t in range(k, len(seq) - 2):
                real = hid[0, :t - k + 1, H:]  # pairs 0..t-k: (aux_s, x_{s+1})
                ref = _inference_chain(e.draft, seq[1:t + 2], real, k)
                torch.testing.assert_close(e.draft.logits(steps[k][0][0, t]), e.draft.logits(ref), rtol=1e-4,
                                           atol=1e-4)


@pytest.mark.parametrize("loss", ["kl", "lk-alpha", "lk-lambda"])
def test_training_raises_heldout_acceptance(tiny, data, loss):
    e = fresh_engine(tiny[1])
    seqs = iter_sequences(load_shards(str(data / "eagle3")))
    cfg = TrainConfig(loss=loss, steps=60, lr=1e-2, batch_size=4, ttt_steps=2, eval_every=60)
    before = evaluate_alpha(e.draft, e.target.lm_head, seqs[24:], cfg, e.token_map)
    log = train_draft(e.draft, e.target.lm_head, seqs[:24], cfg, eval_seqs=seqs[24:], progress=False, d2t=e.token_map)
    after = log[-1]["alpha"]
    assert e.draft.lm_head.weight.grad is not None  # EAGLE-3's own LM head trains (the target's stays frozen)
    assert after[0] > before[0] + 0.1 and after[1] > before[1], (before, after)


def test_trained_head_decodes_losslessly_with_every_policy(tiny, data):
    e = fresh_engine(tiny[1])
    seqs = iter_sequences(load_shards(str(data / "eagle3")))
    train_draft(e.draft, e.target.lm_head, seqs, TrainConfig(steps=60, lr=1e-2, batch_size=4, ttt_steps=2,
                                                              eval_every=60), progress=False, d2t=e.token_map)
    e.draft.eval()
    ps = prompts(4, seed=3)
    ps = [[t % VOCAB for t in p] for p in ps]
    plain = e.generate(ps, max_new_tokens=12, policy=None)
    accepted = 0
    for spec in POLICIES:
        out = e.generate(ps, max_new_tokens=12, policy=spec)
        assert [r.token_ids for r in out] == [r.token_ids for r in plain], spec
        accepted += sum(sum(r.stats.accepted) for r in out)
    assert accepted > 0


def test_engine_refuses_a_head_that_does_not_fit_the_target(tiny):
    _, path = tiny
    target = LlamaModel.from_pretrained(path)
    head = Eagle3DraftHead.for_target(target.config, HOT)
    head.aux_layers = (2, 4, 8)
    with pytest.raises(ValueError, match=r"layers \(2, 4, 8\); the target has hidden 32 and 8 layers"):
        SpecEngine(target, head, fuse=False)
    head.aux_layers = (2, 4, 5)
    with pytest.raises(ValueError, match="an EAGLE-3 head carries its own draft vocabulary"):
        SpecEngine(target, head, fuse=False, token_map=HOT[:8])
    e = SpecEngine(target, head, fuse=False, token_map=HOT)  # its own map: accepted
    assert e.draft_vocab == VOCAB_D and target.aux_layers == (2, 4, 5)


def test_split_roles_hold_out_tests_and_validation_apart(tmp_path):
    import json

    ids = [f"humaneval/HumanEval/{i}" for i in range(12)] + [f"gsm8k/{i}" for i in range(6)]
    (tmp_path / "manifest.json").write_text(json.dumps({"done": ids, "shards": []}))
    roles = split_roles(str(tmp_path), 10)
    assert [i for i, r in zip(ids, roles) if r == "test"] == ["humaneval/HumanEval/0", "humaneval/HumanEval/10",
                                                             "gsm8k/0"]
    assert [i for i, r in zip(ids, roles) if r == "val"] == ["humaneval/HumanEval/5", "gsm8k/5"]
    assert roles.count("train") == 18 - 5
