"""One registration per policy: its name, parameters, engine policy, SGLang pool rule and server needs.

``@register_policy`` on a :class:`~treespec_sglang.policies.base.TreePolicy` subclass is the whole
registration. It reads the class's ``name``, ``Params`` (a parameter class of its own), ``pool_rule``
(how the SGLang plugin selects the policy's tree from SGLang's draft pool; ``None``: the plugin refuses
requests naming the policy, with a message, when they arrive) and ``needs_tree`` (False: a chain
server, ``--speculative-eagle-topk 1``, can draft it too). The engine (:data:`POLICIES`), request
parsing, the plugin's row table and stages, its request validation and the per-request stats all read
this one record (:func:`registration`, :func:`registration_of`).

A policy the SGLang plugin should serve must be registered in every process SGLang starts (launcher,
tokenizer manager, each rank's scheduler): import its module from a ``sglang.srt.plugins`` entry point
of its own package, or name the module in ``TREESPEC_POLICY_MODULES`` (comma-separated, the operator's
environment), which the plugin imports in each process before any request.

Example
-------
>>> registration("talon").pool_rule.stage, registration("chain").needs_tree
('talon', False)
>>> from treespec_sglang.policies.params import Eagle2Params
>>> registration_of(Eagle2Params(budget=5)).name
'eagle2'
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Dict, Optional, Type

if TYPE_CHECKING:  # pragma: no cover
    from .base import TreePolicy
    from .params import PolicyParams

__all__ = ["PoolRule", "Registration", "register_policy", "registration", "registration_of", "pool_rule_of",
           "REGISTRY", "POLICIES", "STAGES"]

# The plugin's vectorised stages (plugin/pool.py): "rank" keeps the row's "top" best pool nodes in SGLang's
# own ranking, "talon" / "c2t" / "chain" the level-wise rules, "salf" the best-first search; "custom" calls
# the rule's own ``keep``.
STAGES = ("rank", "talon", "c2t", "chain", "salf", "custom")


@dataclass(frozen=True)
class PoolRule:
    """How the SGLang plugin applies a policy to SGLang's draft pool (pure torch; no sglang import).

    Attributes
    ----------
    row : ``params -> {column: value}``, the request's entries in the plugin's ``[bs, F]`` float32 row table
        (``plugin.pool.COLUMNS``): ``budget`` the tree-size cap (root included), ``top`` how many of SGLang's
        best pool nodes to keep by rank, the stage's own parameters; ``None`` means unbounded and ``clf`` a
        classifier spec (a registered name), which the plugin numbers.
    stage : one of :data:`STAGES`.
    keep : for ``"custom"`` only: ``(pool, rows, n_eff) -> [bs, P]`` bool, the kept pool nodes of every row
        (``pool`` a ``plugin.pool.PoolView``, ``rows`` ``[bs, F]``, ``n_eff`` ``[bs]`` the size cap). It must
        be ancestor-closed and free of host reads (it runs every round, possibly inside a CUDA graph); the
        plugin applies it to the rows of this policy only and caps the tree at N.
    """

    row: Callable[["PolicyParams"], Dict[str, object]]
    stage: str = "rank"
    keep: Optional[Callable] = None

    def __post_init__(self):
        if self.stage not in STAGES:
            raise ValueError(f"pool_rule.stage must be one of {list(STAGES)}, got {self.stage!r}")
        if (self.keep is not None) != (self.stage == "custom"):
            raise ValueError("pool_rule.keep is given exactly when pool_rule.stage is 'custom'")


@dataclass(frozen=True)
class Registration:
    """A registered policy: ``name``, its ``engine`` class (and so ``Params``), ``pool_rule`` (None: the SGLang
    plugin cannot draft it) and ``needs_tree`` (False: a chain server can draft it)."""

    name: str
    engine: Type["TreePolicy"]
    pool_rule: Optional[PoolRule]
    needs_tree: bool

    @property
    def Params(self) -> Type["PolicyParams"]:
        return self.engine.Params


REGISTRY: Dict[str, Registration] = {}
POLICIES: Dict[str, Type["TreePolicy"]] = {}  # name -> engine class (the engine's view of REGISTRY)
_BY_PARAMS: Dict[type, str] = {}


def register_policy(cls: Type["TreePolicy"]) -> Type["TreePolicy"]:
    """Class decorator: register ``cls`` (name, Params, engine class, ``pool_rule``, ``needs_tree``) and return it.

    Raises
    ------
    ValueError
        If ``cls.Params`` already belongs to a policy of another name (a request's parameters must name one
        policy), or ``pool_rule`` is not a :class:`PoolRule`.
    """
    owner = _BY_PARAMS.get(cls.Params)
    if owner is not None and owner != cls.name:
        raise ValueError(f"{cls.__name__}: parameter class {cls.Params.__name__} already belongs to policy "
                         f"{owner!r}; give each policy a parameter class of its own (a subclass will do)")
    rule = getattr(cls, "pool_rule", None)
    if rule is not None and not isinstance(rule, PoolRule):
        raise ValueError(f"{cls.__name__}.pool_rule must be a PoolRule or None, got {type(rule).__name__}")
    REGISTRY[cls.name] = Registration(cls.name, cls, rule, bool(getattr(cls, "needs_tree", True)))
    POLICIES[cls.name] = cls
    _BY_PARAMS[cls.Params] = cls.name
    return cls


def registration(name: str) -> Registration:
    """The registration of policy ``name``; ``ValueError`` naming the registered ones otherwise."""
    reg = REGISTRY.get(name) if isinstance(name, str) else None
    if reg is None:
        from .params import shown  # local: params imports this module's registry

        raise ValueError(f"policy must be one of {sorted(REGISTRY)}, got {shown(name)}")
    return reg


def registration_of(params: "PolicyParams") -> Registration:
    """The registration whose parameter class is exactly ``type(params)`` (each policy has its own)."""
    name = _BY_PARAMS.get(type(params))
    if name is None:
        raise ValueError(f"{type(params).__name__} is no registered policy's parameter class")
    return REGISTRY[name]


def pool_rule_of(params: "PolicyParams") -> PoolRule:
    """The SGLang pool rule of ``params``' policy; ``ValueError`` naming the policy and the ones a server can
    draft when it was registered without one (for the engine only)."""
    reg = registration_of(params)
    if reg.pool_rule is None:
        servable = sorted(n for n, r in REGISTRY.items() if r.pool_rule is not None)
        raise ValueError(f"policy {reg.name!r} has no SGLang pool rule (registered without pool_rule), so a server "
                         f"cannot draft it; policies a server can draft: {servable}")
    return reg.pool_rule
