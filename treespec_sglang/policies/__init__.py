"""Draft-tree policies behind one batched interface, selectable per request.

``grow_tree(specs, root_tokens, root_logprobs, expand)`` is the entry point; policies register
themselves in :data:`POLICIES` by name (``eagle2``, ``talon``, ``salf``, ``c2t``, ``chain``, and
``none``: speculation off for one request).
"""

from . import c2t, chain, eagle2, off, salf, talon  # noqa: F401  (registration)
from .base import POLICIES, TreePolicy, parse_spec, register_policy
from .classifier import C2TClassifier
from .grow import grow_tree, parse_specs
from .params import C2TParams, ChainParams, Eagle2Params, NoneParams, PolicyParams, SalfParams, TalonParams

__all__ = ["grow_tree", "parse_spec", "parse_specs", "POLICIES", "TreePolicy", "register_policy",
           "C2TClassifier", "PolicyParams", "Eagle2Params", "TalonParams", "SalfParams", "C2TParams",
           "ChainParams", "NoneParams"]
