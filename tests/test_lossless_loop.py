"""Core-level end to end: grow_tree -> verify_tree -> commit on a bigram "model" pair.

The target's next-token logits depend on the last token only (a table), so a speculative round
needs no KV cache: node i's target row is table[token_i]. Greedy speculative output must equal
plain greedy token for token for every policy; at T > 0 the first two generated tokens must
follow the target's joint law.
"""

from collections import Counter

import pytest
import torch

from tests.laws import tv_bound
from treespec_sglang.policies import grow_tree
from treespec_sglang.verify import emitted_tokens, sample, target_probs, verify_tree

SPECS = [
    {"policy": "eagle2", "budget": 12, "topk": 3, "depth": 4},
    {"policy": "talon", "budget": 12, "topk": 3, "mu": 0.05},
    {"policy": "salf", "budget": 12, "batch": 3, "th": 0.2},
    {"policy": "salf", "budget": 10, "batch": 2, "th": 0.0},
    {"policy": "c2t", "budget": 12, "topk": 4, "beta": 0.3},
    {"policy": "chain", "length": 4},
    {"policy": "chain", "length": 4, "beta": 0.5},
]


def models(V, seed=0):
    g = torch.Generator().manual_seed(seed)
    target = torch.randn(V, V, generator=g) * 3  # [vocab, vocab] next-token logits
    draft = torch.log_softmax(target + torch.randn(V, V, generator=g) * 1.5, -1)  # an imperfect draft
    return target, draft


def spec_round(specs, last, target, draft, **sampling):
    expand = lambda tree, fr: draft[torch.gather(tree.tokens, 1, fr.clamp(min=0)).clamp(min=0)]
    tree = grow_tree(specs, last, draft[last], expand)
    logits = target[tree.tokens.clamp(min=0)]  # [bs, n_nodes, vocab]
    r = verify_tree(tree, logits, **sampling)
    return emitted_tokens(tree, r), r


@pytest.mark.parametrize("V", [16, 50])
def test_greedy_speculative_equals_plain_greedy_for_every_policy(V):
    target, draft = models(V, seed=V)
    bs, steps = len(SPECS), 30
    start = torch.arange(bs) % V
    plain = [[int(s)] for s in start]
    for row in plain:
        for _ in range(steps):
            row.append(int(target[row[-1]].argmax()))
    out = [[int(s)] for s in start]
    accepted = 0
    while min(len(o) for o in out) < steps + 1:
        last = torch.tensor([o[-1] for o in out])
        em, r = spec_round(SPECS, last, target, draft)
        accepted += int(r.num_accepted.sum())
        for b, row in enumerate(em.tolist()):
            out[b] += [t for t in row if t >= 0]
    for b in range(bs):
        assert out[b][:steps + 1] == plain[b], SPECS[b]
    assert accepted > bs * 5  # drafts were really accepted along the way


@pytest.mark.parametrize("spec", SPECS)
def test_sampled_first_two_tokens_follow_the_target(spec):
    V, n = 6, 40_000
    target, draft = models(V, seed=1)
    target = target / 3  # flatter target: many outcomes
    T = 0.9
    g = torch.Generator().manual_seed(0)
    start = torch.full((n,), 2)
    em, _ = spec_round([spec] * n, start, target, draft, temperature=T, generator=g)
    first = em[:, 0]
    # rows that emitted only one token get their second from one more round
    em2, _ = spec_round([spec] * n, first, target, draft, temperature=T, generator=g)
    second = torch.where(em[:, 1] >= 0, em[:, 1], em2[:, 0])
    p = target_probs(target, T)  # [vocab, vocab]
    law = {(a, b): float(p[2, a] * p[a, b]) for a in range(V) for b in range(V)}
    c = Counter(zip(first.tolist(), second.tolist()))
    emp = {k: v / n for k, v in c.items()}
    d = 0.5 * sum(abs(emp.get(k, 0) - law[k]) for k in law)
    assert d < tv_bound(len(law), n), d


def test_plain_sampling_uses_the_same_target_distribution():
    V, n = 5, 100_000
    logits = torch.randn(1, V, generator=torch.Generator().manual_seed(3))
    x = sample(logits.expand(n, V), 0.8, 3, 0.9, generator=torch.Generator().manual_seed(0))
    p = target_probs(logits, 0.8, 3, 0.9)[0]
    emp = torch.bincount(x, minlength=V).float() / n
    assert 0.5 * (emp - p).abs().sum() < tv_bound(V, n)
    assert (emp[p == 0] == 0).all()
