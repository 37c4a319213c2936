"""Verification decided coin by coin: the tree walk, the chain walk and plain sampling against plain Python
loops fed the same uniforms (the generator's draws, or coins passed in), including the boundaries (a coin
exactly on a cumulative mass, a zero-mass token, a residual that vanishes) and the parameter checks.

Probabilities and coins are multiples of 1/64 where a boundary is tested, so float32 and the loops agree
exactly."""

import random

import pytest
import torch

from tests.helpers import random_tree_lists
from tests.verify.test_sampling import reference_target_probs
from treespec_sglang.tree import DraftTree
from treespec_sglang.verify import sampling as sampling_mod
from treespec_sglang.verify import chain as chain_mod
from treespec_sglang.verify import first_sibling_mask, sample, verify_chain, verify_tree, walk_tree
from treespec_sglang.verify.sampling import check_sampling, sample_probs, target_probs, top_p_renorm


def inverse_cdf(weights, u):
    """First index whose cumulative weight exceeds ``u`` times the total (the last index if none)."""
    target, acc = u * sum(weights), 0.0
    for i, w in enumerate(weights):
        acc += w
        if acc > target:
            return i
    return len(weights) - 1


def walk_oracle(tokens, parents, size, probs, coins):
    """The sampling walk of one request (``probs`` ``[n][V]`` lists, ``coins`` ``[depth + 1]``)."""
    cur, path, d = 0, [0], 0
    while d < len(coins) - 1:
        seen, acc, nxt = set(), 0.0, None
        for j in range(1, size):
            if parents[j] != cur:
                continue
            p = 0.0 if tokens[j] in seen else probs[cur][tokens[j]]
            seen.add(tokens[j])
            acc += p
            if p > 0 and coins[d] < acc:
                nxt = j
                break
        if nxt is None:
            break
        cur, d = nxt, d + 1
        path.append(cur)
    kids = {tokens[j] for j in range(1, size) if parents[j] == cur}
    resid = [0.0 if t in kids else w for t, w in enumerate(probs[cur])]
    if sum(resid) <= 0:
        resid = list(probs[cur])
    return path, inverse_cdf(resid, coins[-1])


def sixteenths(rng, V):
    """A random distribution over V tokens in multiples of 1/16 (some tokens at zero)."""
    w = [0] * V
    for _ in range(16):
        w[rng.randrange(V)] += 1
    return [x / 16 for x in w]


@pytest.mark.parametrize("seed", range(6))
def test_walk_tree_matches_the_loop_coin_by_coin(seed):
    rng = random.Random(seed)
    V, sizes = 4, [rng.randint(1, 9) for _ in range(5)]
    lists = [random_tree_lists(rng, n, vocab=V, max_children=V) for n in sizes]
    for tokens, parents in lists:  # repeated sibling tokens: only the first copy carries mass
        for j in range(2, len(tokens)):
            if rng.random() < 0.2 and parents[j] == parents[j - 1]:
                tokens[j] = tokens[j - 1]
    tree = DraftTree.from_lists([t for t, _ in lists], [p for _, p in lists])
    probs = [[sixteenths(rng, V) for _ in range(tree.n_nodes)] for _ in sizes]
    coins = [[rng.randrange(64) / 64 for _ in range(tree.depth_bound + 1)] for _ in sizes]  # ties included
    r = walk_tree(tree, torch.tensor(probs), torch.tensor(coins))
    for b, (tokens, parents) in enumerate(lists):
        path, bonus = walk_oracle(tokens, parents, len(tokens), probs[b], coins[b])
        assert r.path[b].tolist() == path + [-1] * (tree.depth_bound + 1 - len(path))
        assert int(r.num_accepted[b]) == len(path) - 1 and int(r.bonus[b]) == bonus


@pytest.mark.parametrize("T, k, p", [(1.0, -1, 1.0), (0.6, 3, 0.9)])
def test_verify_tree_walks_on_the_generator_coins(T, k, p):
    """``verify_tree`` draws ``[bs, depth_bound + 1]`` coins from the generator: the loop fed the same draws
    and the reference target distribution gives the same paths and bonus tokens."""
    rng = random.Random(3)
    V, sizes = 5, [1, 4, 7, 9, 3, 6]
    lists = [random_tree_lists(rng, n, vocab=V, max_children=V) for n in sizes]
    tree = DraftTree.from_lists([t for t, _ in lists], [q for _, q in lists])
    logits = torch.randn(len(sizes), tree.n_nodes, V, generator=torch.Generator().manual_seed(4)) * 2
    r = verify_tree(tree, logits, temperature=T, top_k=k, top_p=p, generator=torch.Generator().manual_seed(9))
    coins = torch.rand(len(sizes), tree.depth_bound + 1, generator=torch.Generator().manual_seed(9)).tolist()
    probs = reference_target_probs(logits.reshape(-1, V), T, k, p).view(len(sizes), tree.n_nodes, V).tolist()
    for b, (tokens, parents) in enumerate(lists):
        path, bonus = walk_oracle(tokens, parents, len(tokens), probs[b], coins[b])
        assert r.path[b].tolist()[:len(path)] == path and int(r.bonus[b]) == bonus


@pytest.mark.parametrize("coin, want_path", [(0.0, [0, 2]), (0.25, [0, 3]), (0.4921875, [0, 3]), (0.5, [0, -1])])
def test_a_coin_on_a_cumulative_mass_rejects_that_child(coin, want_path):
    """The root's children in index order: node 1 (token 3, p 0), node 2 (token 1, p 0.25), node 3 (token 2,
    p 0.25). Child j is accepted iff coin < p(c_1) + ... + p(c_j), strictly; a zero-mass child never is."""
    tree = DraftTree.from_lists([[0, 3, 1, 2]], [[-1, 0, 0, 0]])
    probs = torch.zeros(1, 4, 4)
    probs[0, :, 0] = 1.0
    probs[0, 0] = torch.tensor([0.5, 0.25, 0.25, 0.0])
    r = walk_tree(tree, probs, torch.tensor([[coin, 0.0]]))
    assert r.path[0].tolist() == want_path and int(r.num_accepted[0]) == int(want_path[1] > 0)


def test_a_vanished_residual_falls_back_to_the_node_distribution_per_request():
    """Request 0's children hold all of the root's (unnormalised) mass and are all rejected: its bonus is
    drawn from the root's distribution; request 1's residual is positive. Token 3 has no mass in either."""
    tree = DraftTree.from_lists([[0, 0, 1], [0, 0, 1]], [[-1, 0, 0], [-1, 0, 0]])
    probs = torch.zeros(2, 3, 4)
    probs[0, 0] = torch.tensor([0.25, 0.25, 0.0, 0.0])
    probs[1, 0] = torch.tensor([0.25, 0.25, 0.5, 0.0])
    coins = torch.tensor([[0.75, 0.5], [0.75, 0.5]])  # depth 1: one walk coin, then the bonus coin
    r = walk_tree(tree, probs, coins)
    assert r.num_accepted.tolist() == [0, 0]
    assert r.bonus.tolist() == [1, 2]  # [0.25, 0.25] at u 0.5 -> token 1; residual [0, 0, 0.5] -> token 2


@pytest.mark.parametrize("seed", range(4))
def test_first_sibling_mask_matches_a_loop(seed):
    rng = random.Random(seed)
    lists = [random_tree_lists(rng, rng.randint(1, 7), vocab=3, max_children=3) for _ in range(4)]
    for tokens, parents in lists:
        for j in range(1, len(tokens)):
            if rng.random() < 0.3:
                tokens[j] = rng.randrange(3)  # repeats among siblings
    tree = DraftTree.from_lists([t for t, _ in lists], [p for _, p in lists])
    want = []
    for tokens, parents in lists:
        row, seen = [False], set()
        for j in range(1, len(tokens)):
            row.append((parents[j], tokens[j]) not in seen)
            seen.add((parents[j], tokens[j]))
        want.append(row + [False] * (tree.n_nodes - len(row)))  # the root and padding: never
    assert first_sibling_mask(tree).tolist() == want


# ------------------------------------------------------------------ plain sampling
def test_top_p_keeps_a_token_only_while_the_mass_before_it_is_below_p():
    probs = torch.tensor([[0.5, 0.25, 0.25, 0.0], [0.25, 0.25, 0.25, 0.25], [0.125, 0.5, 0.125, 0.25]])
    got = top_p_renorm(probs, torch.tensor([[0.5], [0.5], [0.75]]))
    # row 0: the mass before token 1 is 0.5, not < 0.5; row 1: ties keep the lowest indices (stable order);
    # row 2: sorted 1 (0.5), 3 (0.25) -> 0.75 before token 0 -> dropped
    want = torch.tensor([[1.0, 0.0, 0.0, 0.0], [0.5, 0.5, 0.0, 0.0], [0.0, 2 / 3, 0.0, 1 / 3]])
    torch.testing.assert_close(got, want)
    flat = torch.full((1, 64), 1 / 64)  # 64 tied tokens (long enough for an unstable sort to reorder them)
    assert top_p_renorm(flat, torch.tensor([[0.25]])).tolist() == [[1 / 16] * 16 + [0.0] * 48]


def test_a_row_of_top_p_one_keeps_every_token_as_the_scalar_does():
    """A ``[bs]`` top_p tensor with a row at 1.0 is that row's top-p off, as a scalar 1 is: a float32 cumsum reaches
    1.0 before a long tail ends (tokens with mass were dropped, 1.4k-2k of them at a 49k vocab)."""
    x = torch.randn(3, 49152, generator=torch.Generator().manual_seed(0)) * 3
    off = target_probs(x, 1.0)
    mixed = target_probs(x, 1.0, top_p=torch.tensor([1.0, 0.9, 1.0]))
    assert torch.equal(mixed[[0, 2]], off[[0, 2]]) and (off[[0, 2]] > 0).all()
    assert torch.equal(mixed[1], target_probs(x, 1.0, top_p=0.9)[1])  # the other row's top-p unchanged


@pytest.mark.parametrize("T", [1e-39, 1e-12, 9.99e-7])
def test_a_temperature_below_the_greedy_bound_samples_greedily_as_in_sglang(T):
    """1 / T overflowed to inf and softmax to NaN, and the least likely token came out; a row of such a
    temperature beside sampled rows is greedy too, and a tree verify walks greedily."""
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(1)) * 4
    assert sample(logits, T).tolist() == logits.argmax(-1).tolist()
    rows = target_probs(logits, torch.tensor([T, 1.0, T]))
    assert torch.equal(rows[[0, 2]], torch.nn.functional.one_hot(logits[[0, 2]].argmax(-1), 50).float())
    assert torch.equal(rows[1], target_probs(logits, 1.0)[1]) and not rows.isnan().any()
    tree = DraftTree.from_lists([[1, int(logits[0].argmax())]], [[-1, 0]])
    tl = logits[:1, None].expand(1, 2, 50)
    got, want = verify_tree(tree, tl, temperature=T), verify_tree(tree, tl)
    assert torch.equal(got.path, want.path) and torch.equal(got.bonus, want.bonus) and got.num_accepted.tolist() == [1]
    near = torch.tensor([[0.0, 1e-7]])  # at the bound itself it samples: logits 0.1 apart after the division
    torch.testing.assert_close(target_probs(near, 1e-6), torch.softmax(torch.tensor([[0.0, 0.1]]), -1))


def test_sample_defaults_to_greedy_and_follows_the_generator():
    logits = torch.randn(64, 7, generator=torch.Generator().manual_seed(0))
    assert sample(logits).tolist() == logits.argmax(-1).tolist()  # default: temperature 0, no top-k / top-p
    for T, k, p in [(1.0, -1, 1.0), (0.7, 3, 1.0), (1.3, -1, 0.6)]:
        got = sample(logits, T, k, p, generator=torch.Generator().manual_seed(5))
        u = torch.rand(64, generator=torch.Generator().manual_seed(5)).tolist()
        ref = reference_target_probs(logits, T, k, p).tolist()
        assert got.tolist() == [inverse_cdf(ref[b], u[b]) for b in range(64)]


def test_sample_probs_never_draws_a_zero_probability_token():
    """Inverse CDF with ``right=True``: a coin landing exactly on a plateau of the CDF moves past the
    zero-probability tokens; a row without mass still yields a token id in range (the last)."""
    probs = torch.tensor([[0.0, 0.5, 0.0, 0.5], [0.0, 0.5, 0.0, 0.5], [0.0, 0.0, 0.0, 0.0]])
    assert sample_probs(probs, u=torch.tensor([0.0, 0.5, 0.25])).tolist() == [1, 3, 3]


@pytest.mark.parametrize("kw, msg", [
    (dict(temperature=-0.5), r"temperature must be a number in \[0.0, 10000.0\], got -0.5"),
    (dict(top_k=2.5), r"top_k must be an integer in"),
    (dict(top_p=0.0), r"top_p must be a number in \[1e-09, 1.0\], got 0.0"),
    (dict(top_p=True), r"top_p must be a number"),
])
def test_check_sampling_names_the_bad_parameter(kw, msg):
    with pytest.raises(ValueError, match=msg):
        check_sampling(**kw)


def test_check_sampling_accepts_defaults_valid_values_and_tensors():
    check_sampling()
    check_sampling(0.5, 3, 0.9)
    check_sampling(torch.tensor([-1.0]), torch.tensor([2.5]), torch.tensor([7.0]))  # tensors: checked where used
    assert sampling_mod.SAMPLING_RANGES["temperature"][:2] == (0.0, 1e4)


# ------------------------------------------------------------------ chain (Leviathan) walk
def chain_oracle(tokens, q, p, length, coins):
    """One request: accept x_i while coin_i * q_i(x_i) < p_i(x_i) (i < length); the correction is drawn from
    max(0, p_n - q_n) at the first rejection (p_n if that vanishes), the bonus from p_L otherwise."""
    n = 0
    while n < length and coins[n] * q[n][tokens[n]] < p[n][tokens[n]]:
        n += 1
    if n < length:
        resid = [max(0.0, a - b) for a, b in zip(p[n], q[n])]
        if sum(resid) <= 0:
            resid = list(p[n])
    else:
        resid = list(p[n])
    return n, inverse_cdf(resid, coins[-1])


def chain_case(seed, bs, L, V):
    g = torch.Generator().manual_seed(seed)
    q = torch.softmax(torch.randn(bs, L, V, generator=g) * 2, -1)
    x = torch.multinomial(q.reshape(-1, V), 1, generator=g).view(bs, L)
    logits = torch.randn(bs, L + 1, V, generator=g) * 2
    lengths = torch.randint(0, L + 1, (bs,), generator=g)
    return x, q, logits, lengths


@pytest.mark.parametrize("T, k, p", [(1.0, -1, 1.0), (0.8, 3, 1.0), (1.2, -1, 0.7)])
@pytest.mark.parametrize("with_lengths", [True, False])
def test_verify_chain_matches_the_loop_on_the_generator_coins(T, k, p, with_lengths):
    bs, L, V = 48, 4, 6
    x, q, logits, lengths = chain_case(7, bs, L, V)
    lengths = lengths if with_lengths else None
    r = verify_chain(x, q, logits, lengths=lengths, temperature=T, top_k=k, top_p=p,
                     generator=torch.Generator().manual_seed(11))
    coins = torch.rand(bs, L + 1, generator=torch.Generator().manual_seed(11)).tolist()
    probs = reference_target_probs(logits.reshape(-1, V), T, k, p).view(bs, L + 1, V).tolist()
    for b in range(bs):
        n, bonus = chain_oracle(x[b].tolist(), q[b].tolist(), probs[b], L if lengths is None else int(lengths[b]),
                                coins[b])
        assert int(r.num_accepted[b]) == n and int(r.bonus[b]) == bonus
        assert r.path[b].tolist() == list(range(n + 1)) + [-1] * (L - n)


def test_verify_chain_defaults_to_temperature_one():
    x, q, logits, _ = chain_case(3, 32, 3, 5)
    a = verify_chain(x, q, logits, generator=torch.Generator().manual_seed(2))
    b = verify_chain(x, q, logits, temperature=1.0, top_k=-1, top_p=1.0, generator=torch.Generator().manual_seed(2))
    assert torch.equal(a.num_accepted, b.num_accepted) and torch.equal(a.bonus, b.bonus)
    c = verify_chain(x, q, logits, temperature=2.0, generator=torch.Generator().manual_seed(2))
    assert not (torch.equal(a.num_accepted, c.num_accepted) and torch.equal(a.bonus, c.bonus))  # T matters here


def test_a_zero_coin_never_accepts_a_zero_probability_draft_token(monkeypatch):
    """coin 0: 0 * q(x) < p(x) fails exactly when p(x) = 0 (here top-k drops the drafted token)."""
    monkeypatch.setattr(chain_mod, "uniform", lambda shape, device, generator: torch.zeros(shape))
    q = torch.full((1, 1, 3), 1 / 3)
    logits = torch.tensor([[[0.0, 5.0, 1.0], [0.0, 0.0, 0.0]]])
    r = verify_chain(torch.tensor([[0]]), q, logits, top_k=2)
    assert r.num_accepted.tolist() == [0]
    r = verify_chain(torch.tensor([[2]]), q, logits, top_k=2)
    assert r.num_accepted.tolist() == [1]


def test_a_vanished_chain_residual_falls_back_to_p_per_request(monkeypatch):
    """Request 0 drafted a token neither q nor p can produce and p == q: it is rejected and max(0, p - q)
    vanishes, so the correction comes from p (never the last token, which p excludes); request 1's residual
    is positive and decides its correction."""
    monkeypatch.setattr(chain_mod, "uniform", lambda shape, device, generator: torch.full(shape, 0.5))
    q = torch.tensor([[[0.5, 0.5, 0.0, 0.0]], [[1.0, 0.0, 0.0, 0.0]]])
    inf = float("-inf")
    logits = torch.tensor([[[0.0, 0.0, inf, inf], [0.0, 0.0, 0.0, 0.0]],
                           [[inf, 0.0, 0.0, inf], [0.0, 0.0, 0.0, 0.0]]])
    r = verify_chain(torch.tensor([[2], [0]]), q, logits)
    assert r.num_accepted.tolist() == [0, 0]
    assert r.bonus.tolist() == [1, 2]  # p [0.5, 0.5, 0, 0] at u 0.5 -> 1; residual [0, .5, .5, 0] -> 2


def test_a_zero_length_chain_draws_the_bonus_from_p0():
    logits = torch.tensor([[[0.0, 9.0, 0.0]]])
    r = verify_chain(torch.zeros(1, 0, dtype=torch.long), torch.zeros(1, 0, 3), logits, temperature=0.0)
    assert r.num_accepted.tolist() == [0] and r.bonus.tolist() == [1] and r.path.tolist() == [[0]]


@pytest.mark.parametrize("probs_shape, logits_shape", [((2, 2, 5), (2, 4, 5)), ((2, 3, 5), (2, 3, 5))])
def test_verify_chain_names_the_misshaped_argument(probs_shape, logits_shape):
    msg = (r"draft_probs must be \[2, 3, vocab\] and target_logits \[2, 4, vocab\], "
           rf"got {tuple(probs_shape)} and {tuple(logits_shape)}".replace("(", r"\(").replace(")", r"\)"))
    with pytest.raises(ValueError, match=msg):
        verify_chain(torch.zeros(2, 3, dtype=torch.long), torch.zeros(probs_shape), torch.zeros(logits_shape))
