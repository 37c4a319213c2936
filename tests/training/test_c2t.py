"""C2T data collection from engine runs and classifier training (on the tiny aligned engine)."""

import math
import re

import pytest
import torch

from tests.engines import prompts
from treespec_sglang.training.c2t import collect_c2t_samples, entropy_bucket_report, train_c2t
from treespec_sglang.tree import DraftTree
from treespec_sglang.verify import VerifyResult

pytest.importorskip("transformers")


def test_collect_features_and_labels(aligned_engine):  # noqa: F811
    feats, labels = collect_c2t_samples(aligned_engine, prompts(6), topk=3, depth=3, max_new_tokens=12,
                                        batch_size=3, progress=False)
    n_pool = 3 + 2 * 9
    assert feats.shape[1] == 3 and len(feats) == len(labels)
    assert len(feats) % n_pool == 0  # every node of every full tree (no rerank)
    assert ((feats[:, 0] > 0) & (feats[:, 0] <= 1)).all()  # joint probabilities
    assert set(feats[:, 2].unique().tolist()) == {1.0, 2.0, 3.0}  # depths
    assert (feats[:, 1] >= 0).all()
    rounds = len(feats) // n_pool
    assert 0 < labels.sum() <= rounds * 3  # at most depth accepted nodes per tree
    assert aligned_engine.observer is None  # detached afterwards


def test_train_and_report():
    """BCE + negative sampling recovers a feature-dependent acceptance rule (synthetic nodes)."""
    g = torch.Generator().manual_seed(0)
    n = 6000
    feats = torch.stack([torch.rand(n, generator=g), torch.rand(n, generator=g) * 5,
                         torch.randint(1, 7, (n,), generator=g).float()], -1)
    p_acc = torch.sigmoid(12 * (feats[:, 0] - 0.4) - 0.6 * (feats[:, 2] - 1))
    labels = (torch.rand(n, generator=g) < p_acc).float()
    clf, report = train_c2t(feats, labels, epochs=10, heldout=0.05)
    assert report["heldout_nodes"] == 300 and sum(r["nodes"] for r in report["buckets"]) == 300
    scores = clf(feats).detach()
    pos, neg = scores[labels > 0.5], scores[labels <= 0.5]
    auc = (pos[:, None] > neg[None, :]).float().mean()  # P(an accepted node outscores a rejected one)
    true_auc = (p_acc[labels > 0.5][:, None] > p_acc[labels <= 0.5][None, :]).float().mean()
    assert auc > true_auc - 0.03, (auc, true_auc)
    assert report["recall"] > 0.7 and report["kept_rate"] < 0.7
    for beta in (0.0, 0.3, 0.7):  # the report against its definition, recomputed here
        r = entropy_bucket_report(clf, feats, labels, beta=beta)
        keep, pos = scores >= beta, labels > 0.5
        assert r["kept_rate"] == pytest.approx(keep.float().mean().item())
        assert r["recall"] == pytest.approx((keep & pos).sum().item() / pos.sum().item())
        for b in r["buckets"]:
            lo, hi = (float(x) for x in b["entropy"].strip("[)").split(", "))
            m = (feats[:, 1] >= lo) & (feats[:, 1] < hi)
            assert b["nodes"] == int(m.sum()) and b["accepted"] == int((m & pos).sum())
            assert b["kept_rate"] == pytest.approx((keep & m).sum().item() / max(int(m.sum()), 1))
    assert entropy_bucket_report(clf, feats, labels, beta=0.7)["kept_rate"] < 1.0  # beta matters
    with pytest.raises(ValueError, match="no accepted nodes"):
        train_c2t(feats, torch.zeros_like(labels))


class RecordingEngine:
    """Stands in for the engine: records each ``generate`` call and hands its observer the given rounds."""

    def __init__(self, rounds):
        self.rounds, self.calls, self.observer = rounds, [], None

    def generate(self, prompts, **kw):
        self.calls.append((list(prompts), kw))
        for r in self.rounds:
            self.observer(*r)


def _round():
    """Two requests' full trees: request 0 accepted node 1 (path [0, 1, -1]); request 1, padded to 4 nodes,
    accepted nothing."""
    tree = DraftTree.from_lists([[10, 11, 12, 13], [20, 21]], [[-1, 0, 0, 1], [-1, 0]],
                                logprob=[[0.0, -0.5, -1.0, -1.2], [0.0, -0.1]])
    ent = torch.tensor([[9.0, 2.0, 2.5, 1.5], [9.0, 0.5, 9.0, 9.0]])  # parent entropies (root's unread)
    res = VerifyResult(torch.tensor([[0, 1, -1], [0, -1, -1]]), torch.tensor([1, 0]), torch.tensor([5, 6]))
    return tree, ent, res


def test_collect_features_labels_and_the_engine_calls(capsys):
    """Each non-root node of each tree is one sample (joint probability, parent entropy, depth), labelled 1 on
    the accepted path; padding nodes are left out. The prompts go in chunks with a seed per chunk, full EAGLE-2
    trees at topk 4 / depth 4, 64 new tokens, greedy, and a progress bar by default."""
    e = RecordingEngine([_round()])
    feats, labels = collect_c2t_samples(e, [f"p{i}" for i in range(10)])
    want = torch.tensor([[math.exp(-0.5), 2.0, 1.0], [math.exp(-1.0), 2.5, 1.0], [math.exp(-1.2), 1.5, 2.0],
                         [math.exp(-0.1), 0.5, 1.0]])
    torch.testing.assert_close(feats, torch.cat([want, want]))  # one round per generate call: 2 calls
    assert labels.tolist() == [1.0, 0.0, 0.0, 0.0] * 2
    spec = {"policy": "eagle2", "topk": 4, "depth": 4, "budget": 1 + 4 + 3 * 16}
    assert e.calls == [([f"p{i}" for i in range(8)], dict(max_new_tokens=64, policy=spec, temperature=0.0, seed=0)),
                       ([f"p{i}" for i in range(8, 10)], dict(max_new_tokens=64, policy=spec, temperature=0.0, seed=8))]
    bar = capsys.readouterr().err
    assert re.search(r"(^|\r)c2t data: ", bar) and "10/10" in bar and "prompt/s" in bar
    assert e.observer is None
    e2 = RecordingEngine([_round()])
    collect_c2t_samples(e2, list("abcde"), topk=2, depth=3, max_new_tokens=5, batch_size=2, temperature=0.7, seed=4,
                        progress=False)
    assert [(p, kw["seed"], kw["temperature"], kw["max_new_tokens"]) for p, kw in e2.calls] == [
        (["a", "b"], 4, 0.7, 5), (["c", "d"], 6, 0.7, 5), (["e"], 8, 0.7, 5)]
    assert e2.calls[0][1]["policy"] == {"policy": "eagle2", "topk": 2, "depth": 3, "budget": 1 + 2 + 2 * 4}
    assert capsys.readouterr().err == ""


def _synthetic(n=400, seed=0):
    g = torch.Generator().manual_seed(seed)
    feats = torch.stack([torch.rand(n, generator=g), torch.rand(n, generator=g) * 5,
                         torch.randint(1, 7, (n,), generator=g).float()], -1)
    return feats, (torch.rand(n, generator=g) < feats[:, 0] ** 2).float()  # about a third accepted


@pytest.mark.parametrize("neg_per_pos", [None, 0.5])
def test_training_batches_sample_negatives_per_positive(monkeypatch, neg_per_pos):
    """Each epoch trains on every positive of the training split and ``neg_per_pos`` negatives per positive
    (default 1), in batches of 32, 10 epochs, the classifier 48 wide, 5% held out; the report counts both splits."""
    feats, labels = _synthetic()
    seen = []
    real = torch.nn.functional.binary_cross_entropy
    monkeypatch.setattr(torch.nn.functional, "binary_cross_entropy",
                        lambda x, y: seen.append(y.clone()) or real(x, y))
    kw = {} if neg_per_pos is None else {"neg_per_pos": neg_per_pos}
    clf, report = train_c2t(feats, labels, **kw)
    n_te = round(400 * 0.05)
    assert (report["train_nodes"], report["heldout_nodes"], clf.hidden) == (400 - n_te, n_te, 48)
    n_pos = round(report["train_positive_rate"] * report["train_nodes"])
    assert 0 < n_pos < report["train_nodes"] and report["train_positive_rate"] == n_pos / report["train_nodes"]
    n_neg = int(n_pos * (neg_per_pos or 1.0))
    assert n_neg < report["train_nodes"] - n_pos  # fewer than all negatives: the rate decides the count
    per_epoch = n_pos + n_neg
    sizes = [len(y) for y in seen]
    epoch = [32] * (per_epoch // 32) + ([per_epoch % 32] if per_epoch % 32 else [])
    assert sizes == epoch * 10
    assert sum(int(y.sum()) for y in seen) == 10 * n_pos  # the sampled negatives are all negatives


def test_training_is_seeded_and_holds_out_at_least_one_node():
    feats, labels = _synthetic(n=10 * 20)

    def same(a, b):
        return all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))

    (a, ra), (b, rb) = (train_c2t(feats, labels, epochs=2, seed=3) for _ in range(2))
    assert ra == rb and same(a, b)
    assert not same(a, train_c2t(feats, labels, epochs=2, seed=4)[0])
    assert same(train_c2t(feats, labels, epochs=2)[0], train_c2t(feats, labels, epochs=2, seed=0)[0])  # seed 0
    _, small = train_c2t(feats[:10], torch.tensor([1.0, 0.0] * 5), epochs=1)
    assert small["heldout_nodes"] == 1 and small["train_nodes"] == 9
    _, one = train_c2t(feats[:2], torch.tensor([1.0, 1.0]), epochs=1)  # one training node, a positive
    assert (one["train_nodes"], one["train_positive_rate"]) == (1, 1.0)
    with pytest.raises(ValueError, match=r"^no accepted nodes in the C2T data: collect with a trained draft head$"):
        train_c2t(feats, torch.zeros_like(labels))
