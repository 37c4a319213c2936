"""C2T classifier data and training (C2T §4.1, App. C).

Data: every node of full EAGLE-2 trees (the whole pool kept: no rerank) from engine runs, with
features (joint probability, entropy of its parent's distribution over the top-1000, depth) and
label "on the accepted path". Training: BCE with negative sampling, a 0.95 / 0.05 split, Adam 1e-3,
10 epochs; the report gives recall and positive rate per entropy bucket on the held-out split
(the shape of C2T App. D's table).
"""

from __future__ import annotations

import random
from typing import Dict, List, Sequence, Tuple

import torch

from ..policies.classifier import C2TClassifier

__all__ = ["collect_c2t_samples", "train_c2t", "entropy_bucket_report", "full_eagle2_spec"]

ENTROPY_BUCKETS = (0.0, 0.5, 1.0, 2.0, 3.0, 4.0, float("inf"))


def full_eagle2_spec(topk: int, depth: int) -> dict:
    """An EAGLE-2 tree that keeps its whole pool (budget = 1 + k + (depth-1) k^2): no rerank."""
    return {"policy": "eagle2", "topk": topk, "depth": depth, "budget": 1 + topk + (depth - 1) * topk ** 2}


def collect_c2t_samples(engine, prompts: Sequence, *, topk: int = 4, depth: int = 4, max_new_tokens: int = 64,
                        batch_size: int = 8, temperature: float = 0.0, seed: int = 0,
                        progress: bool = True) -> Tuple[torch.Tensor, torch.Tensor]:
    """Run the engine with full EAGLE-2 trees and return (features [M, 3], labels [M] float)."""
    feats: List[torch.Tensor] = []
    labels: List[torch.Tensor] = []

    def observer(tree, parent_entropy, result):
        n = tree.n_nodes
        ar = torch.arange(n, device=tree.device)
        on_path = torch.zeros(tree.tokens.shape, dtype=torch.bool, device=tree.device)
        on_path.scatter_(1, result.path.clamp(min=0), result.path >= 0)
        valid = tree.valid & (ar[None, :] > 0)
        f = torch.stack([tree.logprob.exp(), parent_entropy, tree.depth.float()], dim=-1)
        feats.append(f[valid].cpu())
        labels.append(on_path[valid].float().cpu())

    spec = full_eagle2_spec(topk, depth)
    engine.observer = observer
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(prompts), unit="prompt", desc="c2t data")
    try:
        for i in range(0, len(prompts), batch_size):
            chunk = list(prompts[i:i + batch_size])
            engine.generate(chunk, max_new_tokens=max_new_tokens, policy=spec, temperature=temperature, seed=seed + i)
            if bar is not None:
                bar.update(len(chunk))
    finally:
        engine.observer = None
        if bar is not None:
            bar.close()
    return torch.cat(feats), torch.cat(labels)


def _split(n: int, seed: int, heldout: float) -> Tuple[List[int], List[int]]:
    idx = list(range(n))
    random.Random(seed).shuffle(idx)
    k = max(1, int(round(n * heldout)))
    return idx[k:], idx[:k]


def train_c2t(features: torch.Tensor, labels: torch.Tensor, *, hidden: int = 48, epochs: int = 10,
              lr: float = 1e-3, batch_size: int = 32, neg_per_pos: float = 1.0, heldout: float = 0.05,
              seed: int = 0) -> Tuple[C2TClassifier, Dict]:
    """Fit the classifier (BCE; negatives subsampled to ``neg_per_pos`` per positive each epoch)."""
    torch.manual_seed(seed)
    rng = random.Random(seed)
    tr, te = _split(len(labels), seed, heldout)
    pos = [i for i in tr if labels[i] > 0.5]
    neg = [i for i in tr if labels[i] <= 0.5]
    if not pos:
        raise ValueError("no accepted nodes in the C2T data: collect with a trained draft head")
    clf = C2TClassifier(hidden=hidden)
    opt = torch.optim.Adam(clf.parameters(), lr=lr)
    for _ in range(epochs):
        take = pos + rng.sample(neg, min(len(neg), int(len(pos) * neg_per_pos)))
        rng.shuffle(take)
        for j in range(0, len(take), batch_size):
            b = torch.tensor(take[j:j + batch_size])
            loss = torch.nn.functional.binary_cross_entropy(clf(features[b]), labels[b])
            opt.zero_grad()
            loss.backward()
            opt.step()
    clf.eval()
    report = entropy_bucket_report(clf, features[te], labels[te])
    report["train_nodes"], report["heldout_nodes"] = len(tr), len(te)
    report["train_positive_rate"] = len(pos) / max(len(tr), 1)
    return clf, report


@torch.no_grad()
def entropy_bucket_report(clf, features: torch.Tensor, labels: torch.Tensor, beta: float = 0.5,
                          buckets: Sequence[float] = ENTROPY_BUCKETS) -> Dict:
    """Recall of accepted nodes and the fraction of nodes kept (score >= beta) per entropy bucket."""
    keep = clf(features) >= beta
    rows = []
    for lo, hi in zip(buckets[:-1], buckets[1:]):
        m = (features[:, 1] >= lo) & (features[:, 1] < hi)
        pos = m & (labels > 0.5)
        rows.append({"entropy": f"[{lo}, {hi})", "nodes": int(m.sum()), "accepted": int(pos.sum()),
                     "recall": float((keep & pos).sum()) / max(int(pos.sum()), 1),
                     "kept_rate": float((keep & m).sum()) / max(int(m.sum()), 1)})
    pos = labels > 0.5
    return {"beta": beta, "buckets": rows, "recall": float((keep & pos).sum()) / max(int(pos.sum()), 1),
            "kept_rate": float(keep.float().mean()), "positive_rate": float(pos.float().mean())}
