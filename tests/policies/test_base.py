"""The policy registry and the shared tensor helpers of ``policies/base.py``, against plain Python."""

import pytest
import torch

from treespec_sglang.policies import base
from treespec_sglang.policies.params import TalonParams


def test_register_policy_makes_the_class_selectable_and_returns_it():
    class Dummy(base.TreePolicy):
        name = "dummy-registry-test"
        Params = TalonParams

    try:
        assert base.register_policy(Dummy) is Dummy
        assert base.POLICIES["dummy-registry-test"] is Dummy
        assert base.parse_spec({"policy": "dummy-registry-test", "budget": 7}) == TalonParams(budget=7)
    finally:
        base.POLICIES.pop("dummy-registry-test", None)
