"""grow_tree: mixed per-request policies in one batch, robustness, and host-sync accounting."""

import pytest
import torch

from tests.helpers import PathDraft
from treespec_sglang.policies import grow_tree
from treespec_sglang.utils import count_host_syncs

MIXED = [
    {"policy": "eagle2", "budget": 16, "topk": 4, "depth": 4},
    {"policy": "talon", "budget": 24, "topk": 6, "mu": 0.05},
    {"policy": "salf", "budget": 20, "batch": 4, "th": 0.4},
    {"policy": "c2t", "budget": 18, "topk": 5, "beta": 0.4},
    {"policy": "chain", "length": 6},
    {"policy": "chain", "length": 6, "beta": 0.5},
    {"policy": "talon", "budget": 9, "topk": 2, "mu": 0.3},
]


def test_mixed_batch_equals_each_request_alone():
    draft = PathDraft(48, seed=11, sharpness=3.0)
    roots = torch.arange(len(MIXED)) + 3
    tree = grow_tree(MIXED, roots, draft.root(roots), draft.expand)
    tree.check()
    assert tree.n_nodes == 24
    for b, spec in enumerate(MIXED):
        alone = grow_tree([spec], roots[b:b + 1], draft.root(roots[b:b + 1]), draft.expand)
        s = int(alone.size[0])
        assert int(tree.size[b]) == s
        for f in ("tokens", "parents", "depth"):
            assert torch.equal(getattr(tree, f)[b, :s], getattr(alone, f)[0, :s]), (spec, f)
        torch.testing.assert_close(tree.logprob[b, :s], alone.logprob[0, :s])


def test_one_expand_per_step_for_the_whole_batch():
    draft = PathDraft(48, seed=11, sharpness=3.0)
    roots = torch.arange(len(MIXED)) + 3
    grow_tree(MIXED, roots, draft.root(roots), draft.expand)
    calls_mixed = draft.calls
    singles = []
    for b, spec in enumerate(MIXED):
        d = PathDraft(48, seed=11, sharpness=3.0)
        grow_tree([spec], roots[b:b + 1], d.root(roots[b:b + 1]), d.expand)
        singles.append(d.calls)
    assert calls_mixed == max(singles)  # lockstep: the batch costs its slowest request, not the sum


@pytest.mark.parametrize("spec", MIXED)
def test_nan_and_inf_logprobs_give_valid_trees(spec):
    V, bs = 40, 4
    g = torch.Generator().manual_seed(0)
    root_lp = torch.log_softmax(torch.randn(bs, V, generator=g) * 2, -1)
    root_lp[0] = float("nan")  # a fully broken row
    root_lp[1, :5] = float("inf")
    root_lp[2, ::3] = float("-inf")

    def expand(tree, frontier):
        out = torch.log_softmax(torch.randn(bs, frontier.shape[1], V, generator=g) * 2, -1)
        out[:, :, 7] = float("nan")
        out[1] = float("inf")
        return out

    tree = grow_tree([spec] * bs, torch.arange(bs), root_lp, expand)
    tree.check()
    assert int(tree.size[0]) == 1  # nothing finite to draft from: root only
    assert not ((tree.tokens == 7) & (tree.depth >= 2)).any()  # NaN child log-prob never chosen
    assert not ((tree.tokens[1] < 5) & (tree.depth[1] == 1)).any()  # +inf root log-probs never chosen
    assert (tree.depth[1] <= 1).all()  # row 1's children are all +inf: nothing below depth 1
    assert torch.isfinite(tree.logprob[tree.valid]).all()


def token_table_draft(V, seed=0):
    """A sync-free draft: next-token log-probs depend on the frontier node's token only."""
    g = torch.Generator().manual_seed(seed)
    table = torch.log_softmax(torch.randn(V, V, generator=g) * 3, -1)  # [vocab, vocab]

    def expand(tree, frontier):  # [bs, width] -> [bs, width, vocab]
        tok = torch.gather(tree.tokens, 1, frontier.clamp(min=0)).clamp(min=0)
        return table[tok]

    return table, expand


@pytest.mark.parametrize("spec", MIXED)
def test_policy_steps_make_no_host_sync(spec):
    V, bs = 64, 5
    table, expand = token_table_draft(V)
    roots = torch.arange(bs)
    with count_host_syncs() as c:
        tree = grow_tree([spec] * bs, roots, table[roots], expand, sync_free=True)
    assert c.count == 0, c.ops
    ref = grow_tree([spec] * bs, roots, table[roots], expand)  # early-exit mode
    assert torch.equal(ref.tokens, tree.tokens) and torch.equal(ref.parents, tree.parents)


def test_early_exit_costs_one_sync_per_step():
    V, bs = 64, 7
    table, expand = token_table_draft(V)
    roots = torch.arange(bs)
    calls = []

    def counting_expand(tree, frontier):
        calls.append(1)
        return expand(tree, frontier)

    with count_host_syncs() as c:
        grow_tree(MIXED, roots, table[roots], counting_expand, validate=False)  # the step loop alone
    # one any() per loop iteration: each expand call, plus the final check that ends the loop
    assert c.count <= len(calls) + 1, c.ops
    assert set(c.ops) <= {"aten::_local_scalar_dense", "aten::is_nonzero"}


def test_bad_inputs_are_clear_errors():
    lp = torch.log_softmax(torch.zeros(2, 10), -1)
    with pytest.raises(ValueError, match=r"request 1: talon.mu must be in \[0.0, 1.0\]"):
        grow_tree([{"policy": "talon"}, {"policy": "talon", "mu": 2.0}], torch.arange(2), lp, None)
    with pytest.raises(ValueError, match=r"root_tokens must be int64 \[2\]"):
        grow_tree([{"policy": "talon"}] * 2, torch.arange(3), lp, None)
    with pytest.raises(ValueError, match=r"expand must return \[bs, width, vocab\]"):
        grow_tree([{"policy": "chain", "length": 3}] * 2, torch.arange(2), lp, lambda t, f: torch.zeros(2, 10))


@pytest.mark.parametrize("policy", ["eagle2", "salf"])
def test_value_ties_keep_shallower_nodes(policy):
    """A certain draft (log-prob 0 for token 3, -inf elsewhere) ties every path value at 0:
    the rerank must keep the shallowest nodes so the tree stays connected."""
    V = 6
    lp = torch.full((1, V), float("-inf"))
    lp[0, 3] = 0.0
    spec = {"policy": "eagle2", "budget": 3, "topk": 2, "depth": 5} if policy == "eagle2" else \
        {"policy": "salf", "budget": 3, "batch": 2, "th": 0.0}
    tree = grow_tree([spec], torch.tensor([1]), lp, lambda t, f: lp[:, None, :].expand(1, f.shape[1], V))
    tree.check()
    assert tree.depth[0].tolist() == [0, 1, 2]
    assert tree.tokens[0].tolist() == [1, 3, 3]


def test_core_input_errors_are_clear():
    """An empty batch, logits passed as log-probs and an expand with the wrong vocab width each raise a
    ValueError that says what is wrong (they used to fail obscurely or pass silently)."""
    lp = torch.log_softmax(torch.randn(2, 50), -1)
    tok = torch.tensor([1, 2])
    good = lambda t, f: lp[:, None, :].expand(2, f.shape[1], 50)  # noqa: E731
    spec = [{"policy": "eagle2", "budget": 8}] * 2
    with pytest.raises(ValueError, match="at least one request"):
        grow_tree([], torch.zeros(0, dtype=torch.long), torch.zeros(0, 50), good)
    logits = lp + 5.0  # mass e^5 > 1: logits, not log-probs
    with pytest.raises(ValueError, match="root_logprobs row 0 is not a log-probability distribution"):
        grow_tree(spec, tok, logits, good)
    grow_tree(spec, tok, logits, good, validate=False)  # the engines' opt-out: no check, no sync
    restricted = lp.clone()
    restricted[:, 10:] = float("-inf")  # a candidate-restricted row (mass < 1) is a valid input
    grow_tree(spec, tok, restricted, lambda t, f: restricted[:, None, :].expand(2, f.shape[1], 50))
    with pytest.raises(ValueError, match=r"expand must return \[bs, width, vocab\] = \[2, \d+, 50\]"):
        grow_tree(spec, tok, lp, lambda t, f: torch.log_softmax(torch.randn(2, f.shape[1], 40), -1))


def test_input_validation_costs_exactly_one_sync():
    lp = torch.log_softmax(torch.randn(2, 30), -1)
    expand = lambda t, f: lp[:, None, :].expand(2, f.shape[1], 30)  # noqa: E731
    spec = [{"policy": "talon", "budget": 6, "topk": 3}] * 2
    counts = []
    for validate in (False, True):
        with count_host_syncs() as c:
            grow_tree(spec, torch.arange(2), lp, expand, validate=validate)
        counts.append(c.count)
    assert counts[1] == counts[0] + 1
    with count_host_syncs() as c:
        grow_tree(spec, torch.arange(2), lp, expand, sync_free=True)  # sync_free skips the check
    assert c.count == 0


# ---- draft pruning (min_logprob): the token cap's frontier threshold
@pytest.mark.parametrize("spec", MIXED)
@pytest.mark.parametrize("theta", [0.02, 0.1, 0.3])
def test_pruned_growth_never_expands_a_node_below_the_threshold(spec, theta):
    """Every node below depth 1 hangs off a parent at or above theta; the tree is valid; expand only ever
    sees live nodes at or above theta (the pruned rows are -1)."""
    draft = PathDraft(32, seed=5, sharpness=2.5)
    bs = 6
    roots = torch.arange(bs) + 1
    seen = []

    def expand(tree, frontier):
        lp = torch.gather(tree.logprob, 1, frontier.clamp(min=0))
        seen.append(((frontier >= 0) & (lp < torch.log(torch.tensor(theta)))).any())
        return draft.expand(tree, frontier)

    tree = grow_tree([spec] * bs, roots, draft.root(roots), expand,
                     min_logprob=torch.full((bs,), float(torch.log(torch.tensor(theta)))))
    tree.check()
    assert not any(bool(x) for x in seen)
    deep = tree.valid & (tree.depth >= 2)
    parent_lp = torch.gather(tree.logprob, 1, tree.parents.clamp(min=0))
    assert (parent_lp[deep] >= torch.log(torch.tensor(theta)) - 1e-6).all()


@pytest.mark.parametrize("theta", [0.05, 0.2, 0.5])
def test_pruned_eagle2_keeps_every_node_above_the_threshold(theta):
    """EAGLE-2 (monotone path values): the nodes with path probability >= theta are exactly the unpruned
    tree's, so a token cap that verifies only such nodes loses nothing to the pruning."""
    spec = {"policy": "eagle2", "budget": 40, "topk": 4, "depth": 5}
    draft = PathDraft(24, seed=9, sharpness=3.0)
    bs = 5
    roots = torch.arange(bs) + 2
    full = grow_tree([spec] * bs, roots, draft.root(roots), draft.expand)
    cut = grow_tree([spec] * bs, roots, draft.root(roots), draft.expand,
                    min_logprob=torch.full((bs,), float(torch.log(torch.tensor(theta)))))

    def paths_above(t, b):
        out = set()
        for i in range(int(t.size[b])):
            if float(t.logprob[b, i]) >= float(torch.log(torch.tensor(theta))):
                path, j = [], i
                while j >= 0:
                    path.append(int(t.tokens[b, j]))
                    j = int(t.parents[b, j])
                out.add(tuple(reversed(path)))
        return out

    for b in range(bs):
        assert paths_above(full, b) == paths_above(cut, b)
    assert int(cut.size.sum()) <= int(full.size.sum())


def test_pruning_per_request_and_the_ragged_hand_off():
    """-inf leaves a request unpruned; an expand with ragged = True gets the live count; a threshold above
    every node stops before the first expand."""
    draft = PathDraft(32, seed=3)
    spec = {"policy": "eagle2", "budget": 12, "topk": 3, "depth": 3}
    roots = torch.tensor([4, 5])
    lp = draft.root(roots)
    counts = []

    class Ragged:
        ragged = True

        def __call__(self, tree, frontier, n_live):
            counts.append((n_live, int((frontier >= 0).sum())))
            return draft.expand(tree, frontier)

    mixed = grow_tree([spec] * 2, roots, lp, Ragged(), min_logprob=torch.tensor([float("-inf"), 0.5]))
    ref = grow_tree([spec], roots[:1], lp[:1], draft.expand)
    assert torch.equal(mixed.tokens[0, :int(ref.size[0])], ref.tokens[0])  # row 0 unpruned
    assert int(mixed.size[1]) == 1 + 3  # log p <= 0 < 0.5: row 1 keeps its root's children, expands none
    assert counts and all(n == m for n, m in counts)
    draft.calls = 0
    grow_tree([spec] * 2, roots, lp, draft.expand, min_logprob=torch.tensor(0.5))
    assert draft.calls == 0
    with pytest.raises(ValueError, match="not with sync_free"):
        grow_tree([spec] * 2, roots, lp, draft.expand, min_logprob=torch.tensor(0.5), sync_free=True)
