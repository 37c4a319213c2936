"""A policy registered through the public API, as an operator's own module would (``TREESPEC_POLICY_MODULES``).

``root-children``: the root's best ``budget - 1`` children and nothing deeper. The engine drafts it as EAGLE-2
at depth 1 (its parameter class is EAGLE-2's with the depth fixed); in SGLang its ``"custom"`` pool rule keeps
the best of the pool's first level (the root's children), ties toward the lower flat index.
``engine-only`` is registered without a pool rule: a server refuses requests naming it when they arrive.
"""

from dataclasses import dataclass

import torch

from treespec_sglang.policies.base import rank_desc, register_policy
from treespec_sglang.policies.eagle2 import Eagle2Policy
from treespec_sglang.policies.params import Eagle2Params
from treespec_sglang.policies.registry import PoolRule


@dataclass(frozen=True)
class RootChildrenParams(Eagle2Params):
    depth: int = 1

    def __post_init__(self):
        super().__post_init__()
        if self.depth != 1:
            raise ValueError(f"root-children.depth must be 1, got {self.depth}")


def root_children_keep(pool, rows, n_eff):
    """``[bs, P]`` bool: the ``n_eff - 1`` best of the pool's first level (flat 0..k-1), ancestor-closed."""
    k = pool.k
    first = (rank_desc(pool.val[:, :k]) < (n_eff - 1)[:, None]) & pool.valid[:, :k]  # [bs, k]
    return torch.cat([first, torch.zeros_like(pool.valid[:, k:])], 1)


@register_policy
class RootChildrenPolicy(Eagle2Policy):
    name = "root-children"
    Params = RootChildrenParams
    pool_rule = PoolRule(row=lambda p: {}, stage="custom", keep=root_children_keep)


@dataclass(frozen=True)
class EngineOnlyParams(Eagle2Params):
    pass


@register_policy
class EngineOnlyPolicy(Eagle2Policy):
    name = "engine-only"
    Params = EngineOnlyParams
    pool_rule = None
