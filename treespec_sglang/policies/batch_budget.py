"""Deprecated module name: the batch's token cap lives in :mod:`treespec_sglang.policies.token_cap`."""

from ..utils.deprecation import warn_renamed
from .token_cap import CAP_KEY, LEGACY_CAP_KEY, allocate_batch, best_total, node_values, select_best, split_batch_option

__all__ = ["node_values", "allocate_batch", "best_total", "select_best", "split_batch_option", "CAP_KEY",
           "LEGACY_CAP_KEY"]

warn_renamed("treespec_sglang.policies.batch_budget", "treespec_sglang.policies.token_cap", stacklevel=2)
