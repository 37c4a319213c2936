"""A policy registered through the public API (``tests/e2e/custom_policy.py``): one registration reaches the
plugin's row table, stages, request validation and stats; a policy without a pool rule is refused on arrival,
never a KeyError in the middle of a round."""

import re

import pytest
import torch

from tests.plugin.pools import pool
from treespec_sglang.plugin.pool import COLUMNS, kind_id, request_row, select_from_pool
from treespec_sglang.plugin.request import request_params, unsupported_reason, validate_custom_params
from treespec_sglang.plugin.stats import policy_name
from treespec_sglang.policies import parse_spec, registry

K, S, N = 4, 3, 8


def root_children_oracle(sl, b, budget):
    """Plain Python: the flat indices of the root's ``budget - 1`` best children (ties: lower index)."""
    scores = sl[0][b, 0].tolist()  # [k] the root's children
    order = sorted(range(len(scores)), key=lambda j: (-scores[j], j))
    return sorted(j for j in order[:budget - 1] if scores[j] > 0)


def test_a_custom_pool_rule_selects_its_rows_and_leaves_the_others_alone(custom):
    _, sl, tl, pl, _ = pool(topk=K, steps=S, seed=3, roots=(3, 5, 7))
    talon = parse_spec({"policy": "talon", "budget": N, "mu": 0.03})
    mine = parse_spec({"policy": "root-children", "budget": 3})
    _, top, _, keep = select_from_pool(sl, tl, pl, N, K, [mine, talon, None])
    kept = [f for f, k in zip(top[0].tolist(), keep[0, 1:].tolist()) if k]
    assert kept == root_children_oracle(sl, 0, 3) and len(kept) == 2
    _, top_alone, _, keep_alone = select_from_pool(sl, tl, pl, N, K, [None, talon, None])
    assert torch.equal(top[1:], top_alone[1:]) and torch.equal(keep[1:], keep_alone[1:])
    assert request_row(mine, "cpu")[0, COLUMNS.index("kind")] == kind_id("root-children") > kind_id("talon")
    assert policy_name(mine) == "root-children"


def test_a_policy_without_a_pool_rule_is_refused_on_arrival_with_its_name(custom):
    with pytest.raises(ValueError, match=r"policy 'engine-only' has no SGLang pool rule .* policies a server can "
                                         r"draft: \[.*'root-children'.*\]"):
        validate_custom_params({"treespec": {"policy": "engine-only"}})
    with pytest.raises(ValueError, match="custom_params\\['treespec'\\]: policy 'engine-only'"):
        request_params(type("SP", (), {"custom_params": {"treespec": {"policy": "engine-only"}}})(), None)
    with pytest.raises(ValueError, match=r"^policy 'engine-only' has no SGLang pool rule \(registered without "
                                         r"pool_rule\)"):  # a request built by hand, past the arrival check
        request_row(parse_spec({"policy": "engine-only"}), "cpu")


def test_a_chain_server_refuses_a_registered_tree_policy_by_its_registration(custom):
    chain_server = type("Args", (), {"speculative_algorithm": "EAGLE", "speculative_eagle_topk": 1})()
    msg = unsupported_reason(parse_spec({"policy": "root-children", "budget": 3}), chain_server)
    assert msg.startswith("root-children needs a draft tree")
    assert unsupported_reason(parse_spec({"policy": "none"}), chain_server) is None


@pytest.mark.parametrize("row, message", [
    (lambda p: {"width": 3}, "root-children: pool_rule.row gave unknown columns ['width']"),
    (lambda p: {"top": p.missing}, "root-children: pool_rule.row failed for these parameters: AttributeError: "),
])
def test_a_pool_rule_whose_row_fails_fails_its_request_on_arrival(custom, row, message):
    """Where the request comes in (the tokenizer's validation, the scheduler's parse), not in a round of its batch."""
    from types import SimpleNamespace

    from treespec_sglang.plugin import server_hooks

    reg = registry.REGISTRY["root-children"]
    registry.REGISTRY["root-children"] = registry.Registration(
        reg.name, reg.engine, registry.PoolRule(row=row, stage="custom", keep=custom.root_children_keep), reg.needs_tree)
    try:
        spec = {"policy": "root-children", "budget": 5}
        with pytest.raises(ValueError, match=re.escape(f"custom_params['treespec']: {message}")):
            validate_custom_params({"treespec": spec})
        aborted = []
        req = SimpleNamespace(sampling_params=SimpleNamespace(custom_params={"treespec": spec}),
                              set_finish_with_abort=lambda msg, **kw: aborted.append(msg))
        server_hooks._create_generation_req(req, None)
        assert len(aborted) == 1 and message in aborted[0]
    finally:
        registry.REGISTRY["root-children"] = reg


def test_a_pool_rule_naming_an_unknown_column_fails_at_its_first_row(custom):
    bad = registry.PoolRule(row=lambda p: {"width": 3}, stage="custom", keep=custom.root_children_keep)
    reg = registry.REGISTRY["root-children"]
    registry.REGISTRY["root-children"] = registry.Registration(reg.name, reg.engine, bad, reg.needs_tree)
    try:
        for _ in range(2):  # not cached past its first failure
            with pytest.raises(ValueError) as e:
                request_row(parse_spec({"policy": "root-children", "budget": 4}), "cpu")
            assert str(e.value) == ("root-children: pool_rule.row gave unknown columns ['width']; allowed: ['budget', "
                                    "'top', 'rank_depth', 'topk', 'log_mu', 'th', 'batch', 'max_depth', 'beta', 'clf']")
    finally:
        registry.REGISTRY["root-children"] = reg


def test_registered_policies_sharing_a_stage_each_keep_their_own_tree(custom):
    """Two custom rules in one batch, and a policy registered on a built-in stage (TALON's) beside TALON itself:
    each row's selection is the one it gets alone in the batch (a custom rule on its own rows only; a stage's
    rule on the rows of every policy that names it, and on no other)."""
    from dataclasses import dataclass

    from treespec_sglang.policies.base import register_policy
    from treespec_sglang.policies.params import Eagle2Params, TalonParams
    from treespec_sglang.policies.talon import TalonPolicy

    @dataclass(frozen=True)
    class OneChildParams(Eagle2Params):
        pass

    @register_policy
    class OneChild(custom.RootChildrenPolicy):  # a second custom rule: the root's best child alone
        name = "one-child"
        Params = OneChildParams
        pool_rule = registry.PoolRule(row=lambda p: {}, stage="custom", keep=lambda pool, rows, n_eff: (
            custom.root_children_keep(pool, rows, rows[:, COLUMNS.index("budget")].clamp(max=2).long())))  # its rows

    @dataclass(frozen=True)
    class WideTalonParams(TalonParams):
        pass

    @register_policy
    class WideTalon(TalonPolicy):  # TALON's stage and rule under another name
        name = "talon-wide"
        Params = WideTalonParams

    specs = [{"policy": "root-children", "budget": 3}, {"policy": "talon", "budget": N, "mu": 0.03},
             {"policy": "one-child", "budget": 4}, {"policy": "talon-wide", "budget": 6, "mu": 0.2}, None,
             {"policy": "talon-wide", "budget": N, "topk": 2, "mu": 0.01}]
    params = [None if s is None else parse_spec(s) for s in specs]
    _, sl, tl, pl, _ = pool(topk=K, steps=S, seed=5, roots=(3, 5, 7, 4, 6, 8))
    _, top, _, keep = select_from_pool(sl, tl, pl, N, K, params)
    sizes = []
    for b, p in enumerate(params):
        alone = [p if j == b else None for j in range(len(params))]
        _, top_b, _, keep_b = select_from_pool(sl, tl, pl, N, K, alone)
        assert torch.equal(top[b], top_b[b]) and torch.equal(keep[b], keep_b[b]), (b, specs[b])
        sizes.append(int(keep[b].sum()))
    assert sizes[0] == 3 and sizes[2] == 2 and sizes[4] == N  # two root children, one, SGLang's own N
