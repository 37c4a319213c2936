"""Per-request policies inside SGLang's captured draft pool (sglang-free parts of the plugin)."""

import random

import pytest
import torch

from treespec_sglang.policies.classifier import load_classifier

from tests.helpers import PathDraft, random_batch
from tests.policies import oracles
from treespec_sglang.plugin.pool import select_from_pool, unlink_filler
from treespec_sglang.policies import parse_spec
from treespec_sglang.tree import DraftTree, sglang_retrive


def pool(topk=4, steps=4, seed=0, roots=(3, 5, 7)):
    draft = PathDraft(30, seed=seed, sharpness=2.0)
    sl, tl, pl, paths = oracles.sglang_pool_lists(draft, list(roots), topk, steps)
    return draft, sl, tl, pl, paths


def reachable(nt, ns, b):
    seen, stack = [], [0]
    while stack:
        u = stack.pop()
        seen.append(u)
        kid = int(nt[b, u])
        while kid >= 0:
            stack.append(kid)
            kid = int(ns[b, kid])
    return sorted(seen)


def kept_paths(top_idx, keep, paths, roots, b):
    out = {(int(roots[b]),)}
    for i, f in enumerate(top_idx[b].tolist()):
        if keep[b, i + 1]:
            out.add(paths[b][f])
    return out


def test_native_rows_equal_organize_draft_results():
    _, sl, tl, pl, _ = pool()
    N = 12
    parent_list, top, toks, keep = select_from_pool(sl, tl, pl, N, 4, [None] * 3)
    scores = torch.cat(sl, 1).flatten(1)
    ref = torch.sort(torch.topk(scores, N - 1, dim=-1).indices).values
    assert torch.equal(top, ref) and keep.all()
    assert torch.equal(toks, torch.gather(torch.cat(tl, 1), 1, ref))
    assert torch.equal(parent_list, torch.cat(pl[:-1], 1))


@pytest.mark.parametrize("spec", [{"policy": "talon", "budget": 9, "topk": 3, "mu": 0.05},
                                  {"policy": "talon", "budget": 12, "topk": 4, "mu": 0.01},
                                  {"policy": "salf", "budget": 10, "batch": 3, "th": 0.0},
                                  {"policy": "chain", "length": 3},
                                  {"policy": "c2t", "budget": 10, "topk": 4, "beta": 0.2},
                                  {"policy": "eagle2", "budget": 6, "topk": 4, "depth": 4}])
def test_policy_rows_select_the_policy_tree_on_the_beam(spec):
    draft, sl, tl, pl, paths = pool(seed=3)
    roots = [3, 5, 7]
    N, k = 12, 4
    params = [parse_spec(spec), None, parse_spec(spec)]
    native = select_from_pool(sl, tl, pl, N, k, [None] * 3)[:3]
    parent_list, top, toks, keep = select_from_pool(sl, tl, pl, N, k, params, native=native)
    assert top.shape == (3, N - 1) and keep[1].all()
    assert torch.equal(top[1], native[1][1])
    beam = oracles.BeamDraft(draft, sl, paths, 30)
    for b in (0, 2):
        got = kept_paths(top, keep, paths, roots, b)
        if spec["policy"] == "talon":
            ref = oracles.talon(beam, roots[b], spec["budget"], spec["topk"], spec["mu"])
            expect = {ref.path(i) for i in range(len(ref.tok))}
        elif spec["policy"] == "salf":
            expect = oracles.salf(beam, roots[b], spec["budget"], spec["batch"], spec["th"])
        elif spec["policy"] == "c2t":
            ref = oracles.c2t(beam, roots[b], spec["budget"], spec["topk"], spec["beta"], 10, load_classifier(None))
            expect = {ref.path(i) for i in range(len(ref.tok))}
        elif spec["policy"] == "chain":
            expect, p = {(roots[b],)}, (roots[b],)
            for _ in range(spec["length"]):
                lp = beam.logprobs(p)
                if not torch.isfinite(lp).any():
                    break
                p = p + (int(lp.argmax()),)
                expect.add(p)
        else:  # eagle2 budget 6 < N: SGLang's 5 best
            scores = torch.cat(sl, 1).flatten(1)[b]
            expect = {(roots[b],)} | {paths[b][f] for f in scores.topk(5).indices.tolist()}
        assert got == expect, spec
        # the filler is unlinked: verification can only walk the policy's tree
        tree = DraftTree.from_lists([[roots[b]] + toks[b].tolist()],
                                    [oracles_parents(parent_list[b], top[b], k, N)])
        r = sglang_retrive(tree)
        nt, ns = unlink_filler(r.retrive_next_token, r.retrive_next_sibling, keep[b:b + 1])
        assert reachable(nt, ns, 0) == [i for i in range(N) if keep[b, i]]


def oracles_parents(parent_list, top, k, N):
    sel = top.tolist()
    parents = [-1]
    for i in range(1, N):
        tb = sel[i - 1] // k
        parents.append(0 if tb == 0 else sel.index(int(parent_list[tb])) + 1)
    return parents


@pytest.mark.parametrize("seed", range(6))
def test_unlink_filler_keeps_exactly_the_kept_subtree(seed):
    rng = random.Random(seed)
    t = random_batch(rng, [14, 9, 20], vocab=50, max_children=4)
    keep = torch.zeros(t.tokens.shape, dtype=torch.bool)
    for b in range(t.bs):  # random ancestor-closed subsets
        keep[b, 0] = True
        for i in range(1, int(t.size[b])):
            keep[b, i] = bool(keep[b, t.parents[b, i]]) and rng.random() < 0.7
    r = sglang_retrive(t)
    nt, ns = unlink_filler(r.retrive_next_token, r.retrive_next_sibling, keep)
    for b in range(t.bs):
        assert reachable(nt, ns, b) == [i for i in range(t.n_nodes) if keep[b, i]]
        for u in range(t.n_nodes):  # kept children in index order along the new chains
            if keep[b, u]:
                kids, c = [], int(nt[b, u])
                while c >= 0:
                    kids.append(c)
                    c = int(ns[b, c])
                assert kids == [j for j in range(1, int(t.size[b])) if t.parents[b, j] == u and keep[b, j]]
