"""The pool's selection at its edges, each against plain loops or the plain-Python policy oracles: the
filler unlink entry by entry, SALF's pop bound, degenerate beams, exact ties and gate thresholds, two
classifiers in one batch, and PoolView's attributes (the request rows: ``test_rows.py``)."""

import math
import random

import pytest
import torch

from tests.helpers import random_batch
from tests.plugin.pools import MIXED_SPECS, OTHER_CLF, chain_oracle, expected_paths, kept_paths, pool, unlink_oracle
from tests.policies import oracles
from treespec_sglang.plugin.pool import policy_rows, select_from_pool, unlink_filler
from treespec_sglang.policies import parse_spec
from treespec_sglang.policies.classifier import C2TClassifier
from treespec_sglang.tree import sglang_retrive


@pytest.mark.parametrize("seed", range(4))
def test_unlink_filler_equals_its_oracle_entry_by_entry(seed):
    """Every entry of both chains, fillers and chain ends included (exactly -1), against plain loops."""
    rng = random.Random(100 + seed)
    t = random_batch(rng, [12, 2, 17, 6], vocab=40, max_children=3)
    keep = torch.zeros(t.tokens.shape, dtype=torch.bool)
    for b in range(t.bs):
        keep[b, 0] = True
        for i in range(1, int(t.size[b])):
            keep[b, i] = bool(keep[b, t.parents[b, i]]) and rng.random() < 0.6
    r = sglang_retrive(t)
    nt, ns = unlink_filler(r.retrive_next_token, r.retrive_next_sibling, keep)
    want_t, want_s = unlink_oracle(r.retrive_next_token, r.retrive_next_sibling, keep)
    assert nt.tolist() == want_t and ns.tolist() == want_s
    assert (~keep).any() and (nt == -1).any() and (ns == -1).any()  # fillers and chain ends are both checked


def test_unlink_filler_on_root_only_and_two_node_trees():
    """N = 1 (the root alone) and N = 2: nothing to link but the root's one child."""
    one = torch.full((2, 1), -1, dtype=torch.long)
    nt, ns = unlink_filler(one, one, torch.ones(2, 1, dtype=torch.bool))
    assert nt.tolist() == [[-1], [-1]] and ns.tolist() == [[-1], [-1]]
    nt, ns = unlink_filler(torch.tensor([[1, -1], [1, -1]]), torch.tensor([[-1, -1], [-1, -1]]),
                           torch.tensor([[True, True], [True, False]]))
    assert nt.tolist() == [[1, -1], [-1, -1]] and ns.tolist() == [[-1, -1], [-1, -1]]


@pytest.mark.parametrize("th,n_max,S,want", [
    (0.6, 8, 6, 11),     # S / th = 10 pops continue, then one stops; 2N + 2 = 18 does not bind
    (0.05, 48, 6, 98),   # 6 / 0.05 + 1 = 121 > 2N + 2 = 98
    (0.05, 10, 2, 22),   # 41 > 22
    (0.5, 3, 2, 5),      # 2 / 0.5 + 1 = 5 < 8
    (0.3, 20, 3, 11),    # 3 / 0.3 = 10 (float rounding must not drop a pop)
    (0.0, 7, 4, 16),     # th 0: the paper's bound 2N + 2 alone
    (-1.0, 4, 4, 10),
])
def test_salf_pops_is_the_smaller_of_the_mass_bound_and_2n_plus_2(th, n_max, S, want):
    from treespec_sglang.plugin.pool_rules import salf_pops

    assert salf_pops(th, n_max, S) == want


@pytest.mark.parametrize("k,steps,N", [(1, 1, 2), (1, 3, 4), (2, 1, 3), (1, 4, 3), (3, 1, 2)])
def test_tiny_pools_select_each_policy_tree_as_its_plain_oracle(k, steps, N):
    """Degenerate beams (topk 1 = a chain of pool nodes, one step = the root's children only, N = 2):
    every policy of the mixed list, each row against the plain one-request oracle over the beam."""
    specs = [s for s in MIXED_SPECS if s is None or s.get("classifier") is None and not (
        s["policy"] == "salf" and s.get("th") == 0.0 and "max_depth" in s)]
    roots = [(3 * i + 1) % 30 for i in range(len(specs))]
    draft, sl, tl, pl, paths = pool(topk=k, steps=steps, seed=5, roots=roots)
    params = [None if s is None else parse_spec(s) for s in specs]
    native = select_from_pool(sl, tl, pl, N, k, [None] * len(specs))[:3]
    _, top, _, keep = select_from_pool(sl, tl, pl, N, k, params, native=native)
    beam = oracles.BeamDraft(draft, sl, paths, 30)
    scores = torch.cat(sl, 1).flatten(1)
    for b, p in enumerate(params):
        assert kept_paths(top, keep, paths, roots, b) == expected_paths(p, beam, roots[b], N, scores[b], paths[b]), \
            specs[b]


def test_salf_continues_when_the_popped_mass_equals_th_exactly():
    """Alg. 2 line 13 stops only when the popped mass is *below* th: a root child of probability 1.0 with
    th 1.0 (both exact in float32) is expanded, and its best child is popped into the tree."""
    sl = [torch.tensor([[[1.0, 0.0]]] * 2), torch.tensor([[[0.5, 0.25], [0.0, 0.0]]] * 2)]
    tl = [torch.tensor([[1, 2]] * 2), torch.tensor([[3, 4, 5, 6]] * 2)]
    pl = [torch.tensor([[-1, 0, 1]] * 2), torch.tensor([[2, 3]] * 2)]
    params = [parse_spec({"policy": "salf", "budget": 4, "batch": 1, "th": 1.0}),
              parse_spec({"policy": "salf", "budget": 4, "batch": 1, "th": 0.9})]
    _, top, _, keep = select_from_pool(sl, tl, pl, 4, 2, params)
    # flat 0 (p 1.0) popped first: mass 1.0 >= th, so its children 2 (.5) and 3 (.25) enter Q; flat 2 is
    # popped next (mass .5 < th: stop). The tree: root, flat 0, flat 2.
    for b in range(2):
        assert {f for f, kp in zip(top[b].tolist(), keep[b, 1:].tolist()) if kp} == {0, 2}


def test_two_classifier_modules_in_one_batch_are_told_apart():
    """Two classifier *modules* (not the default by name) in one batch: each c2t row is scored by its own
    module, and the two modules' trees differ on this pool (else the test could not fail)."""
    torch.manual_seed(11)
    third = C2TClassifier(hidden=8).eval()
    roots = [2, 6, 11, 17]
    draft, sl, tl, pl, paths = pool(topk=3, steps=4, seed=1, roots=roots)
    clfs = (OTHER_CLF, third, third, OTHER_CLF)
    specs = [{"policy": "c2t", "budget": 12, "topk": 3, "beta": 0.3, "classifier": c} for c in clfs]
    _, top, _, keep = select_from_pool(sl, tl, pl, 14, 3, [parse_spec(x) for x in specs])
    beam = oracles.BeamDraft(draft, sl, paths, 30)
    differ = False
    for b, c in enumerate(clfs):
        trees = [oracles.c2t(beam, roots[b], 12, 3, 0.3, 10, m) for m in (c, OTHER_CLF if c is third else third)]
        own, other = ({t.path(i) for i in range(len(t.tok))} for t in trees)
        assert kept_paths(top, keep, paths, roots, b) == own
        differ |= own != other
    assert differ


def test_a_confidence_equal_to_beta_passes_the_gate():
    """C2T's pruning keeps C_i >= beta: a classifier of all-zero weights scores exactly 0.5 everywhere, so
    with beta 0.5 every c2t candidate passes and an early-stopping chain never stops."""
    half = C2TClassifier(hidden=4).eval()
    with torch.no_grad():
        for prm in half.parameters():
            prm.zero_()
    roots = [4, 8]
    draft, sl, tl, pl, paths = pool(topk=3, steps=3, seed=2, roots=roots)
    specs = [{"policy": "c2t", "budget": 9, "topk": 3, "beta": 0.5, "classifier": half},
             {"policy": "chain", "length": 3, "beta": 0.5, "classifier": half}]
    _, top, _, keep = select_from_pool(sl, tl, pl, 10, 3, [parse_spec(x) for x in specs])
    beam = oracles.BeamDraft(draft, sl, paths, 30)
    ref = oracles.c2t(beam, roots[0], 9, 3, 0.5, 10, half)
    assert kept_paths(top, keep, paths, roots, 0) == {ref.path(i) for i in range(len(ref.tok))}
    assert len(ref.tok) == 9  # every level passes: the budget is what stops it
    assert kept_paths(top, keep, paths, roots, 1) == chain_oracle(beam, roots[1], 3, 0.5, half)
    assert int(keep[1].sum()) == 4


def test_tied_pool_values_go_to_the_lower_flat_index():
    """A uniform beam (k 8, S 2: 8 root children of .125, 64 grandchildren of 1/64, all tied): every rule
    breaks ties toward the lower flat index (SGLang's order), which a sort that is not stable does not
    keep on 64 equal keys. Expected trees by hand: TALON keeps level 1 and the first 3 grandchildren, C2T
    (beta 0) the same, the chain flat 0 then its first child 8, EAGLE-2 the first 4 root children, SALF
    (B 8 pops all 8 root children, G full: D empty, stop) the first 7."""
    k, bs = 8, 5
    sl = [torch.full((bs, 1, k), 1 / 8), torch.full((bs, k, k), 1 / 64)]
    tl = [torch.arange(k).expand(bs, k), torch.arange(k, k + k * k).expand(bs, k * k)]
    pl = [torch.arange(-1, k).expand(bs, k + 1), torch.arange(k, 2 * k).expand(bs, k)]
    specs = [{"policy": "talon", "budget": 12, "topk": 8, "mu": 0.5},
             {"policy": "c2t", "budget": 12, "topk": 8, "beta": 0.0},
             {"policy": "chain", "length": 2},
             {"policy": "eagle2", "budget": 5},
             {"policy": "salf", "budget": 8, "batch": 8, "th": 0.05}]
    _, top, _, keep = select_from_pool(sl, tl, pl, 16, k, [parse_spec(x) for x in specs])
    got = [sorted(f for f, kp in zip(top[b].tolist(), keep[b, 1:].tolist()) if kp) for b in range(bs)]
    first = list(range(8))
    assert got == [first + [8, 9, 10], first + [8, 9, 10], [0, 8], [0, 1, 2, 3], first[:7]]


@pytest.mark.parametrize("k,steps", [(2, 1), (3, 1), (2, 3), (3, 4), (1, 3)])
def test_pool_view_attributes_from_the_flat_paths(k, steps):
    """PoolView's documented attributes against plain loops over each flat candidate's token path: the
    parent (-1 under the root), the level, the parent's log value (0 for the root), steps and the parent
    table's shape [bs, 1 + (S-1)k] (one step: a single -1 column)."""
    from treespec_sglang.plugin.pool import PoolView

    roots = [3, 9]
    _, sl, tl, pl, paths = pool(topk=k, steps=steps, seed=4, roots=roots)
    view = PoolView(sl, tl, pl, k)
    P = k + (steps - 1) * k * k
    assert view.steps == steps and view.scores.shape == (2, P)
    assert view.parent_list.shape == (2, 1 + (steps - 1) * k) and view.parent_list.dtype == torch.long
    if steps == 1:
        assert view.parent_list.tolist() == [[-1], [-1]]
    scores = torch.cat(sl, 1).flatten(1)
    for b in range(2):
        where = {p: f for f, p in enumerate(paths[b])}
        want_parent = [-1 if len(p) == 2 else where[p[:-1]] for p in paths[b]]
        assert view.parent[b].tolist() == want_parent
        assert view.level.tolist() == [len(p) - 1 for p in paths[b]]
        pv = view.parent_val[b].tolist()
        for f, par in enumerate(want_parent):
            assert pv[f] == (0.0 if par < 0 else pytest.approx(math.log(float(scores[b, par])), abs=1e-6))


def test_native_rows_take_the_given_selection_verbatim_and_rows_carry_the_values():
    """``native`` is taken verbatim for the rows without a policy (whatever it holds, here SGLang's ranking
    shifted by one rank), and when ``rows`` is given its values decide, ``params`` only naming the rules."""
    roots = [3, 5, 7]
    _, sl, tl, pl, paths = pool(topk=4, steps=3, seed=6, roots=roots)
    N, k = 8, 4
    scores = torch.cat(sl, 1).flatten(1)
    # ranks 1..N-1 instead of 0..N-2, ascending: a selection the plugin would never make itself
    fake = torch.sort(torch.sort(scores, dim=-1, descending=True, stable=True).indices[:, 1:N], dim=-1).values
    native = (torch.cat(pl[:-1], 1), fake, torch.gather(torch.cat(tl, 1), 1, fake))
    talon = parse_spec({"policy": "talon", "budget": 20, "topk": 4, "mu": 0.01})
    small = parse_spec({"policy": "talon", "budget": 4, "topk": 4, "mu": 0.01})
    params = [None, talon, None]
    rows = policy_rows([None, small, None], "cpu")
    _, top, toks, keep = select_from_pool(sl, tl, pl, N, k, params, native=native, rows=rows)
    for b in (0, 2):
        assert top[b].tolist() == fake[b].tolist() and toks[b].tolist() == native[2][b].tolist()
        assert keep[b].all()
    assert int(keep[1].sum()) == 4  # the row table's budget 4, not the params' 20


@pytest.mark.parametrize("seed", range(4))
def test_the_filler_is_sglangs_next_best_and_the_selection_is_sorted(seed):
    """The N-1 verify nodes of a policy row: its kept nodes plus the best unselected candidates by path
    probability (a plain sort of the scores, ties to the lower flat index), ascending, no repeats; the
    draft tokens are the pool's tokens there. (SALF rows with th 0 and a max_depth, and EAGLE-2 rows with a depth,
    pad from their own depth-limited ranking and are left out.)"""
    rng = random.Random(50 + seed)
    k, steps, bs = rng.choice([2, 3, 4]), rng.choice([2, 3, 4]), 8
    N = rng.choice([n for n in (5, 8, 12, 20) if n - 1 <= k + (steps - 1) * k * k])
    roots = rng.sample(range(30), bs)
    _, sl, tl, pl, paths = pool(topk=k, steps=steps, seed=seed + 20, roots=roots)
    specs = [rng.choice([s for s in MIXED_SPECS if s is not None]) for _ in range(bs)]
    specs[0] = {"policy": "salf", "budget": 6, "batch": 2, "th": 0.1, "max_depth": 1}
    _, top, toks, keep = select_from_pool(sl, tl, pl, N, k, [parse_spec(s) for s in specs])
    scores = torch.cat(sl, 1).flatten(1).tolist()
    tokens = torch.cat(tl, 1).tolist()
    for b, s in enumerate(specs):
        sel = top[b].tolist()
        assert sel == sorted(set(sel)) and len(sel) == N - 1
        assert toks[b].tolist() == [tokens[b][f] for f in sel]
        if s["policy"] == "salf" and s.get("th") == 0.0 and "max_depth" in s or "depth" in s:
            continue
        kept = {f for f, kp in zip(sel, keep[b, 1:].tolist()) if kp}
        ranked = sorted(range(len(scores[b])), key=lambda f: (-scores[b][f], f))
        fill = [f for f in ranked if f not in kept][:N - 1 - len(kept)]
        assert sel == sorted(kept | set(fill)), s


def test_zero_probability_candidates_are_never_selected_by_a_policy():
    """A beam whose distributions have fewer than k non-zero tokens (k 4: two of the root's children have
    probability 0, and so do their subtrees): TALON, C2T (beta 0) and the chain keep only positive nodes,
    by hand: TALON {0, 1} then {4, 5, 6, 8, 9}, C2T the same but its level-wise top-4 (.3 .2 .2 .1, the tie
    at .1 to flat 6), the chain {0, 4}."""
    z = [0.0] * 4
    sl = [torch.tensor([[[0.6, 0.4, 0.0, 0.0]]] * 3),
          torch.tensor([[[0.3, 0.2, 0.1, 0.0], [0.2, 0.1, 0.0, 0.0], z, z]] * 3)]
    tl = [torch.tensor([[1, 2, 3, 4]] * 3), torch.arange(5, 21).expand(3, 16)]
    pl = [torch.tensor([[-1, 0, 1, 2, 3]] * 3), torch.tensor([[4, 5, 8, 6]] * 3)]
    specs = [{"policy": "talon", "budget": 10, "topk": 4, "mu": 0.01},
             {"policy": "c2t", "budget": 10, "topk": 4, "beta": 0.0},
             {"policy": "chain", "length": 2}]
    _, top, _, keep = select_from_pool(sl, tl, pl, 12, 4, [parse_spec(x) for x in specs])
    got = [sorted(f for f, kp in zip(top[b].tolist(), keep[b, 1:].tolist()) if kp) for b in range(3)]
    assert got == [[0, 1, 4, 5, 6, 8, 9], [0, 1, 4, 5, 6, 8], [0, 4]]


def test_salf_th0_never_keeps_a_node_below_its_max_depth():
    """k 1, S 3 (one node per level), N 4: SALF th 0, max_depth 2, budget 7 may keep levels 1-2 only (the
    plain oracle, and SalfPolicy, never create a node deeper than max_depth)."""
    roots = [3, 22]
    draft, sl, tl, pl, paths = pool(topk=1, steps=3, seed=5, roots=roots)
    spec = {"policy": "salf", "budget": 7, "th": 0.0, "max_depth": 2}
    _, top, _, keep = select_from_pool(sl, tl, pl, 4, 1, [parse_spec(spec)] * 2)
    beam = oracles.BeamDraft(draft, sl, paths, 30)
    for b in range(2):
        assert kept_paths(top, keep, paths, roots, b) == oracles.salf(beam, roots[b], 4, 7, 0.0, 2)


def test_salf_pops_tied_candidates_in_flat_order():
    """Uniform root children (8 of .125), SALF budget 5 with B 5: the plain oracle pops flat 0-4 (ties to the
    earlier candidate) and keeps 0-3."""
    k = 8
    sl = [torch.full((1, 1, k), 1 / 8), torch.full((1, k, k), 1 / 64)]
    tl = [torch.arange(k)[None], torch.arange(k, k + k * k)[None]]
    pl = [torch.arange(-1, k)[None], torch.arange(k, 2 * k)[None]]
    _, top, _, keep = select_from_pool(sl, tl, pl, 16, k, [parse_spec({"policy": "salf", "budget": 5, "batch": 5,
                                                                         "th": 0.05})])
    assert sorted(f for f, kp in zip(top[0].tolist(), keep[0, 1:].tolist()) if kp) == [0, 1, 2, 3]

