"""The policy registry and the shared tensor helpers of ``policies/base.py``, against plain Python."""

import pytest
import torch

from treespec_sglang.policies import base, registry
from treespec_sglang.policies.registry import REGISTRY, PoolRule, registration, registration_of
from treespec_sglang.policies.params import TalonParams


def test_register_policy_makes_the_class_selectable_and_returns_it():
    class DummyParams(TalonParams):  # a parameter class of its own: a request's parameters name one policy
        pass

    class Dummy(base.TreePolicy):
        name = "dummy-registry-test"
        Params = DummyParams

    try:
        assert base.register_policy(Dummy) is Dummy
        assert base.POLICIES["dummy-registry-test"] is Dummy
        p = base.parse_spec({"policy": "dummy-registry-test", "budget": 7})
        assert p == DummyParams(budget=7) and registration_of(p).name == "dummy-registry-test"
        assert registration_of(TalonParams(budget=7)).name == "talon"  # the base class keeps its own policy
        reg = registration("dummy-registry-test")
        assert reg.engine is Dummy and reg.pool_rule is None and reg.needs_tree  # the class defaults
    finally:
        for table in (REGISTRY, base.POLICIES):
            table.pop("dummy-registry-test", None)
        registry._BY_PARAMS.pop(DummyParams, None)


def test_a_parameter_class_belongs_to_one_policy_and_a_pool_rule_is_checked():
    class Twin(base.TreePolicy):
        name = "twin-registry-test"
        Params = TalonParams

    with pytest.raises(ValueError, match="parameter class TalonParams already belongs to policy 'talon'"):
        base.register_policy(Twin)
    assert "twin-registry-test" not in REGISTRY
    with pytest.raises(ValueError, match="pool_rule.stage must be one of"):
        PoolRule(row=dict, stage="levels")
    with pytest.raises(ValueError, match="keep is given exactly when"):
        PoolRule(row=dict, stage="custom")
    with pytest.raises(ValueError, match="policy must be one of .*got 'nope'"):
        registration("nope")


def test_sanitize_logprobs_maps_non_finite_to_minus_inf_and_clamps_at_zero():
    x = torch.tensor([[0.5, 2.0, float("nan"), float("inf"), float("-inf"), -1.25, 0.0]], dtype=torch.float64)
    out = base.sanitize_logprobs(x)
    assert out.dtype == torch.float32
    assert out.tolist() == [[0.0, 0.0, float("-inf"), float("-inf"), float("-inf"), -1.25, 0.0]]


def test_rank_desc_breaks_ties_toward_the_lower_column_even_for_many_equal_keys():
    """100 equal keys (an unstable sort reorders 64 or more) and a mixed row, against a plain sort."""
    vals = torch.zeros(2, 100)
    vals[1] = torch.tensor([float(i % 7) for i in range(100)])
    got = base.rank_desc(vals).tolist()
    for b in range(2):
        row = vals[b].tolist()
        order = sorted(range(100), key=lambda j: (-row[j], j))
        assert got[b] == [order.index(j) for j in range(100)]


def test_row_param_stacks_one_field_with_the_asked_dtype():
    ps = [TalonParams(budget=5, topk=2, mu=1), TalonParams(budget=7, topk=3, mu=0)]  # int-valued mus
    mu = base.row_param(ps, "mu", "cpu", torch.float32)
    assert mu.dtype == torch.float32 and mu.tolist() == [1.0, 0.0]
    k = base.row_param(ps, "topk", "cpu")
    assert k.dtype == torch.int64 and k.tolist() == [2, 3]


def test_keep_top_budget_keeps_the_root_first_even_when_a_child_ties_it():
    """Children of probability 1 (log 0) tie the root's 0: the root is still kept, and budget 1 is the root
    alone; budget 3 adds the two best nodes, ties to the earlier one (plain loops)."""
    from treespec_sglang.tree import DraftTree

    toks = [[9, 1, 2, 3, 4]] * 2
    pars = [[-1, 0, 0, 1, 2]] * 2
    lps = [[0.0, 0.0, -0.5, -0.5, -0.5]] * 2
    pool = DraftTree.from_lists(toks, pars, lps)
    out = base.keep_top_budget(pool, torch.tensor([1, 3]), 5)
    assert out.size.tolist() == [1, 3]
    assert out.tokens[0, 0] == 9 and out.tokens[1, :3].tolist() == [9, 1, 2]


@pytest.mark.parametrize("spec,name", [("talon", "str"), (["talon"], "list"), (None, "NoneType"), (3, "int")])
def test_a_spec_that_is_not_a_dict_is_named_by_its_type(spec, name):
    with pytest.raises(ValueError, match=rf"policy spec must be a dict like .*, got {name}$"):
        base.parse_spec(spec)


def test_numpy_scalars_become_python_numbers_and_other_scalars_are_refused():
    import numpy as np

    p = base.parse_spec({"policy": "talon", "budget": np.int64(9), "topk": np.int32(3), "mu": np.float32(0.25)})
    assert (type(p.budget), type(p.topk), type(p.mu)) == (int, int, float)
    assert p == TalonParams(budget=9, topk=3, mu=0.25)
    with pytest.raises(ValueError, match=r"talon\.budget must be an integer in \[1, 1024\], got tensor\(9\)"):
        base.parse_spec({"policy": "talon", "budget": torch.tensor(9)})  # only numpy scalars are unwrapped
