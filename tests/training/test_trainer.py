"""TTT forward == the inference-time draft chain; training improves acceptance on a tiny model."""

import pytest
import torch

from tests.engines import alpha_before_after, chain_draft, distill_random_prompts
from tests.models.tiny import make_tiny_llama
from treespec_sglang.engine import SpecEngine
from treespec_sglang.training.data import iter_sequences, load_shards, target_hidden
from treespec_sglang.training.trainer import TrainConfig, batch_sequences, train_draft, ttt_forward

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    make_tiny_llama(path, vocab=48, hidden=32, layers=2, heads=4, kv_heads=2, seed=3)
    return SpecEngine.from_pretrained(str(path), draft=None, seed=0, dtype="float32")


def test_ttt_step_k_equals_the_inference_chain(engine):
    """Step k at position t = the draft run over committed pairs 0..t-k (real features) followed by
    k pairs fed its own features — exactly what a depth-(k+1) node sees in the engine."""
    e = engine
    seq = [3, 9, 4, 17, 22, 5, 8, 30, 2, 11]
    h = target_hidden(e.target, [seq])[0]
    tok, hid, msk, lens = batch_sequences([(torch.tensor(seq), h, torch.ones(len(seq), dtype=torch.bool))], 64)
    with torch.no_grad():
        steps, _ = ttt_forward(e.draft, tok, hid, msk, lens, ttt_steps=3)
        for k in range(3):
            for t in range(k, len(seq) - 2):
                toks = seq[1:t - k + 2]  # pairs 0..t-k: (h_s, x_{s+1})
                feats = [h[s] for s in range(t - k + 1)]
                for j in range(1, k + 1):  # own features along the chain
                    prev = chain_draft(e, toks, feats)[-1]
                    toks = toks + [seq[t - k + j + 1]]
                    feats = feats + [prev]
                ref = e.target.lm_head(chain_draft(e, toks, feats)[-1])
                torch.testing.assert_close(e.target.lm_head(steps[k][0][0, t]), ref, rtol=1e-4, atol=1e-4)
            assert steps[k][1][0, :k].sum() == 0 and steps[k][1][0, k:len(seq) - 2].all()


@pytest.mark.parametrize("loss", ["kl", "lk-alpha", "lk-lambda"])
def test_training_raises_heldout_acceptance(engine, tmp_path, loss):
    e = engine
    e.tokenizer = None
    man = distill_random_prompts(e, tmp_path / "d")
    assert man["answer_tokens"] == 24 * 16 and len(man["done"]) == 24
    again = distill_random_prompts(e, tmp_path / "d")  # resumable: nothing left to do
    assert again["shards"] == man["shards"]
    seqs = iter_sequences(load_shards(str(tmp_path / "d")))
    cfg = TrainConfig(loss=loss, steps=60, lr=3e-3, batch_size=4, ttt_steps=2, eval_every=60)
    before, after = alpha_before_after(e, seqs[:20], seqs[20:], cfg)
    assert after[0] > before[0] + 0.1 and after[1] > before[1], (before, after)


def test_heldout_split_matches_bench_every(tmp_path):
    import json

    from treespec_sglang.data.prompts import PromptSet
    from treespec_sglang.training.data import heldout_flags

    ids = [f"humaneval/HumanEval/{i}" for i in range(12)] + [f"mtbench/{81 + i}" for i in range(7)]
    (tmp_path / "manifest.json").write_text(json.dumps({"done": ids, "shards": []}))
    flags = heldout_flags(str(tmp_path), 5)
    held = [i for i, f in zip(ids, flags) if f]
    he = PromptSet("humaneval", [f"HumanEval/{i}" for i in range(12)], ["p"] * 12).every(5)
    mt = PromptSet("mtbench", [str(81 + i) for i in range(7)], ["p"] * 7).every(5)
    assert held == [f"humaneval/{x}" for x in he.ids] + [f"mtbench/{x}" for x in mt.ids]
    assert held == ["humaneval/HumanEval/0", "humaneval/HumanEval/5", "humaneval/HumanEval/10", "mtbench/81",
                    "mtbench/86"]


def test_training_with_a_token_map_raises_heldout_acceptance(engine, tmp_path):
    from treespec_sglang.training.vocab import build_token_map

    distill_random_prompts(engine, tmp_path / "d", seed=1)
    seqs = iter_sequences(load_shards(str(tmp_path / "d")))
    d2t = build_token_map(seqs[:20], 24, vocab=48)
    cfg = TrainConfig(loss="kl", steps=60, lr=1e-2, batch_size=4, ttt_steps=2, eval_every=60)
    before, after = alpha_before_after(engine, seqs[:20], seqs[20:], cfg, d2t)
    assert after[0] > before[0] + 0.1 and after[1] > before[1], (before, after)


def test_resumed_training_ends_where_an_uninterrupted_run_does(engine, tmp_path):
    """Stop after the first checkpoint (an 'interrupted' run), resume from its state file: the head,
    the log and the optimiser end bit-identical to one uninterrupted run of the same config."""
    from treespec_sglang.models import EagleDraftHead

    e = engine
    e.tokenizer = None
    distill_random_prompts(e, tmp_path / "d")
    seqs = iter_sequences(load_shards(str(tmp_path / "d")))
    cfg = TrainConfig(loss="kl", steps=12, lr=3e-3, batch_size=4, ttt_steps=2, eval_every=4)

    def fresh():
        return EagleDraftHead.for_target(e.target.config, seed=7).attach(e.target.model.embed_tokens)

    full = fresh()
    log_full = train_draft(full, e.target.lm_head, seqs[:20], cfg, eval_seqs=seqs[20:], progress=False)
    state = str(tmp_path / "state.pt")
    part = fresh()

    class Interrupt(Exception):
        pass

    calls = []  # the state is written after on_eval: raising in the 2nd eval leaves step 4's state

    def on_eval(head):
        calls.append(1)
        if len(calls) == 2:
            raise Interrupt
    with pytest.raises(Interrupt):
        train_draft(part, e.target.lm_head, seqs[:20], cfg, eval_seqs=seqs[20:], progress=False, state_path=state,
                    on_eval=on_eval)
    assert torch.load(state, weights_only=False)["step"] == 4
    resumed = fresh()  # a new process: nothing but the state file carries over
    log_res = train_draft(resumed, e.target.lm_head, seqs[:20], cfg, eval_seqs=seqs[20:], progress=False,
                          state_path=state)
    for (k, a), (_, b) in zip(full.state_dict().items(), resumed.state_dict().items()):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=k)
    assert [x["step"] for x in log_res] == [4, 8, 12] and log_res[-1]["alpha"] == log_full[-1]["alpha"]
    with pytest.raises(ValueError, match="another config"):
        train_draft(fresh(), e.target.lm_head, seqs[:20], TrainConfig(loss="kl", steps=13, eval_every=4),
                    progress=False, state_path=state)


def test_shared_target_head_loss_equals_per_step_loss(engine, tmp_path):
    """_loss runs the target head once for all TTT steps; it equals the per-step computation."""
    from treespec_sglang.training.losses import multi_step_loss
    from treespec_sglang.training.trainer import LOSSES, _loss, step_logits

    e = engine
    e.tokenizer = None
    distill_random_prompts(e, tmp_path / "d")
    seqs = iter_sequences(load_shards(str(tmp_path / "d")))[:4]
    cfg = TrainConfig(loss="kl", ttt_steps=3)
    head = type(e.draft).for_target(e.target.config, seed=2).attach(e.target.model.embed_tokens)
    with torch.no_grad():
        steps, th = ttt_forward(head, *batch_sequences(seqs, cfg.max_len), cfg.ttt_steps)
        per_step = [LOSSES["kl"](*step_logits(e.target.lm_head, f, th, v)[::-1], None, cfg, None) for f, v in steps]
        torch.testing.assert_close(_loss(cfg, e.target.lm_head, steps, th), multi_step_loss(per_step, cfg.gamma))


@pytest.mark.gpu
@pytest.mark.parametrize("loss", ["kl", "lk-alpha"])
def test_training_on_cuda_follows_the_cpu_run(engine, tmp_path, loss):
    """The same seeded head trained on the same batches on a GPU ends where the CPU run ends: batches
    are built on the host and moved to the head's device, nothing else changes."""
    import copy

    e = engine
    e.tokenizer = None
    distill_random_prompts(e, tmp_path / "d")
    seqs = iter_sequences(load_shards(str(tmp_path / "d")))
    cfg = TrainConfig(loss=loss, steps=20, lr=3e-3, batch_size=4, ttt_steps=2, eval_every=10)
    runs = {}
    for dev in ("cpu", "cuda"):
        lm_head = copy.deepcopy(e.target.lm_head).to(dev)
        embed = copy.deepcopy(e.target.model.embed_tokens).to(dev)  # shared, not the head's own module
        head = type(e.draft).for_target(e.target.config, seed=1).to(dev).attach(embed)
        log = train_draft(head, lm_head, seqs[:20], cfg, eval_seqs=seqs[20:], progress=False)
        runs[dev] = (log, {k: v.detach().cpu() for k, v in head.state_dict().items()})
    (log_c, w_c), (log_g, w_g) = runs["cpu"], runs["cuda"]
    assert [x["step"] for x in log_c] == [x["step"] for x in log_g] == [10, 20]
    for a, b in zip(log_c, log_g):
        assert abs(a["loss"] - b["loss"]) < 1e-3 * max(1.0, abs(a["loss"])), (a, b)
        assert max(abs(x - y) for x, y in zip(a["alpha"], b["alpha"])) < 1e-3
    for k in w_c:
        torch.testing.assert_close(w_g[k], w_c[k], rtol=1e-3, atol=1e-4)
