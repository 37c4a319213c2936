"""``{"policy": "none"}``: speculation off for one request in a speculative batch.

The tree is the root alone, so the request verifies one token per round: exactly plain decoding,
while the other requests of the batch keep their trees. No draft forward is spent on it.
"""

from __future__ import annotations

import torch

from ..tree import DraftTree, TreeBuffer
from .base import TreePolicy, register_policy
from .registry import PoolRule
from .params import NoneParams

__all__ = ["NonePolicy"]


@register_policy
class NonePolicy(TreePolicy):
    name = "none"
    Params = NoneParams
    pool_rule = PoolRule(row=lambda p: {"top": 0}, stage="rank")  # the root alone
    needs_tree = False

    @property
    def max_steps(self) -> int:
        return 0

    @property
    def depth_bound(self) -> int:
        return 0

    def start(self, root_tokens, root_logprobs):
        # root_tokens [bs] -> frontier [bs, 0]: nothing to expand
        self.buf = TreeBuffer(root_tokens, 1)
        return torch.empty(self.bs, 0, dtype=torch.int64, device=self.device)

    def step(self, child_logprobs):  # never called: max_steps is 0
        raise RuntimeError("the none policy drafts nothing")

    def finish(self) -> DraftTree:
        return self.buf.view(0)
