"""``GenerateOptions``: ``SpecEngine.generate``'s per-call options, validated once before any compute."""

from __future__ import annotations

import numbers
from dataclasses import dataclass
from typing import Optional, Union

from ..verify.sampling import check_sampling

__all__ = ["GenerateOptions"]


def _int_at_least(name: str, v, lo: int, what: str = "") -> None:
    if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < lo:
        raise ValueError(f"{name} must be an integer >= {lo}{what}, got {v!r}")


@dataclass(frozen=True)
class GenerateOptions:
    """Per-call options of :meth:`~treespec_sglang.engine.SpecEngine.generate` (its docstring says what each
    does). ``__post_init__`` raises ``ValueError`` naming the field and its allowed range."""

    max_new_tokens: int
    temperature: float = 0.0
    top_k: int = -1
    top_p: float = 1.0
    seed: Optional[int] = None
    chat: bool = True
    token_cap: Optional[Union[int, str]] = None  # tokens the batch verifies per round, "auto" or None
    calibrate: bool = False
    draft_prune: float = 0.5

    def __post_init__(self):
        _int_at_least("max_new_tokens", self.max_new_tokens, 1)
        check_sampling(self.temperature, self.top_k, self.top_p)
        if self.token_cap is not None and self.token_cap != "auto":
            _int_at_least("token_cap", self.token_cap, 1, " (tokens per round for the batch), 'auto' or None")
        p = self.draft_prune
        if isinstance(p, bool) or not isinstance(p, numbers.Real) or not 0 <= p <= 1:
            raise ValueError(f"draft_prune must be a number in [0, 1] (0 = no draft pruning), got {p!r}")
        if self.calibrate and self.token_cap is None:
            raise ValueError("calibrate=True needs token_cap (it weighs the batch allocation)")
        object.__setattr__(self, "max_new_tokens", int(self.max_new_tokens))

    @property
    def sampling(self) -> dict:
        """verify_tree's / sample's keywords."""
        return dict(temperature=self.temperature, top_k=self.top_k, top_p=self.top_p)
