"""The batched tree-policy interface, its registry and shared tensor helpers.

A policy instance serves one group of requests (a sub-batch that chose the same policy, each
with its own parameters) for one ``grow_tree`` call:

``start(root_tokens, root_logprobs) -> frontier``, then ``step(child_logprobs) -> frontier``
while any frontier entry is >= 0 (at most ``max_steps`` times), then ``finish() -> DraftTree``.

``tree`` is the working tree that the frontier indexes (what the draft model must see to
expand those nodes). Every method is sync-free: per-row differences are masks over static
maxima, never Python branches on tensor values.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar, Optional, Sequence, Type

import torch

from ..tree import DraftTree, TreeBuffer, compact
from .params import PolicyParams, shown
from .registry import POLICIES, PoolRule, register_policy, registration

__all__ = ["TreePolicy", "register_policy", "POLICIES", "parse_spec", "sanitize_logprobs",
           "rank_desc", "row_param", "keep_top_budget"]


def parse_spec(spec) -> PolicyParams:
    """Validate one request's policy dict and return its frozen parameter set.

    Raises
    ------
    ValueError
        Naming the field and its allowed values (unknown policy, unknown key, bad type/range).

    Examples
    --------
    >>> parse_spec({"policy": "talon", "budget": 60, "mu": 0.03}).mu
    0.03
    """
    if isinstance(spec, PolicyParams):
        return spec
    if not isinstance(spec, dict):
        raise ValueError(f"policy spec must be a dict like {{'policy': 'talon', ...}}, got {type(spec).__name__}")
    name = spec.get("policy")
    cls = registration(name).Params  # ValueError naming the registered policies (a list / dict value too)
    allowed = cls.field_names()
    unknown = sorted(set(spec) - set(allowed) - {"policy"}, key=repr)  # any key type (a Python caller's 1)
    if unknown:
        raise ValueError(f"{name}: unknown parameter(s) [{', '.join(shown(k) for k in unknown)}]; allowed: {allowed}")
    # numpy scalars (np.int64 from a dataframe, np.float32) become Python numbers; range checks follow
    return cls(**{k: (v.item() if type(v).__module__ == "numpy" and hasattr(v, "item") else v)
                  for k, v in spec.items() if k != "policy"})


def sanitize_logprobs(x: torch.Tensor) -> torch.Tensor:
    """Map NaN / +-inf draft log-probs to -inf (an impossible token) and clamp at 0, as float32."""
    x = x.float()
    return torch.where(torch.isfinite(x), x.clamp(max=0.0), float("-inf"))


def rank_desc(values: torch.Tensor) -> torch.Tensor:
    """Rank of each entry in descending order, ties broken toward the lower column.

    ``[bs, m]`` -> ``[bs, m]`` int64. Example: [0.5, 0.9, 0.5] -> [1, 0, 2].
    """
    order = torch.sort(values, dim=-1, descending=True, stable=True).indices
    rank = torch.empty_like(order)
    rank.scatter_(-1, order, torch.arange(values.shape[-1], device=values.device).expand_as(order))
    return rank


def keep_top_budget(pool: DraftTree, budget: torch.Tensor, n_out: int) -> DraftTree:
    """The root plus the ``budget - 1`` best pool nodes by path value, ties toward the earlier node.

    ``budget`` is ``[bs]`` int64. Values never increase along a path and parents precede
    children, so the kept set is ancestor-closed (EAGLE-2 §4.2; SALF's G = top-N of popped).
    """
    lp = pool.logprob.clone()
    lp[:, 0] = float("inf")  # the root is always kept
    keep = (rank_desc(lp) < budget[:, None]) & torch.isfinite(pool.logprob)
    return compact(pool, keep, n_out)


def row_param(params: Sequence[PolicyParams], name: str, device, dtype=torch.int64) -> torch.Tensor:
    """Stack one field over the group's requests: ``[bs]``."""
    return torch.tensor([getattr(p, name) for p in params], dtype=dtype, device=device)


class TreePolicy(ABC):
    """One policy applied to a group of requests. ``@register_policy`` registers the class with its
    ``pool_rule`` (how the SGLang plugin selects its tree from SGLang's draft pool; None: it cannot) and
    ``needs_tree`` (False: a chain server can draft it) (:mod:`.registry`)."""

    name: ClassVar[str]
    Params: ClassVar[Type[PolicyParams]]
    pool_rule: ClassVar[Optional[PoolRule]] = None
    needs_tree: ClassVar[bool] = True

    def __init__(self, params: Sequence[PolicyParams], device: torch.device):
        self.params = list(params)
        self.device = torch.device(device)
        self.bs = len(self.params)
        self.max_nodes = max(p.max_nodes for p in self.params)
        self.buf: TreeBuffer  # set in start()

    # static, host-side bounds (known before any compute)
    @property
    @abstractmethod
    def max_steps(self) -> int:
        """Upper bound on ``step`` calls (= draft forwards after the root)."""

    @property
    @abstractmethod
    def depth_bound(self) -> int:
        """Upper bound on the depth of any node the policy may create."""

    @abstractmethod
    def start(self, root_tokens: torch.Tensor, root_logprobs: torch.Tensor) -> torch.Tensor:
        """``[bs]`` int64, ``[bs, vocab]`` float -> frontier ``[bs, width]`` int64 (-1 = none)."""

    @abstractmethod
    def step(self, child_logprobs: torch.Tensor) -> torch.Tensor:
        """``[bs, width, vocab]`` log-probs of the frontier's children -> next frontier ``[bs, width']``."""

    @abstractmethod
    def finish(self) -> DraftTree:
        """The final tree, ``[bs, max_nodes]``."""

    @property
    def tree(self) -> DraftTree:
        """The working tree the frontier indexes."""
        return self.buf.view(self.depth_bound)

    def waiting(self) -> torch.Tensor:
        """``[]`` bool: some row has not finished although its frontier is empty this step (it steps again
        with no children to read: SALF popping only nodes at its depth bound). No host read."""
        return torch.zeros((), dtype=torch.bool, device=self.device)
