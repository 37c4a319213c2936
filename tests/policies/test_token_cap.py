"""The batch's token cap: the allocation against a brute-force optimum on small trees (node values
restated from their definition, calibration weights included), its invariants, no host sync, and the token cap
choice from a cost curve against exhaustive search."""

import itertools
import math

import pytest
import torch

from tests.helpers import closed_subsets, oracle_node_values, random_batch
from treespec_sglang.policies.token_cap import allocate_batch, best_total, node_values, split_batch_option
from treespec_sglang.tree import DraftTree
from treespec_sglang.utils import count_host_syncs


def brute_force(tree, values, total, cap, floor):
    """max sum of values over per-request closed sets with floor <= |S_b| <= cap and sum |S_b| <= total."""
    bs = tree.tokens.shape[0]
    options = []
    for b in range(bs):
        size = int(tree.size[b])
        par = tree.parents[b].tolist()
        opts = []
        for s in closed_subsets(par, size):
            lo = min(int(floor[b]), size)
            if lo <= len(s) <= int(cap[b]):
                opts.append((len(s), sum(float(values[b][i]) for i in s if i != 0)))
        options.append(opts)
    best = None
    for combo in itertools.product(*options):
        if sum(c[0] for c in combo) <= max(total, bs):
            val = sum(c[1] for c in combo)
            best = val if best is None or val > best else best
    return best


def random_case(rng, seed):
    sizes = [rng.randint(1, 6) for _ in range(3)]
    tree = random_batch(rng, sizes, vocab=7, max_children=3)
    g = torch.Generator().manual_seed(seed)
    lp = torch.full(tree.tokens.shape, float("-inf"))  # random path log-probs: parent's + log U(0, 1)
    for b, size in enumerate(sizes):
        lp[b, 0] = 0.0
        for i in range(1, size):
            lp[b, i] = lp[b, int(tree.parents[b, i])] + torch.rand((), generator=g).clamp(min=1e-3).log()
    tree = type(tree)(tree.tokens, tree.parents, tree.depth, lp, tree.size, tree.depth_bound)
    cap = torch.tensor([rng.randint(1, 7) for _ in sizes])
    floor = torch.tensor([rng.randint(1, 3) for _ in sizes]).minimum(cap)
    # calibration: none, per request, or per node (per-node weights can break monotonicity: capped)
    weight = [None, torch.rand(len(sizes), generator=g) + 0.5, torch.rand(tree.tokens.shape, generator=g) + 0.5][seed % 3]
    return tree, cap, floor, weight


@pytest.mark.parametrize("seed", range(40))
def test_allocation_is_optimal_and_feasible(rng, seed):
    for _ in range(seed % 3):
        rng.random()
    tree, cap, floor, weight = random_case(rng, seed)
    bs = tree.tokens.shape[0]
    values = oracle_node_values(tree, weight)  # [bs][n_nodes] from the definition, not node_values
    forced_min = sum(min(int(f), int(s)) for f, s in zip(floor, tree.size))
    for total in range(bs, int(tree.size.sum()) + 2):
        keep = allocate_batch(tree, total, cap, floor, weight)
        sizes = keep.sum(1)
        assert keep[:, 0].all() and not (keep & (tree.depth < 0)).any()
        par = tree.parents.clamp(min=0)
        assert (~keep | (tree.parents < 0) | torch.gather(keep, 1, par)).all(), "not ancestor-closed"
        assert (sizes <= torch.maximum(cap, torch.ones_like(cap))).all()
        assert (sizes >= torch.minimum(floor, tree.size)).all()
        assert int(sizes.sum()) <= max(total, forced_min)
        got = sum(values[b][i] for b in range(bs) for i in range(tree.n_nodes)
                  if keep[b, i] and tree.parents[b, i] >= 0)
        if total >= forced_min:
            assert got == pytest.approx(brute_force(tree, values, total, cap, floor), abs=1e-5), total


def test_values_are_monotone_along_paths():
    lp = torch.log(torch.tensor([[1.0, 0.6, 0.3, 0.5]]))  # node 3 (child of 2) claims more than its parent
    t = DraftTree.from_lists([[5, 1, 2, 3]], [[-1, 0, 0, 2]])
    t = type(t)(t.tokens, t.parents, t.depth, lp, t.size, t.depth_bound)
    v = node_values(t)
    assert v[0, 0] == float("inf") and torch.allclose(v[0, 1:], torch.tensor([0.6, 0.3, 0.3]))
    keep = allocate_batch(t, 2)  # one node beyond the root: the 0.6 branch
    assert keep.tolist() == [[True, True, False, False]]


@pytest.mark.parametrize("kind", ["none", "per_request", "per_node"])
@pytest.mark.parametrize("seed", range(3))
def test_node_values_are_weighted_path_probabilities_capped_by_the_parent(rng, seed, kind):
    """node_values against a plain loop over the nodes: exp(logprob) x the calibration weight, capped by
    the parent's value (per-node weights may rise with depth: the cap binds), root +inf, padding -inf."""
    tree, _, _, _ = random_case(rng, seed)
    g = torch.Generator().manual_seed(100 + seed)
    bs, n = tree.tokens.shape
    weight = {"none": None, "per_request": torch.rand(bs, generator=g) * 3 + 0.1,  # [bs]
              "per_node": torch.rand(bs, n, generator=g) * 3 + 0.1}[kind]  # [bs, n_nodes]
    got = node_values(tree, weight).tolist()  # [bs, n_nodes]
    want = oracle_node_values(tree, weight)
    for b in range(bs):
        for i in range(n):
            if math.isinf(want[b][i]):
                assert got[b][i] == want[b][i], (b, i)
            else:
                assert got[b][i] == pytest.approx(want[b][i], rel=1e-5, abs=1e-7), (b, i)


def test_a_depth_weight_moves_the_allocation():
    """A calibration that discounts depth 2 (x0.1) and boosts depth 3 (x4, capped by its parent): with two
    nodes beyond the root, the unweighted pick is the .9 -> .85 chain, the weighted one the .9 node and the
    .5 sibling (.85 x 0.1 = .085 < .5)."""
    t = DraftTree.from_lists([[9, 1, 2, 3, 4, 5]], [[-1, 0, 1, 2, 0, 0]])
    p = torch.tensor([[1.0, 0.9, 0.85, 0.8, 0.5, 0.45]])  # path probabilities
    t = type(t)(t.tokens, t.parents, t.depth, p.log(), t.size, t.depth_bound)
    by_depth = torch.tensor([1.0, 1.0, 0.1, 4.0])
    weight = by_depth[t.depth]  # [1, n_nodes]
    assert allocate_batch(t, 3).tolist() == [[True, True, True, False, False, False]]
    assert allocate_batch(t, 3, weight=weight).tolist() == [[True, True, False, False, True, False]]
    # with room for everything but one: the boosted depth-3 node is worth no more than its parent (.085)
    assert allocate_batch(t, 5, weight=weight).tolist() == [[True, True, True, False, True, True]]
    assert node_values(t, weight)[0, 3].item() == pytest.approx(0.085)


def test_allocation_makes_no_host_sync(rng):
    tree, cap, floor, weight = random_case(rng, 1)
    total = torch.tensor(6)
    with count_host_syncs() as c:
        allocate_batch(tree, total, cap, floor, weight)
        best_total(tree, torch.linspace(1.0, 3.0, 40), cap, floor, weight)
    assert c.count == 0, c.ops


@pytest.mark.parametrize("curve", ["flat", "linear", "steep"])
def test_best_total_maximises_expected_tokens_per_second(rng, curve):
    tree, cap, floor, weight = random_case(rng, 3)
    n_max = int(tree.size.sum()) + 3
    x = torch.arange(n_max + 1, dtype=torch.float32)
    cost = {"flat": torch.full_like(x, 5.0), "linear": 5.0 + 0.5 * x, "steep": 1.0 + x ** 1.5}[curve]
    values = node_values(tree, weight)
    bs = tree.tokens.shape[0]

    def rate(total):
        keep = allocate_batch(tree, total, cap, floor, weight)
        tokens = int(keep.sum())
        exp = bs + float(torch.where(keep & (tree.parents >= 0), values, 0.0).sum())
        return exp / float(cost[tokens]), tokens

    best = max(rate(t)[0] for t in range(bs, n_max))
    got = int(best_total(tree, cost, cap, floor, weight))
    assert rate(got)[0] == pytest.approx(best, rel=1e-6)
    if curve == "flat":  # free tokens: verify everything allowed
        assert rate(got)[1] == int(allocate_batch(tree, n_max, cap, floor, weight).sum())


def test_the_request_key_removed_in_0_2_is_refused_with_the_allowed_keys():
    """``{"batch_budget": false}`` (renamed ``token_cap`` in 0.1, removed in 0.2) is an unknown parameter."""
    from treespec_sglang.policies import parse_spec

    spec, share = split_batch_option({"policy": "talon", "budget": 8, "batch_budget": False})
    assert share is True and "batch_budget" in spec
    with pytest.raises(ValueError, match=r"talon: unknown parameter\(s\) \['batch_budget'\]; allowed: \["):
        parse_spec(spec)

