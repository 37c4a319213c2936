"""Deprecated module name: the round's token cap lives in :mod:`treespec_sglang.engine.token_cap`
(``AutoBudget`` is :class:`~treespec_sglang.engine.token_cap.AutoTokenCap`)."""

from ..utils.deprecation import warn_renamed
from .token_cap import AutoTokenCap, plan_round  # noqa: F401

AutoBudget = AutoTokenCap
__all__ = ["AutoBudget", "AutoTokenCap", "plan_round"]

warn_renamed("treespec_sglang.engine.budget", "treespec_sglang.engine.token_cap", stacklevel=2)
