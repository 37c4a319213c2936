"""``{"policy": "none"}``: speculation off for one request (the root alone), mixed with other policies."""

import pytest
import torch

from tests.helpers import PathDraft
from tests.policies import oracles
from treespec_sglang.plugin.pool import select_from_pool, unlink_filler
from treespec_sglang.policies import NoneParams, grow_tree, parse_spec


def test_none_takes_no_parameters():
    assert isinstance(parse_spec({"policy": "none"}), NoneParams)
    with pytest.raises(ValueError, match=r"none: unknown parameter\(s\) \['budget'\]; allowed: \[\]"):
        parse_spec({"policy": "none", "budget": 4})


def test_grow_tree_gives_the_root_alone_and_never_calls_the_draft_for_it():
    lp = torch.log_softmax(torch.randn(3, 40, generator=torch.Generator().manual_seed(0)), -1)  # [bs, vocab]
    seen = []

    def expand(tree, frontier):  # [bs, width] -> [bs, width, vocab]
        seen.append(frontier.clone())
        return lp[:, None, :].expand(3, frontier.shape[1], 40)

    tree = grow_tree([{"policy": "none"}, {"policy": "eagle2", "budget": 6, "topk": 2, "depth": 3},
                      {"policy": "none"}], torch.tensor([4, 5, 6]), lp, expand)
    assert tree.size.tolist() == [1, 6, 1]
    assert tree.tokens[0, 0] == 4 and tree.tokens[2, 0] == 6 and (tree.parents[[0, 2], 1:] == -1).all()
    assert seen and all((f[[0, 2]] < 0).all() for f in seen)  # no frontier node of a none row is expanded
    only = grow_tree([{"policy": "none"}], torch.tensor([1]), lp[:1], lambda t, f: pytest.fail("drafted"))
    assert only.size.tolist() == [1]


def test_pool_selection_keeps_the_root_alone_for_none_rows():
    draft = PathDraft(30, seed=1, sharpness=2.0)
    sl, tl, pl, _ = oracles.sglang_pool_lists(draft, [3, 5, 7], 4, 3)
    N = 8
    specs = [parse_spec({"policy": "none"}), None, parse_spec({"policy": "talon", "budget": 8, "topk": 4})]
    _, top, _, keep = select_from_pool(sl, tl, pl, N, 4, specs)
    assert keep[0].tolist() == [True] + [False] * (N - 1)  # root only; the other N-1 slots are filler
    assert keep[1].all() and keep[2].sum() > 1
    nt = torch.full((3, N), -1, dtype=torch.long)
    nt[:, 0] = 1
    ns = torch.full((3, N), -1, dtype=torch.long)
    ns[:, 1:N - 1] = torch.arange(2, N)
    nt2, ns2 = unlink_filler(nt, ns, keep)
    assert int(nt2[0, 0]) == -1  # the verify walk of a none row has nothing below the root


def test_engine_with_none_equals_plain_decoding(tiny_engine):
    prompts = [[5, 9, 2], [7, 1, 3, 3]]
    plain = [r.token_ids for r in tiny_engine.generate(prompts, max_new_tokens=10)]
    out = tiny_engine.generate(prompts, max_new_tokens=10, policy=[{"policy": "none"}, {"policy": "talon",
                                                                                       "budget": 6}])
    assert [r.token_ids for r in out] == plain
    assert set(out[0].stats.tree_sizes) == {1} and set(out[0].stats.accepted) == {0}


def test_none_policy_alone_frontier_tree_and_step():
    """The policy object itself: an empty int64 frontier per request, a one-node tree of depth bound 0, and
    a step that refuses to run (max_steps is 0)."""
    from treespec_sglang.policies.off import NonePolicy

    pol = NonePolicy([NoneParams(), NoneParams()], torch.device("cpu"))
    frontier = pol.start(torch.tensor([7, 9]), torch.zeros(2, 5))
    assert frontier.shape == (2, 0) and frontier.dtype == torch.int64
    assert pol.max_steps == 0 and pol.depth_bound == 0
    with pytest.raises(RuntimeError, match=r"^the none policy drafts nothing$"):
        pol.step(torch.zeros(2, 0, 5))
    tree = pol.finish()
    tree.check()
    assert tree.n_nodes == 1 and tree.depth_bound == 0
    assert tree.tokens.tolist() == [[7], [9]] and tree.size.tolist() == [1, 1]
