"""Chain-mode fixtures shared by the C2T stop's tests: step logits and the plain oracle of the cut."""

import math

import torch

from tests.helpers import plain_confidence, plain_entropy
from treespec_sglang.policies.classifier import load_classifier
from treespec_sglang.policies.params import NoneParams

S, V = 6, 40
PARAMS = [{"policy": "chain", "length": 6, "beta": 0.5}, {"policy": "chain", "length": 6, "beta": 0.5},
          None, {"policy": "chain", "length": 3, "beta": 0.5}]


def step_logits(seed, bs=4):
    g = torch.Generator().manual_seed(seed)
    sharp = torch.tensor([6.0, 2.0, 0.5, 6.0])[:bs, None]  # confident rows run longer
    return [torch.randn(bs, V, generator=g) * sharp for _ in range(S - 1)]


def plain_lengths(params, logits, steps=S):
    """The oracle: each row's kept chain depth, one row and one step at a time (C2T Eq. 6-8 in plain Python), each
    row scored by its own classifier (a module in its parameters, else the shipped one)."""
    out = []
    for b, p in enumerate(params):
        if p is None or isinstance(p, NoneParams):  # native: the captured chain; none: the root alone
            out.append(steps if p is None else 0)
            continue
        clf = p.classifier if isinstance(p.classifier, torch.nn.Module) else load_classifier(None)
        length, logp = 1, 0.0
        for d, lg in enumerate(logits, start=2):
            lp = torch.log_softmax(lg[b], -1)
            logp += float(lp.max())
            score = plain_confidence(clf, math.exp(logp), plain_entropy(lp), d)
            if d > p.length or (p.beta is not None and score < p.beta):
                break
            length += 1
        out.append(length)
    return out
