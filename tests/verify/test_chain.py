"""Chain rejection sampling with sampled drafts (Leviathan): each emitted position follows p."""

from collections import Counter

import pytest
import torch

from tests.laws import tv_bound
from treespec_sglang.verify import emitted_tokens, target_probs, verify_chain
from treespec_sglang.tree import DraftTree

N = 200_000


def run_chain(p_logits, q, lengths=None, temperature=1.0, seed=0):
    """Draft x_i ~ q_i (context-free), verify against context-free targets p_i."""
    L, V = q.shape
    g = torch.Generator().manual_seed(seed)
    x = torch.multinomial(q, N, replacement=True, generator=g).T  # [N, L]
    r = verify_chain(x, q.expand(N, L, V), p_logits.expand(N, L + 1, V), lengths=lengths,
                     temperature=temperature, generator=g)
    chain = DraftTree.from_lists([[0] + list(range(L))], [[-1] + list(range(L))])
    big = DraftTree(torch.cat([torch.zeros(N, 1, dtype=torch.long), x], 1), chain.parents.expand(N, -1),
                    chain.depth.expand(N, -1), chain.logprob.expand(N, -1), chain.size.expand(N), L)
    return r, emitted_tokens(big, r)


@pytest.mark.parametrize("kind", ["random", "q_far_from_p", "q_equals_p", "p_one_hot"])
def test_each_emitted_position_follows_the_target(kind):
    L, V = 3, 5
    g = torch.Generator().manual_seed(7)
    p_logits = torch.randn(1, L + 1, V, generator=g) * 1.5
    if kind == "p_one_hot":
        p_logits = torch.full((1, L + 1, V), -60.0)
        p_logits[0, :, 2] = 60.0
    p = target_probs(p_logits, 1.0)[0]
    q = {"random": torch.softmax(torch.randn(L, V, generator=g) * 1.5, -1),
         "q_far_from_p": torch.softmax(-p_logits[0, :L] * 2, -1),
         "q_equals_p": p[:L].clone(),
         "p_one_hot": torch.full((L, V), 1.0 / V)}[kind]
    r, em = run_chain(p_logits, q)
    emitted = em.tolist()
    for pos in range(L + 1):
        # the token at `pos` is emitted iff the first `pos` drafts were accepted; its law is p_pos
        rows = [row[pos] for row, n in zip(emitted, r.num_accepted.tolist()) if n >= pos]
        if len(rows) < 2000:
            continue
        c = Counter(rows)
        emp = {t: c[t] / len(rows) for t in c}
        ref = {t: float(p[pos, t]) for t in range(V) if p[pos, t] > 0}
        d = 0.5 * sum(abs(emp.get(t, 0) - ref.get(t, 0)) for t in range(V))
        assert d < tv_bound(V, len(rows)), (pos, d)
    if kind == "q_equals_p":
        assert (r.num_accepted == L).all()  # p == q: every draft accepted


def test_lengths_truncate_the_chain():
    L, V = 4, 6
    p_logits = torch.zeros(1, L + 1, V)
    q = torch.full((L, V), 1.0 / V)  # == p: everything accepted up to the length
    x = torch.zeros(3, L, dtype=torch.long)
    r = verify_chain(x, q.expand(3, L, V), p_logits.expand(3, -1, -1), lengths=torch.tensor([0, 2, 4]))
    assert r.num_accepted.tolist() == [0, 2, 4]
    assert r.path.tolist() == [[0, -1, -1, -1, -1], [0, 1, 2, -1, -1], [0, 1, 2, 3, 4]]


def test_greedy_target_accepts_only_argmax():
    V = 5
    p_logits = torch.randn(2, 3, V, generator=torch.Generator().manual_seed(0))
    am = p_logits.argmax(-1)
    x = torch.stack([am[0, :2], (am[1, :2] + 1) % V])  # row 0 drafts the argmax, row 1 does not
    q = torch.full((2, 2, V), 1.0 / V)
    r = verify_chain(x, q, p_logits, temperature=0.0)
    assert r.num_accepted.tolist() == [2, 0]
    assert r.bonus.tolist() == [int(am[0, 2]), int(am[1, 0])]
