"""Per-request policy parameters: frozen dataclasses validated in ``__post_init__``.

Parameter names are shared with the engine and the SGLang plugin. ``budget`` always counts the
root (the papers' N, SGLang's ``num_draft_tokens``). Every error names the field and the
allowed range.
"""

from __future__ import annotations

import math
import reprlib
import numbers
from dataclasses import dataclass, fields
from typing import Any, Optional

__all__ = ["PolicyParams", "Eagle2Params", "TalonParams", "SalfParams", "C2TParams", "ChainParams", "NoneParams",
           "MAX_BUDGET", "MAX_TOPK", "MAX_DEPTH"]

MAX_BUDGET = 1024
MAX_TOPK = 64
MAX_DEPTH = 64


_SHORT = reprlib.Repr()
_SHORT.maxlong, _SHORT.maxstring, _SHORT.maxother = 24, 40, 40


def shown(value: Any) -> str:
    """``repr(value)`` cut short (an error message echoes a client's value, never all of a huge one).

    >>> shown(10 ** 100)
    '1000000000...00000000000'
    """
    return _SHORT.repr(value)


def _int(policy: str, name: str, value: Any, lo: int, hi: int) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):  # numpy ints pass, True does not
        raise ValueError(f"{policy}.{name} must be an integer in [{lo}, {hi}], got {shown(value)}")
    if not lo <= value <= hi:
        raise ValueError(f"{policy}.{name} must be in [{lo}, {hi}], got {shown(value)}")


def _float(policy: str, name: str, value: Any, lo: float, hi: float) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{policy}.{name} must be a number in [{lo}, {hi}], got {shown(value)}")
    # the range first: an int too large for a float (10 ** 400) fails it instead of overflowing isfinite
    if not (lo <= value <= hi and math.isfinite(value)):
        raise ValueError(f"{policy}.{name} must be in [{lo}, {hi}], got {shown(value)}")


def _classifier(policy: str, value: Any) -> None:
    if value is None:
        return
    if isinstance(value, str):  # loaded (once per file version) here, so a bad file fails its request only
        from .classifier import load_classifier

        try:
            load_classifier(value)
        except ValueError as e:
            raise ValueError(f"{policy}.{e}") from None
        return
    import torch  # local: params stay importable without touching nn

    if not isinstance(value, torch.nn.Module):
        raise ValueError(f"{policy}.classifier must be a file path or a C2TClassifier module, got {type(value).__name__}")


@dataclass(frozen=True)
class PolicyParams:
    """Base of all parameter sets; ``policy`` names the registry entry."""

    @classmethod
    def field_names(cls) -> list:
        return [f.name for f in fields(cls)]

    @property
    def max_nodes(self) -> int:
        """Upper bound on the final tree size (root included)."""
        return self.budget  # type: ignore[attr-defined]


@dataclass(frozen=True)
class Eagle2Params(PolicyParams):
    """EAGLE-2 (§4.1 expand top-k by value, §4.2 rerank to the global top-N)."""

    budget: int = 60
    topk: int = 10
    depth: int = 6

    def __post_init__(self):
        _int("eagle2", "topk", self.topk, 1, MAX_TOPK)
        _int("eagle2", "depth", self.depth, 1, MAX_DEPTH)
        cap = 1 + self.topk + (self.depth - 1) * self.topk ** 2
        _int("eagle2", "budget", self.budget, 1, min(MAX_BUDGET, cap))


@dataclass(frozen=True)
class TalonParams(PolicyParams):
    """TALON Alg. 2: top-K root, confidence gate p(u) >= mu * max, global budget N."""

    budget: int = 60
    topk: int = 10
    mu: float = 0.03

    def __post_init__(self):
        _int("talon", "budget", self.budget, 1, MAX_BUDGET)
        _int("talon", "topk", self.topk, 1, MAX_TOPK)
        _float("talon", "mu", self.mu, 0.0, 1.0)


DEFAULT_SALF_BATCH = 10


@dataclass(frozen=True)
class SalfParams(PolicyParams):
    """SALF Alg. 2: capacity-N queue, B pops per iteration, stop when the best-B sum < th.

    ``batch`` left unset is ``min(10, budget)`` (App. D's B = 10, adapted to a smaller budget); a value
    the caller sets must fit ``[1, min(budget, 64)]``. ``max_depth`` bounds the tree's depth (None: no bound): a
    node at it enters the tree as any other (App. B's depth-bounded optimal tree, Def. B.1) and has no children.
    """

    budget: int = 60
    batch: Optional[int] = None
    th: float = 0.6
    max_depth: Optional[int] = None

    def __post_init__(self):
        _int("salf", "budget", self.budget, 1, MAX_BUDGET)
        if self.batch is None:
            object.__setattr__(self, "batch", min(DEFAULT_SALF_BATCH, self.budget))
        _int("salf", "batch", self.batch, 1, max(1, min(self.budget, MAX_TOPK)))
        _float("salf", "th", self.th, 0.0, 1.0)
        if self.max_depth is not None:
            _int("salf", "max_depth", self.max_depth, 1, MAX_DEPTH)


@dataclass(frozen=True)
class C2TParams(PolicyParams):
    """C2T App. A: classifier score >= beta gate, top-K per layer, until max_depth."""

    budget: int = 60
    topk: int = 10
    beta: float = 0.5
    max_depth: int = 10
    classifier: Any = None  # None = package default, a path, or a C2TClassifier

    def __post_init__(self):
        _int("c2t", "budget", self.budget, 1, MAX_BUDGET)
        _int("c2t", "topk", self.topk, 1, MAX_TOPK)
        _float("c2t", "beta", self.beta, 0.0, 1.0)
        _int("c2t", "max_depth", self.max_depth, 1, MAX_DEPTH)
        _classifier("c2t", self.classifier)


@dataclass(frozen=True)
class ChainParams(PolicyParams):
    """A top-1 chain of ``length`` draft tokens; with ``beta`` set, C2T early stop (C2T §5.4, App. I)."""

    length: int = 5
    beta: Optional[float] = None
    classifier: Any = None

    def __post_init__(self):
        _int("chain", "length", self.length, 0, MAX_DEPTH)
        if self.beta is not None:
            _float("chain", "beta", self.beta, 0.0, 1.0)
        if self.classifier is not None and self.beta is None:
            raise ValueError("chain.classifier needs chain.beta in [0.0, 1.0] (the early-stop threshold)")
        _classifier("chain", self.classifier)

    @property
    def max_nodes(self) -> int:
        return self.length + 1


@dataclass(frozen=True)
class NoneParams(PolicyParams):
    """Speculation off for this request: the tree is the root alone (plain decoding), no parameters."""

    @property
    def max_nodes(self) -> int:
        return 1
