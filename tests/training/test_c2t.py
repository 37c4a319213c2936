"""C2T data collection from engine runs and classifier training (on the tiny aligned engine)."""

import pytest
import torch

from tests.engines import prompts
from treespec_sglang.training.c2t import collect_c2t_samples, entropy_bucket_report, train_c2t

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
